"""Thread counts: the CPUs a process may really use, and what other processes leave free."""

import torch

from rlctl.threads import (
    CpuSample,
    ThreadGovernor,
    available_cpus,
    busy_seconds,
    cgroup_cpu_quota,
    configure_openmp,
    configured_threads,
    threads_for,
)

STAT = """cpu  900 0 300 5000 10 0 0 0 0 0
cpu0 400 0 100 2500 5 0 0 0 0 0
cpu1 500 0 200 2500 5 10 5 5 0 0
cpu2 7000 0 0 0 0 0 0 0 0 0
intr 12345
"""


def test_busy_seconds_count_only_our_cpus_and_not_idle_time():
    assert busy_seconds(STAT, {0, 1}, ticks_per_second=100) == (400 + 100 + 500 + 200 + 10 + 5 + 5) / 100
    assert busy_seconds(STAT, {2}, ticks_per_second=100) == 70.0


def test_threads_are_the_cpus_other_processes_leave_free():
    assert threads_for(2, 0.0) == 2  # quiet
    assert threads_for(2, 0.95) == 1  # one competing process takes a core
    assert threads_for(2, 1.9) == 1  # never fewer than one
    assert threads_for(8, 2.2) == 6
    assert threads_for(2, -0.3) == 2  # measurement noise below zero


def test_a_cgroup_quota_caps_the_cpus(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path) is None
    assert cgroup_cpu_quota(tmp_path / "missing") is None


def test_configure_openmp_leaves_a_users_setting_alone():
    env = {"OMP_NUM_THREADS": "3"}
    assert configure_openmp(env) == {} and env == {"OMP_NUM_THREADS": "3"}
    fresh: dict = {}
    assert set(configure_openmp(fresh)) == {"OMP_NUM_THREADS"} and int(fresh["OMP_NUM_THREADS"]) >= 1


def test_a_run_starts_from_omp_num_threads_or_the_cpus_available():
    assert configured_threads({"OMP_NUM_THREADS": "3"}) == 3
    assert configured_threads({}) == available_cpus()
    assert configured_threads({"OMP_NUM_THREADS": "many"}) == available_cpus()


def test_a_governor_starts_at_the_configured_count_whatever_the_process_had_and_gives_it_back(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    before = torch.get_num_threads()
    torch.set_num_threads(3)  # what an earlier run in this process might have left
    try:
        governor = ThreadGovernor()
        assert torch.get_num_threads() == 2 and governor.limit == 2
        governor.restore()
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def others_keep_both_cpus_busy(governor: ThreadGovernor, monkeypatch) -> None:
    """The next sample: a second later, two CPU-seconds busy that were not ours."""
    last = governor._last
    monkeypatch.setattr(governor, "_sample", lambda: CpuSample(last.wall + 1.0, last.busy + 2.0, last.own))


def test_a_fixed_thread_count_holds_however_busy_the_machine_is(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    before = torch.get_num_threads()
    try:
        adaptive = ThreadGovernor()
        others_keep_both_cpus_busy(adaptive, monkeypatch)
        assert adaptive.adjust() == 1 and torch.get_num_threads() == 1
        fixed = ThreadGovernor(threads=2)
        others_keep_both_cpus_busy(fixed, monkeypatch)
        assert fixed.adjust() == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
