"""How many CPU threads torch uses: as many as the CPUs this process may run on, fewer while
other processes keep some of them busy.

Two things go wrong on a shared machine. A container's CPU quota (cgroup `cpu.max`) is not in
the affinity mask OpenMP sizes its pool from, so torch starts more threads than it may run:
`configure_openmp()` (the CLI calls it before torch is imported) sets OMP_NUM_THREADS to the
CPUs really available, unless the user set it. And when another CPU-bound process holds one of
the cores, torch's threads spin at every barrier waiting for the one that was descheduled
(bench/RESULTS.md "A busy CPU": a tiny-model iteration 15× slower beside another torch
program). `ThreadGovernor` measures, between stages, how much of our CPUs other processes used
(/proc/stat minus our own CPU time) and sets torch's thread count to what they leave free.
OMP_WAIT_POLICY=PASSIVE, the other cure, was measured too: it makes the quiet case 1.8× slower.

The thread count is an input of the numbers: reductions and GEMMs split their work by thread,
so a run at 1 thread and one at 2 differ in the last bits. A governor therefore starts every
run at one well-defined count (`configured_threads`, never what an earlier run in the same
process left behind), gives the process its thread count back when the run ends, and holds a
fixed count when asked (`[workers] threads = N`): then a run killed and resumed on a busy
machine still ends bit-identical to one that never stopped.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path


def available_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup v2/v1 CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return max(1, min(cpus, math.ceil(quota))) if quota else max(1, cpus)


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota of this cgroup in CPUs (`cpu.max` "200000 100000" → 2.0), None if unlimited
    or unreadable; cgroup v1's cfs files where there is no v2 `cpu.max`."""
    v2 = (root / "cpu.max").read_text().split() if (root / "cpu.max").is_file() else None
    try:
        if v2 is not None:
            return None if v2[0] == "max" else int(v2[0]) / int(v2[1])
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError, IndexError):
        return None


def configure_openmp(environ: dict | None = None) -> dict[str, str]:
    """OMP_NUM_THREADS = the CPUs available, where the user set none; returns what was set.
    Has effect only before torch (libgomp) is loaded."""
    env = os.environ if environ is None else environ
    if "OMP_NUM_THREADS" in env:
        return {}
    env["OMP_NUM_THREADS"] = str(available_cpus())
    return {"OMP_NUM_THREADS": env["OMP_NUM_THREADS"]}


def configured_threads(environ: dict | None = None) -> int:
    """The thread count a run starts from: OMP_NUM_THREADS where it is set (by the user, or by
    the CLI from the CPUs available), else the CPUs available."""
    env = os.environ if environ is None else environ
    try:
        return max(1, int(env["OMP_NUM_THREADS"]))
    except (KeyError, ValueError):
        return available_cpus()


def busy_seconds(stat_text: str, cpus: set[int], ticks_per_second: float) -> float:
    """CPU seconds the listed CPUs spent busy since boot, from /proc/stat's `cpuN` lines
    (user, nice, system, irq, softirq, steal; not idle or iowait)."""
    total = 0
    for line in stat_text.splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
            total += user + nice + system + irq + softirq + steal
    return total / ticks_per_second


def threads_for(limit: int, others_busy: float) -> int:
    """Threads to run: the CPUs other processes leave free (rounded), at least 1, at most `limit`."""
    return max(1, min(limit, round(limit - max(0.0, others_busy))))


@dataclass(frozen=True)
class CpuSample:
    wall: float
    busy: float  # our CPUs' busy seconds, all processes
    own: float  # this process's CPU seconds


class ThreadGovernor:
    """torch's thread count for one run of local workers. `threads = 0`: before each stage,
    `adjust()` sets it from how busy other processes kept our CPUs since the last call (at most
    `configured_threads()`); `threads = N`: N throughout. `restore()` gives the process back the
    count it had. /proc/stat unreadable: the starting count throughout."""

    MIN_WINDOW = 0.05  # seconds; shorter windows say nothing

    def __init__(self, threads: int = 0) -> None:
        import torch

        self.adaptive = threads == 0
        self.limit = threads or configured_threads()
        self.previous = torch.get_num_threads()
        torch.set_num_threads(self.limit)
        try:
            self.cpus = os.sched_getaffinity(0)
        except (AttributeError, OSError):
            self.cpus = set(range(os.cpu_count() or 1))
        self.ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last = self._sample()

    def _sample(self) -> CpuSample | None:
        try:
            stat = Path("/proc/stat").read_text()
        except OSError:
            return None
        return CpuSample(time.monotonic(), busy_seconds(stat, self.cpus, self.ticks), time.process_time())

    def adjust(self) -> int:
        """Set and return torch's thread count for the next stage."""
        import torch

        current = torch.get_num_threads()
        if not self.adaptive:
            return current
        now, last = self._sample(), self._last
        if now is None or last is None or now.wall - last.wall < self.MIN_WINDOW:
            return current
        others = ((now.busy - last.busy) - (now.own - last.own)) / (now.wall - last.wall)
        self._last = now
        threads = threads_for(self.limit, others)
        if threads != current:
            torch.set_num_threads(threads)
        return threads

    def restore(self) -> None:
        """Give the process back the thread count it had before this run."""
        import torch

        torch.set_num_threads(self.previous)
