"""Benchmark: `rlctl verify` over a run of many iterations — the walk's bookkeeping, not the
hashing (sizes only).

A run-shaped tree is written once: `--iterations` folders of five committed stage outputs each
(one small part apiece, as a pipeline's `iter-NNNN/STAGE` folders), then `verify_tree(root,
digests=False)` is timed `--rounds` times; the table gives each round and the median.

    python -m bench.verify_bench --iterations 200,1000
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

STAGES = ("rollout", "score", "advantage", "update", "eval")


def run_tree(root: Path, iterations: int) -> None:
    """`iterations` × len(STAGES) committed one-row shard folders under `root`."""
    import pyarrow as pa

    from rlctl import shards
    from rlctl.manifest import Manifest

    table = pa.table({"id": ["row-0"], "value": [1.0]})
    for n in range(1, iterations + 1):
        for stage in STAGES:
            shards.write(table, str(root / f"iter-{n:04d}" / stage), Manifest(stage=stage, config={}, inputs=[]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", default="200,1000", help="run sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from rlctl.verify import verify_tree

    print("| iterations | committed folders | seconds per verify (rounds) | median |")
    print("|---|---|---|---|")
    for iterations in [int(n) for n in args.iterations.split(",")]:
        with tempfile.TemporaryDirectory(prefix="rlctl-verify-bench-") as scratch:
            root = Path(scratch) / "run"
            run_tree(root, iterations)
            times, found = [], 0
            for _ in range(args.rounds):
                start = time.perf_counter()
                found = len(verify_tree(str(root), digests=False))
                times.append(time.perf_counter() - start)
            print(f"| {iterations} | {found} | {', '.join(f'{t:.2f}' for t in times)} | {statistics.median(times):.2f} |", flush=True)


if __name__ == "__main__":
    main()
