"""glibc's malloc kept from handing freed tensor memory back to the kernel between passes.

torch's CPU tensors come from malloc. glibc serves a block above its mmap threshold (at most
32 MB) from a mapping of its own and unmaps it when freed, and gives the heap's free top back
once it passes the trim threshold, so every pass faults its large tensors' pages in again: the
activations, logits and gradients of any real model, each pass and each decode step (a 45 MB
product: 11,000 faults, 12 ms instead of 2.7). On a machine whose models compute on the CPU,
no block is served from a mapping of its own (M_MMAP_MAX = 0: every block from the heap, reused
once freed) and the heap is never trimmed: a process faults its memory in once and reuses it.
The medium preset's update (Qwen2.5-0.5B's shape, 16 rows, fp32) faults ~2 million pages less
per call and takes 0.70× the time of glibc's policy (~0.79× that of the small-block policy
below), its generation 0.76×; the small preset's update faults 0–8 thousand pages instead of
16–180 thousand and takes 3–14% less. End to end, the medium preset's pipeline with a
checkpoint after every iteration: 0.90× the wall time of the small-block policy and 0.89× glibc's,
with the same largest resident size (bench/malloc_bench.py; bench/RESULTS.md, "Freed memory kept",
"Large blocks from the heap" and "... end to end").
What it costs: memory the process freed stays with it, and a heap reused by blocks of many sizes
leaves holes: the largest resident size +3–9% in those runs, up to a few times the largest
block in a small process (settled after ~6 passes; bounded, not a leak). On a machine that shows
a GPU (NVIDIA's or AMD's device nodes) the models compute there and the CPU's large blocks are
one-off copies (weights gathered for a checkpoint) that a never-trimmed heap would keep: there
only blocks under 32 MB come from the heap, and it is trimmed past 1 GiB.
The CLI and rlctl's Ray workers call `keep_freed_memory()` first thing; `RLCTL_MALLOC=small`
asks for the small-block policy on any machine, `RLCTL_MALLOC=default` leaves glibc's own.
Other C libraries: nothing changes.
"""

from __future__ import annotations

import ctypes
import os

from rlctl.errors import InputError

OVERRIDE_ENV = "RLCTL_MALLOC"
CHOICES = ("keep", "small", "default")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4  # mallopt's parameter numbers (malloc.h)
# (parameter, value) pairs: CPU machines — no block from a mapping of its own (glibc still maps
# where its heap cannot grow), and a trim threshold of -1 (SIZE_MAX to glibc: never)
HEAP_ONLY = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1))
# machines with a GPU — blocks under glibc's largest mmap threshold (32 MB) from the heap, trimmed past 1 GiB
SMALL_BLOCKS = ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 1 << 30))
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd")  # NVIDIA's driver, AMD's ROCm

# what keep_freed_memory() decided in this process: None (not asked yet) or one of these
KEPT = "kept"  # every block from the heap, never trimmed (HEAP_ONLY)
KEPT_SMALL = "kept-small"  # blocks under 32 MB from the heap (SMALL_BLOCKS: a machine with a GPU)
DEFAULT = "default"  # RLCTL_MALLOC=default: glibc's own policy
NOT_GLIBC = "not-glibc"  # another C library (or none found): its own policy
_state: str | None = None


def requested(environ: dict | None = None) -> str:
    """RLCTL_MALLOC's choice ("keep" when unset); anything else is an input error."""
    choice = (os.environ if environ is None else environ).get(OVERRIDE_ENV, "").strip().lower() or "keep"
    if choice not in CHOICES:
        raise InputError(f"{OVERRIDE_ENV}={choice!r}: use one of {', '.join(CHOICES)}")
    return choice


def keep_freed_memory(environ: dict | None = None, *, gpu: bool | None = None) -> str:
    """Serve every block from glibc's heap and never trim it, or only blocks under 32 MB on a
    machine with a GPU (`gpu`; None: `shows_gpu()`; see the module's text) or when RLCTL_MALLOC
    says "small", glibc's own policy when it says "default"; once per process (a second call returns the first's decision)."""
    global _state
    if _state is not None:
        return _state
    choice = requested(environ)
    if choice == "default":
        _state = DEFAULT
        return _state
    libc = _glibc()
    if libc is None:
        _state = NOT_GLIBC
        return _state
    small_blocks = choice == "small" or (shows_gpu() if gpu is None else gpu)
    settings = SMALL_BLOCKS if small_blocks else HEAP_ONLY
    all_set = all([libc.mallopt(parameter, value) == 1 for parameter, value in settings])
    _state = (KEPT_SMALL if small_blocks else KEPT) if all_set else NOT_GLIBC
    return _state


def shows_gpu() -> bool:
    """Whether this machine shows its processes a GPU (NVIDIA's or AMD's device nodes)."""
    return any(os.path.exists(node) for node in GPU_DEVICE_NODES)


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
