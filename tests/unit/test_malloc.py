"""glibc's malloc kept from returning freed tensor memory between passes: asked by default, off
with RLCTL_MALLOC=default, a bad value refused with the choices, decided once per process; on a
CPU machine every block served from glibc's heap and the heap never trimmed, so a pass's large
tensors, freed and made again, fault no pages in once the heap has settled; on a machine with a
GPU only blocks under 32 MB (the faults and seconds it saves: bench/malloc_bench.py)."""

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
    with pytest.raises(InputError, match="RLCTL_MALLOC='off': use one of keep, small, default"):
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


def test_on_a_cpu_machine_no_block_comes_from_a_mapping_of_its_own_and_the_heap_is_never_trimmed(monkeypatch):
    libc = RecordingLibc()
    monkeypatch.setattr(malloc, "_state", None)
    monkeypatch.setattr(malloc, "_glibc", lambda: libc)
    assert malloc.keep_freed_memory({}, gpu=False) == malloc.KEPT
    assert libc.calls == [(-4, 0), (-1, -1)]  # M_MMAP_MAX = 0, M_TRIM_THRESHOLD = -1 (never; malloc.h)


def test_on_a_machine_with_a_gpu_only_blocks_under_32_mb_come_from_the_heap(monkeypatch):
    libc = RecordingLibc()
    monkeypatch.setattr(malloc, "_state", None)
    monkeypatch.setattr(malloc, "_glibc", lambda: libc)
    assert malloc.keep_freed_memory({}, gpu=True) == malloc.KEPT_SMALL
    assert libc.calls == [(-3, 32 << 20), (-1, 1 << 30)]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD


def test_rlctl_malloc_small_asks_for_the_small_block_policy_on_any_machine(monkeypatch):
    libc = RecordingLibc()
    monkeypatch.setattr(malloc, "_state", None)
    monkeypatch.setattr(malloc, "_glibc", lambda: libc)
    assert malloc.keep_freed_memory({"RLCTL_MALLOC": "small"}, gpu=False) == malloc.KEPT_SMALL
    assert libc.calls == [(-3, 32 << 20), (-1, 1 << 30)]


def test_a_gpu_is_seen_by_its_device_nodes(monkeypatch):
    monkeypatch.setattr(malloc.os.path, "exists", lambda path: path == "/dev/nvidiactl")
    assert malloc.shows_gpu()
    monkeypatch.setattr(malloc.os.path, "exists", lambda path: False)
    assert not malloc.shows_gpu()


def test_another_c_library_keeps_its_own_policy(monkeypatch):
    monkeypatch.setattr(malloc, "_state", None)
    monkeypatch.setattr(malloc, "_glibc", lambda: None)
    assert malloc.keep_freed_memory({}) == malloc.NOT_GLIBC


@pytest.mark.skipif(malloc._glibc() is None, reason="not glibc")
def test_a_fresh_rlctl_process_keeps_freed_memory_unless_told_not_to():
    code = "from rlctl import process_setup, malloc; process_setup.prepare(); print(malloc.state())"
    kept = malloc.KEPT_SMALL if malloc.shows_gpu() else malloc.KEPT
    for choice, expected in (("keep", kept), ("small", malloc.KEPT_SMALL), ("default", malloc.DEFAULT)):
        env = {**os.environ, "RLCTL_MALLOC": choice}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60, check=True)
        assert done.stdout.split()[-1] == expected


PASS_FAULTS = """
import resource
from rlctl import process_setup
process_setup.prepare()
import torch

x = torch.ones(16 << 20)  # 64 MiB: past glibc's largest mmap threshold (32 MiB)

def a_pass():  # three more such tensors at once, freed at its end, as a forward pass's activations
    y = x * 2
    z = y + x
    return float(torch.softmax(z, 0)[0])

for _ in range(40):  # the heap settles: its first passes leave holes that later ones fill (after 20, one more block was still faulted in half the runs on the Xeon)
    a_pass()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    a_pass()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(malloc._glibc() is None or malloc.shows_gpu(), reason="not glibc, or a machine with a GPU (small blocks only)")
def test_a_passs_large_tensors_reuse_their_pages_once_the_heap_has_settled():
    faults = {}
    for choice in ("keep", "default"):
        env = {**os.environ, "RLCTL_MALLOC": choice}
        done = subprocess.run([sys.executable, "-c", PASS_FAULTS], capture_output=True, text=True, env=env, timeout=120, check=True)
        faults[choice] = int(done.stdout.split()[-1])
    pages = (64 << 20) // os.sysconf("SC_PAGESIZE")
    assert faults["default"] > 10 * pages  # glibc maps each anew: five passes × three tensors' pages faulted in again
    assert faults["keep"] < pages  # the freed blocks' pages, reused (less than one tensor's worth in five passes)
