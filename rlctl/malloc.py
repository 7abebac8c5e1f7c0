"""glibc's malloc kept from handing freed tensor memory back to the kernel between passes.

torch's CPU tensors come from malloc. glibc serves a block above its mmap threshold from a
mapping of its own and unmaps it when freed, and gives the heap's free top back once it passes
the trim threshold, so every training pass faults its activations' pages in again (small
preset, the TRL harness's update: 16–180 thousand minor faults per update after the first two).
With the mmap threshold at glibc's maximum (32 MB) and trimming only past 1 GiB, the same
update faults 0–3 thousand pages and takes 3–14% less (bench/malloc_bench.py; bench/RESULTS.md,
"Freed memory kept").
What it costs: memory freed in blocks under 32 MB stays with the process, up to its peak use,
instead of going back while it runs. The CLI and rlctl's Ray workers call `keep_freed_memory()`
first thing; `RLCTL_MALLOC=default` leaves glibc's own policy. Other C libraries: nothing changes.
"""

from __future__ import annotations

import ctypes
import os

from rlctl.errors import InputError

OVERRIDE_ENV = "RLCTL_MALLOC"
CHOICES = ("keep", "default")
MMAP_THRESHOLD = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)

# what keep_freed_memory() decided in this process: None (not asked yet) or one of these
KEPT = "kept"  # the thresholds are set
DEFAULT = "default"  # RLCTL_MALLOC=default: glibc's own policy
NOT_GLIBC = "not-glibc"  # another C library (or none found): its own policy
_state: str | None = None


def requested(environ: dict | None = None) -> str:
    """RLCTL_MALLOC's choice ("keep" when unset); anything else is an input error."""
    choice = (os.environ if environ is None else environ).get(OVERRIDE_ENV, "").strip().lower() or "keep"
    if choice not in CHOICES:
        raise InputError(f"{OVERRIDE_ENV}={choice!r}: use one of {', '.join(CHOICES)}")
    return choice


def keep_freed_memory(environ: dict | None = None) -> str:
    """Set glibc's mmap and trim thresholds (see the module's text) unless RLCTL_MALLOC says
    not to; once per process (a second call returns the first's decision)."""
    global _state
    if _state is not None:
        return _state
    if requested(environ) == "default":
        _state = DEFAULT
        return _state
    libc = _glibc()
    if libc is None:
        _state = NOT_GLIBC
        return _state
    set_mmap = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    set_trim = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    _state = KEPT if set_mmap == 1 and set_trim == 1 else NOT_GLIBC
    return _state


def state() -> str | None:
    """What `keep_freed_memory()` decided in this process; None if it was not called."""
    return _state


def _glibc() -> ctypes.CDLL | None:
    """The C library this process runs on, if it is glibc (its own symbols: no library search,
    which would spawn `ldconfig` at every start)."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None
