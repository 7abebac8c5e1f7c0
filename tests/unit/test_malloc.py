"""glibc's malloc kept from returning freed tensor memory between passes: asked by default, off
with RLCTL_MALLOC=default, a bad value refused with the choices, decided once per process, glibc's
thresholds set to what was measured (the faults and seconds it saves: bench/malloc_bench.py)."""

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


def test_it_sets_the_mmap_threshold_to_glibcs_largest_and_trims_only_past_a_gib(monkeypatch):
    libc = RecordingLibc()
    monkeypatch.setattr(malloc, "_state", None)
    monkeypatch.setattr(malloc, "_glibc", lambda: libc)
    assert malloc.keep_freed_memory({}) == malloc.KEPT
    assert libc.calls == [(-3, 32 << 20), (-1, 1 << 30)]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD (malloc.h)


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
