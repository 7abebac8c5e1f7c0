"""Benchmark: the GRPO example on a quiet CPU and beside one competing CPU-bound process.

On a 2-core machine a second busy process takes one core; OpenMP threads that spin-wait at
every barrier then fight it (FACTS.md: 15–20× slower). This runs `rlctl pipeline
examples/grpo.toml` for a few iterations, quiet and with a busy loop in another process, for
each OpenMP setting given, and reports seconds per iteration (median over runs) and the ratio.

    python -m bench.busy_cpu_bench --runs 3 --iterations 6                # competitor: another torch program
    python -m bench.busy_cpu_bench --competitor python                     # ... or a one-thread busy loop
    python -m bench.busy_cpu_bench --env OMP_WAIT_POLICY=ACTIVE --env OMP_WAIT_POLICY=PASSIVE
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


COMPETITORS = {
    "python": "while True: pass",  # one busy thread
    # another torch program with its own OpenMP pool (default threads, default wait policy)
    "torch": "import torch\nx = torch.randn(512, 512)\nwhile True: x = torch.tanh(x @ x / 512)",
}


@contextmanager
def competing_process(kind: str):
    """One CPU-bound process (`COMPETITORS[kind]`) for as long as the block runs."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    busy = subprocess.Popen([sys.executable, "-c", COMPETITORS[kind]], env=clean)
    try:
        time.sleep(0.5)
        yield
    finally:
        busy.kill()
        busy.wait()


def seconds_per_iteration(iterations: int, env: dict[str, str]) -> float:
    """Mean seconds of the iterations after the first (which pays for warm-up)."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        subprocess.run(
            [sys.executable, "-m", "rlctl", "pipeline", "examples/grpo.toml", "--run-dir", str(run), "--iterations", str(iterations), "--quiet"],
            cwd=ROOT, env={**os.environ, **env}, check=True, capture_output=True,
        )
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return statistics.mean(r["seconds/total"] for r in rows[1:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for one setting (repeat for several; none = rlctl's defaults)")
    parser.add_argument("--competitor", choices=sorted(COMPETITORS), default="torch")
    args = parser.parse_args()
    settings = [dict([item.split("=", 1)]) for item in args.env] or [{}]
    print("| setting | quiet s/iter | busy s/iter | busy / quiet |")
    print("|---|---|---|---|")
    for env in settings:
        quiet = statistics.median(seconds_per_iteration(args.iterations, env) for _ in range(args.runs))
        with competing_process(args.competitor):
            busy = statistics.median(seconds_per_iteration(args.iterations, env) for _ in range(args.runs))
        label = ", ".join(f"{k}={v}" for k, v in env.items()) or "rlctl defaults"
        print(f"| {label} | {quiet:.3f} | {busy:.3f} | {busy / quiet:.1f}× |", flush=True)


if __name__ == "__main__":
    main()
