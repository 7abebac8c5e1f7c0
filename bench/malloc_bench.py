"""Benchmark: the update's page faults and seconds, or a whole pipeline's seconds, under
rlctl.malloc's policies (RLCTL_MALLOC: keep, small) and glibc's own (default).

Each setting in fresh processes (the policy is set once, at start), alternating. By default the
TRL harness's update (bench.update_batch; fp32 unless `--bf16`, the small preset by default) makes
`--calls` updates; per call the minor page faults (getrusage) and seconds. The table gives each
round's median over the calls after the first two (the first ones fault the process's memory in
either way). `--pipeline`: `rlctl pipeline` end to end (bench.pipeline_bench's work, `--prompts`
× 4 samples × 32 new tokens, a checkpoint every iteration as `pipeline.save_every = 1` does):
the process's wall time (start, model loads and checkpoint writes included) and its iterations.

    python -m bench.malloc_bench --rounds 2 --calls 7
    python -m bench.malloc_bench --preset medium --prompts 4 --rounds 2 --calls 6   # blocks past 32 MB
    python -m bench.malloc_bench --pipeline --preset medium --prompts 4 --rounds 3 --settings small,keep
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.pipeline_bench import machine_name, publish

SETTINGS = "default,keep"
PIPELINE_ITERATIONS = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, default=7)
    parser.add_argument("--prompts", type=int, default=16, help="prompts of the update batch (4 samples each)")
    parser.add_argument("--bf16", default="false", choices=("false", "true", "auto"), help="the update's bf16 autocast (update.bf16)")
    parser.add_argument("--settings", default=SETTINGS, help="RLCTL_MALLOC values to compare, comma-separated (keep, small, default)")
    parser.add_argument("--pipeline", action="store_true", help="time `rlctl pipeline` end to end instead of update calls")
    parser.add_argument("--append", help="append the Markdown result to this file")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: one process's measurement, for this model folder
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(Path(args.one), args.calls, args.bf16, args.prompts)))
        return

    from rlctl.modelinit import init_model

    with tempfile.TemporaryDirectory() as models:
        folder = init_model(Path(models) / args.preset, args.preset, seed=0)
        compare(folder, args)


def compare(folder: Path, args) -> None:
    """Each setting in its own processes, alternating; the Markdown result published."""
    settings = [setting.strip() for setting in args.settings.split(",")]
    if args.pipeline:
        lines = pipeline_rounds(folder, settings, args)
        publish(lines, args.append)
        return
    results: dict[tuple[int, str], dict] = {}  # (round, setting) → one process's measurement
    for r in range(1, args.rounds + 1):
        for setting in settings:
            env = {**os.environ, "RLCTL_MALLOC": setting}
            done = subprocess.run(
                [sys.executable, "-m", "bench.malloc_bench", "--one", str(folder), "--calls", str(args.calls), "--bf16", args.bf16,
                 "--prompts", str(args.prompts)],
                capture_output=True, text=True, env=env, check=True,
            )
            results[r, setting] = json.loads(done.stdout.strip().splitlines()[-1])

    def cell(result: dict) -> str:
        later = result["calls"][2:]
        seconds = statistics.median(c["seconds"] for c in later)
        faults = statistics.median(c["faults"] for c in later)
        return f"{seconds:.2f} s, {faults / 1000:.0f}k faults, largest RSS {result['max_rss_gb']:.2f} GB ({result['state']})"

    lines = [
        f"- machine: {machine_name('cpu')}, Python {platform.python_version()}",
        f"- command: `python -m bench.malloc_bench --preset {args.preset} --prompts {args.prompts} --rounds {args.rounds} --calls {args.calls} --bf16 {args.bf16} --settings {args.settings}`",
        f"- per update call, median over calls 3–{args.calls} of one process; settings alternating",
        "",
        "| round | " + " | ".join(f"RLCTL_MALLOC={setting}" for setting in settings) + " |",
        "|---|" + "---|" * len(settings),
        *(f"| {r} | " + " | ".join(cell(results[r, setting]) for setting in settings) + " |" for r in range(1, args.rounds + 1)),
    ]
    publish(lines, args.append)


def pipeline_rounds(folder: Path, settings: list[str], args) -> list[str]:
    """`rlctl pipeline` once per setting and round, alternating; a Markdown table of the runs."""
    from bench.pipeline_bench import one_run

    rows = []
    for r in range(1, args.rounds + 1):
        for setting in settings:
            with tempfile.TemporaryDirectory() as workdir:
                env = {**os.environ, "RLCTL_MALLOC": setting}
                dtype = {"false": "fp32", "true": "bf16", "auto": "auto"}[args.bf16]
                overrides = [f"update.bf16={args.bf16}", f"rollout.dtype={dtype}", f"score.dtype={dtype}"]
                result = one_run(Path(workdir), folder, PIPELINE_ITERATIONS, args.prompts, 4, 32, overrides, save_every=1, env=env)
            rows.append(
                f"| {r} | {setting} | {result['process wall s (incl. start, model load, checkpoint)']:.1f} | {result['iteration s']:.2f} "
                f"| {result['rollout s/iter']:.2f} | {result['update s/iter']:.2f} |"
            )
    return [
        f"- machine: {machine_name('cpu')}, Python {platform.python_version()}",
        f"- command: `python -m bench.malloc_bench --pipeline --preset {args.preset} --prompts {args.prompts} --rounds {args.rounds} --bf16 {args.bf16} --settings {args.settings}`",
        f"- one `rlctl pipeline` process per row ({PIPELINE_ITERATIONS} iterations, a checkpoint after each); settings alternating; per-iteration figures are means over its iterations",
        "",
        "| round | RLCTL_MALLOC | process wall (s) | iteration (s) | rollout (s) | update (s) |",
        "|---|---|---|---|---|---|",
        *rows,
    ]


def measure(folder: Path, calls: int, bf16: str, prompts: int) -> dict:
    """In this process: rlctl's process setup, then `calls` updates on the harness's shape."""
    from rlctl import malloc, process_setup

    process_setup.prepare()
    import resource
    import time

    from bench.update_batch import harness_batch, harness_trainer
    from rlctl.backends.hf import HFPolicy

    policy = HFPolicy.load(str(folder), "cpu")
    batch = harness_batch(policy, prompts=prompts)
    trainer = harness_trainer(policy, bf16, rows=batch.size)
    results = []
    for _ in range(calls):
        faults, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        trainer.train(batch)
        results.append({"seconds": time.perf_counter() - start, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults})
    max_rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # ru_maxrss: KiB on Linux
    return {"state": malloc.state(), "calls": results, "max_rss_gb": max_rss_gb}


if __name__ == "__main__":
    main()
