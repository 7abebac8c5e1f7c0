"""What every rlctl process does before torch loads (the CLI, and rlctl's Ray workers through
Ray's worker setup hook): MKL's kernels chosen (rlctl.mkl_kernels) and glibc's malloc kept from
returning freed tensor memory between passes (rlctl.malloc). Imports nothing that loads torch."""

from __future__ import annotations

from rlctl import malloc, mkl_kernels


def prepare() -> None:
    mkl_kernels.enable()
    malloc.keep_freed_memory()
