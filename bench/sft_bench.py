"""Benchmark: `rlctl sft` and TRL's SFTTrainer side by side on identical work.

The same small-preset model (made here, random weights), the same examples (a prompt, then a
completion of 8–40 counted numbers: responses of uneven length, as real demonstrations have),
the same shape: 16 examples per optimizer step in micro-batches of 4, loss on the completion
only, constant lr, AdamW, activations kept for the backward on both sides (SFTConfig's default
would recompute them: `--trl-checkpointing`). Each side runs two epochs in a fresh process; the
figure is the second epoch's seconds per optimizer step (the first is warm-up), then the median
over alternating rounds. TRL runs in the venv bench/trl_bench.py makes.

    python -m bench.sft_bench --rounds 3                 # dtype: what rlctl's auto decides here
    python -m bench.sft_bench --rounds 3 --dtype fp32
"""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

from bench.trainer_sides import (
    alternate,
    finish,
    machine_line,
    parser,
    per_round,
    rlctl_run,
    trl_run,
)
from bench.trl_bench import TRL_VERSION

BATCH, MICRO, LR = 16, 4, 1e-5


def write_examples(path: Path, count: int, seed: int = 0) -> Path:
    """`count` prompt/completion pairs whose completions run 8–40 numbers long."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        start, step, length = rng.randint(0, 500), rng.randint(1, 9), rng.randint(8, 40)
        rows.append({"prompt": f"Count from {start} in steps of {step}:", "completion": " " + " ".join(str(start + step * i) for i in range(length))})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_trl(python: Path, work: Path, model: Path, examples: Path, dtype: str, steps: int, checkpointing: bool) -> dict:
    spec = {
        "model": str(model), "examples": str(examples), "batch_size": BATCH, "micro_batch_size": MICRO, "lr": LR, "epochs": 2,
        "dtype": dtype, "device": "cpu", "gradient_checkpointing": checkpointing,
    }
    step, record = trl_run(python, "trl_sft_runner.py", work, spec, steps)
    return {"step": step, "checkpointing": record["gradient_checkpointing"]}


def run_rlctl(work: Path, model: Path, examples: Path, dtype: str, asked: str) -> dict:
    sets = ["--set", f"sft.micro_batch_size={MICRO}"] + ([] if asked == "auto" else ["--set", f"sft.bf16={str(dtype == 'bf16').lower()}"])
    manifest = rlctl_run(work, ["sft", "--data", str(examples), "--model", str(model), "--epochs", "2", "--lr", str(LR), "--batch-size", str(BATCH), *sets])
    second = manifest["state"]["epochs"][-1]
    return {"step": second["seconds"] / second["steps"], "tokens": second["tokens"] / second["steps"], "bf16": manifest["config"]["sft"]["bf16"]}


def main() -> None:
    options = parser(__doc__)
    options.add_argument("--trl-checkpointing", action="store_true", help="TRL recomputes activations, as SFTConfig does by default")
    args = options.parse_args()
    rounds, dtype = alternate(
        args, lambda work: write_examples(work / "examples.jsonl", BATCH * args.steps),
        lambda python, work, model, data, dtype: run_trl(python, work, model, data, dtype, args.steps, args.trl_checkpointing),
        lambda work, model, data, dtype: run_rlctl(work, model, data, dtype, args.dtype),
    )
    finish(report(rounds, args, dtype), args)


def report(rounds: dict[str, list[dict]], args, dtype: str) -> str:
    trl = statistics.median(r["step"] for r in rounds["trl"])
    ours = statistics.median(r["step"] for r in rounds["rlctl"])
    tokens = statistics.median(r["tokens"] for r in rounds["rlctl"])
    checkpointing = {r["checkpointing"] for r in rounds["trl"]}

    return "\n".join([
        machine_line(),
        f"- command: `python -m bench.sft_bench --rounds {args.rounds} --steps {args.steps} --dtype {args.dtype} --preset {args.preset}"
        f"{' --trl-checkpointing' if args.trl_checkpointing else ''}` (decided: {dtype}); TRL {TRL_VERSION} SFTTrainer, activation checkpointing "
        f"{'/'.join(map(str, sorted(checkpointing)))}",
        f"- workload: {args.preset} preset, {BATCH} examples per optimizer step in micro-batches of {MICRO}, completion-only loss, "
        f"{tokens:.0f} completion tokens per step; seconds per step over the second epoch of {args.steps} steps, median over {args.rounds} rounds",
        f"- per round: TRL {per_round(rounds, 'trl')}; rlctl {per_round(rounds, 'rlctl')}",
        "",
        "| | TRL | rlctl | rlctl / TRL |",
        "|---|---|---|---|",
        f"| seconds per optimizer step | {trl:.3f} | {ours:.3f} | {ours / trl:.2f} |",
        f"| completion tokens/s | {tokens / trl:,.0f} | {tokens / ours:,.0f} | — |",
    ])


if __name__ == "__main__":
    main()
