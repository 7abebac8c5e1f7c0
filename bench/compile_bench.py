"""Benchmark: the update with its decoder layers compiled (`update.compile = true`) against the
same update eager, in one process, alternating — the figures behind rlctl.backends.compiled_layers
and its "auto" rule.

Two copies of the model are loaded, one trained with compiled layers and one eager, on the TRL
harness's update (bench.update_batch: 16 prompts × 4 samples, 12-token prompts, 40–64-token
responses; `--prompts` fewer for a large model). Per dtype: the first call of each (the compiled
one compiles: torch.compile's time, with inductor's on-disk cache as this machine has it), then
`--rounds` rounds of one call each, the order alternating, after one more warm-up round. The
saving per update against the first call's extra time says after how many updates compiling
pays.

    python -m bench.compile_bench --preset small --dtypes fp32,bf16 --rounds 6
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--model", help="a model folder (default: a new one of --preset, removed afterwards)")
    parser.add_argument("--dtypes", default="fp32,bf16", help="fp32 (update.bf16 = false) and/or bf16 (update.bf16 = true: autocast)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts of the harness's batch (4 samples each)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--append", help="append the Markdown result to this file")
    args = parser.parse_args()

    from rlctl import process_setup

    process_setup.prepare()  # before torch loads, as the CLI does
    from bench.pipeline_bench import machine_name, publish
    from rlctl.modelinit import init_model

    with tempfile.TemporaryDirectory(prefix="rlctl-compile-bench-") as scratch:
        folder = Path(args.model) if args.model else init_model(Path(scratch) / args.preset, args.preset, seed=0)
        rows = [measure(folder, dtype, args.prompts, args.rounds) for dtype in args.dtypes.split(",")]
    import torch

    source = f"--model {args.model}" if args.model else f"--preset {args.preset}"
    publish([
        f"- machine: {machine_name('cpu')}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        f"- command: `python -m bench.compile_bench {source} --dtypes {args.dtypes} --prompts {args.prompts} --rounds {args.rounds}`",
        f"- work: the TRL harness's update, {args.prompts} prompts × 4 samples, one optimizer step; eager and compiled copies alternating in one process",
        "",
        "| dtype | first call eager (s) | first call compiled (s) | eager (s), median | compiled (s), median | compiled / eager | saved per update (s) | updates to pay the first call back |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ], args.append)


def measure(folder: Path, dtype: str, prompts: int, rounds: int) -> str:
    """One table row: first calls and alternating medians of the eager and the compiled update."""
    from bench.update_batch import SAMPLES, harness_batch, harness_trainer
    from rlctl.backends.hf import HFPolicy

    bf16 = {"fp32": "false", "bf16": "true"}[dtype]
    trainers, batches = {}, {}
    for kind in ("eager", "compiled"):
        policy = HFPolicy.load(str(folder), "cpu")
        batches[kind] = harness_batch(policy, prompts=prompts)
        trainers[kind] = harness_trainer(policy, bf16, rows=prompts * SAMPLES, compile=kind == "compiled")
    first = {kind: timed(trainers[kind], batches[kind]) for kind in ("eager", "compiled")}
    seconds: dict[str, list[float]] = {"eager": [], "compiled": []}
    for r in range(rounds + 1):
        for kind in ("eager", "compiled") if r % 2 == 0 else ("compiled", "eager"):
            elapsed = timed(trainers[kind], batches[kind])
            if r:
                seconds[kind].append(elapsed)
    eager, compiled = statistics.median(seconds["eager"]), statistics.median(seconds["compiled"])
    saved = eager - compiled
    extra = first["compiled"] - first["eager"]
    payback = f"{extra / saved:.0f}" if saved > 0 else "never"
    return (
        f"| {dtype} | {first['eager']:.2f} | {first['compiled']:.2f} | {eager:.3f} ({min(seconds['eager']):.3f}–{max(seconds['eager']):.3f}) "
        f"| {compiled:.3f} ({min(seconds['compiled']):.3f}–{max(seconds['compiled']):.3f}) | {compiled / eager:.2f} | {saved:.3f} | {payback} |"
    )


def timed(trainer, batch) -> float:
    began = time.perf_counter()
    trainer.train(batch)
    return time.perf_counter() - began


if __name__ == "__main__":
    main()
