"""glibc's malloc kept from returning freed tensor memory between passes: asked by default, off
with RLCTL_MALLOC=default, a bad value refused with the choices, decided once per process, every
block served from glibc's heap and the heap never trimmed, so a large tensor freed and made again
faults no pages in (the faults and seconds it saves: bench/malloc_bench.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlctl import malloc
from rlctl.errors import InputError


def test_the_choice_is_keep_unless_rlctl_malloc_says_default():
    assert malloc.requested({}) == "keep"
    assert malloc.requested({"RLCTL_MALLOC": " Default "}) == "default"
    with pytest.raises(InputError, match="RLCTL_MALLOC='off': use one of keep, default"):
        malloc.requested({"RLCTL_MALLOC": "off"})


def test_it_is_decided_once_per_process(monkeypatch):
    monkeypatch.setattr(malloc, "_state", None)
    assert malloc.keep_freed_memory({"RLCTL_MALLOC": "default"}) == malloc.DEFAULT
    assert malloc.keep_freed_memory({}) == malloc.DEFAULT  # the first decision holds
    assert malloc.state() == malloc.DEFAULT


class RecordingLibc:
    """What `keep_freed_memory` asks of glibc, answered as glibc does (1: set)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, parameter: int, value: int) -> int:
        self.calls.append((parameter, value))
        return 1


def test_it_serves_no_block_from_a_mapping_of_its_own_and_never_trims(monkeypatch):
    libc = RecordingLibc()
    monkeypatch.setattr(malloc, "_state", None)
    monkeypatch.setattr(malloc, "_glibc", lambda: libc)
    assert malloc.keep_freed_memory({}) == malloc.KEPT
    assert libc.calls == [(-4, 0), (-1, -1)]  # M_MMAP_MAX = 0, M_TRIM_THRESHOLD = -1 (never; malloc.h)


def test_another_c_library_keeps_its_own_policy(monkeypatch):
    monkeypatch.setattr(malloc, "_state", None)
    monkeypatch.setattr(malloc, "_glibc", lambda: None)
    assert malloc.keep_freed_memory({}) == malloc.NOT_GLIBC


@pytest.mark.skipif(malloc._glibc() is None, reason="not glibc")
def test_a_fresh_rlctl_process_keeps_freed_memory_unless_told_not_to():
    code = "from rlctl import process_setup, malloc; process_setup.prepare(); print(malloc.state())"
    for choice, expected in (("keep", malloc.KEPT), ("default", malloc.DEFAULT)):
        env = {**os.environ, "RLCTL_MALLOC": choice}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60, check=True)
        assert done.stdout.split()[-1] == expected


REMADE_TENSOR_FAULTS = """
import resource, sys
from rlctl import process_setup
process_setup.prepare()
import torch
big = torch.ones(16 << 20)  # 64 MiB: past glibc's largest mmap threshold (32 MiB)
del big
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
again = torch.ones(16 << 20)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(malloc._glibc() is None, reason="not glibc")
def test_a_large_tensor_freed_and_made_again_reuses_its_pages():
    faults = {}
    for choice in ("keep", "default"):
        env = {**os.environ, "RLCTL_MALLOC": choice}
        done = subprocess.run([sys.executable, "-c", REMADE_TENSOR_FAULTS], capture_output=True, text=True, env=env, timeout=120, check=True)
        faults[choice] = int(done.stdout.split()[-1])
    pages = (64 << 20) // os.sysconf("SC_PAGESIZE")
    assert faults["default"] > pages // 2  # glibc maps it anew: every page faulted in again
    assert faults["keep"] < pages // 20  # the freed block's pages, reused
