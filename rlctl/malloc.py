"""glibc's malloc kept from handing freed tensor memory back to the kernel between passes.

torch's CPU tensors come from malloc. glibc serves a block above its mmap threshold (at most
32 MB) from a mapping of its own and unmaps it when freed, and gives the heap's free top back
once it passes the trim threshold, so every pass faults its large tensors' pages in again: the
activations, logits and gradients of any real model, each pass and each decode step (a 45 MB
product: 11,000 faults, 12 ms instead of 2.7). With no block served from a mapping of its own
(M_MMAP_MAX = 0: every block from the heap, reused once freed) and the heap never trimmed, a
process faults its memory in once, up to its peak use, and reuses it: the medium preset's update
(Qwen2.5-0.5B's shape, 16 rows, fp32) faults ~2 million pages less per call and takes 0.70× the
time of glibc's policy (~0.79× that of a 32 MB mmap threshold with a 1 GiB trim threshold), its
generation 0.76×, the largest resident size +3–9%; the small preset's update (blocks under
32 MB) faults 0–8 thousand pages instead of 16–180 thousand and takes 3–14% less
(bench/malloc_bench.py; bench/RESULTS.md, "Freed memory kept" and "Large blocks from the heap").
What it costs: memory the process freed stays with it, up to its peak use, instead of going
back while it runs (a long-lived process keeps the pages of its largest pass: a pipeline's
stages reuse them every iteration). The CLI and rlctl's Ray workers call `keep_freed_memory()`
first thing; `RLCTL_MALLOC=default` leaves glibc's own policy. Other C libraries: nothing changes.
"""

from __future__ import annotations

import ctypes
import os

from rlctl.errors import InputError

OVERRIDE_ENV = "RLCTL_MALLOC"
CHOICES = ("keep", "default")
MMAP_MAX = 0  # blocks served from mappings of their own: none (glibc still maps where its heap cannot grow)
NEVER_TRIM = -1  # a trim threshold of -1 (SIZE_MAX to glibc) never trims
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # mallopt's parameter numbers (malloc.h)

# what keep_freed_memory() decided in this process: None (not asked yet) or one of these
KEPT = "kept"  # every block from the heap, never trimmed
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
    """Serve every block from glibc's heap and never trim it (see the module's text) unless
    RLCTL_MALLOC says not to; once per process (a second call returns the first's decision)."""
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
    set_mmap = libc.mallopt(_M_MMAP_MAX, MMAP_MAX)
    set_trim = libc.mallopt(_M_TRIM_THRESHOLD, NEVER_TRIM)
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
