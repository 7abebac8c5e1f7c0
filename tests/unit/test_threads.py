"""Thread counts: the CPUs a process may really use, and what other processes leave free."""

from rlctl.threads import busy_seconds, cgroup_cpu_quota, configure_openmp, threads_for

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
