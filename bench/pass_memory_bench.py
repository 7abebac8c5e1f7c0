"""Benchmark: a pipeline's largest resident size and its time under update.micro_batch_tokens
settings — what "auto" decides for a model and this machine's memory (rlctl.passes) against a
fixed cap.

One `rlctl pipeline` process per setting and round, alternating (bench.pipeline_bench's work at
the TRL harness's shape: 16 prompts × 4 samples × 64 new tokens, the 64 rows in one micro-batch,
GRPO with a reference, fp32; a checkpoint at the end). Per run: the cap the run decided, its
largest resident size, the process's wall time, and the mean iteration and update seconds.

    python -m bench.pass_memory_bench --preset medium --caps 4096,auto --rounds 1
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.pipeline_bench import machine_name, one_run, publish

PROMPTS, SAMPLES, TOKENS = 16, 4, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="medium", help="the model: a `rlctl model init` preset")
    parser.add_argument("--model", type=Path, help="an HF folder to use instead of a fresh preset")
    parser.add_argument("--caps", default="4096,auto", help="update.micro_batch_tokens values, comma-separated")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--append", help="append the Markdown result to this file")
    args = parser.parse_args()
    caps = args.caps.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlctl-pass-memory-") as scratch:
        model = args.model or Path(scratch) / args.preset
        if args.model is None:
            subprocess.run([sys.executable, "-m", "rlctl", "model", "init", str(model), "--preset", args.preset], check=True, stdout=subprocess.DEVNULL)
        for r in range(1, args.rounds + 1):
            for cap in caps:
                with tempfile.TemporaryDirectory(dir=scratch) as workdir:
                    overrides = [f"update.micro_batch_tokens={cap}", f"update.micro_batch_size={PROMPTS * SAMPLES}", "update.bf16=false", "rollout.dtype=fp32", "score.dtype=fp32"]
                    result = one_run(Path(workdir), model, args.iterations, PROMPTS, SAMPLES, TOKENS, overrides)
                rows.append(
                    f"| {r} | {cap} | {result['update.micro_batch_tokens']:.0f} | {result['largest resident size GB']:.1f} "
                    f"| {result['process wall s (incl. start, model load, checkpoint)']:.1f} | {result['iteration s']:.2f} | {result['update s/iter']:.2f} |"
                )
    source = f"--model {args.model}" if args.model else f"--preset {args.preset}"
    publish([
        f"- machine: {machine_name('cpu')}, Python {platform.python_version()}",
        f"- command: `python -m bench.pass_memory_bench {source} --caps {args.caps} --rounds {args.rounds} --iterations {args.iterations}`",
        f"- one `rlctl pipeline` process per row ({args.iterations} iterations of {PROMPTS} prompts × {SAMPLES} samples × {TOKENS} new tokens, "
        "one micro-batch of all rows, fp32, a checkpoint at the end); settings alternating; per-iteration figures are means over its iterations",
        "",
        "| round | update.micro_batch_tokens | decided | largest resident size (GB) | process wall (s) | iteration (s) | update (s) |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ], args.append)


if __name__ == "__main__":
    main()
