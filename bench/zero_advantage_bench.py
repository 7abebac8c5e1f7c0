"""Benchmark: the update with a share of GRPO's groups at advantage 0 (all samples scored alike),
rows of zero advantage left out (`update.skip_zero_advantage = true`, the default) against
trained as any other (false).

The harness's update (bench.update_batch: 16 prompts × 4 samples, responses of 40–64 tokens,
the small preset), without a KL loss, so a zero-advantage row's gradient is exactly 0. Per
share of zero groups, one process alternates the two settings `--calls` times after a warm-up
call each; seconds per update, median.

    python -m bench.zero_advantage_bench --shares 0,0.25,0.5 --calls 5
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path


def with_zero_groups(batch, share: float, samples: int):
    """`batch` with the first `share` of its prompt groups (`samples` rows each) at advantage 0."""
    groups = batch.size // samples
    advantages = batch.advantages.clone()
    advantages[: round(share * groups) * samples] = 0.0
    return replace(batch, advantages=advantages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--model", help="a model folder (default: a new one of --preset)")
    parser.add_argument("--shares", default="0,0.25,0.5", help="shares of the groups at advantage 0, comma-separated")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--append", help="append the Markdown result to this file")
    args = parser.parse_args()

    from rlctl import process_setup

    process_setup.prepare()
    import torch

    from bench.pipeline_bench import machine_name, publish
    from bench.update_batch import ROWS, SAMPLES, harness_batch
    from rlctl.backends.hf import HFPolicy
    from rlctl.config import UpdateConfig
    from rlctl.modelinit import init_model
    from rlctl.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="rlctl-zero-adv-") as scratch:
        folder = Path(args.model) if args.model else init_model(Path(scratch) / args.preset, args.preset, seed=0)
        policy = HFPolicy.load(str(folder), "cpu")
        base = harness_batch(policy)
        trainers = {skip: Trainer(policy, UpdateConfig(lr=1e-6, micro_batch_size=ROWS, bf16="false", skip_zero_advantage=skip)) for skip in (True, False)}
        source = f"--model {args.model}" if args.model else f"--preset {args.preset}"
        lines = [
            f"- machine: {machine_name('cpu')}, {torch.get_num_threads()} threads, Python {platform.python_version()}, torch {torch.__version__}",
            f"- command: `python -m bench.zero_advantage_bench {source} --shares {args.shares} --calls {args.calls}` (fp32, no KL loss)",
            "", "| groups at advantage 0 | rows left out | trained as any other (s) | left out (s) | ratio |", "|---|---|---|---|---|",
        ]
        for share in (float(s) for s in args.shares.split(",")):
            batch = with_zero_groups(base, share, SAMPLES)
            seconds: dict[bool, list[float]] = {True: [], False: []}
            skipped = 0.0
            for skip in (True, False):
                trainers[skip].train(batch)  # warm-up
            for _ in range(args.calls):
                for skip in (True, False):
                    began = time.perf_counter()
                    metrics = trainers[skip].train(batch)
                    seconds[skip].append(time.perf_counter() - began)
                    skipped = metrics["zero_advantage_skipped"] if skip else skipped
            full, left = statistics.median(seconds[False]), statistics.median(seconds[True])
            lines.append(f"| {share:.0%} | {skipped:.0%} | {full:.3f} | {left:.3f} | {left / full:.2f} |")
    publish(lines, args.append)


if __name__ == "__main__":
    main()
