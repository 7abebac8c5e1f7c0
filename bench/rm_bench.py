"""Benchmark: `rlctl reward-model` and TRL's RewardTrainer side by side on identical work.

The same small-preset model (made here, random weights, a new one-output head on both sides),
the same preference pairs (a prompt, then a chosen and a rejected completion of 8–40 counted
numbers: sides of uneven length), the same shape: 16 pairs per optimizer step in micro-batches
of 4 pairs (8 sequences), constant lr, AdamW, activations kept for the backward on both sides
(RewardConfig's default would recompute them). TRL appends the end token to each side; rlctl
reads the text as `rm:` scores it, so TRL's sequences are one token longer. Each side runs two
epochs in a fresh process; the figure is the second epoch's seconds per optimizer step (the
first is warm-up), then the median over alternating rounds. TRL runs in the venv
bench/trl_bench.py makes.

    python -m bench.rm_bench --rounds 3                 # dtype: what rlctl's auto decides here
    python -m bench.rm_bench --rounds 3 --dtype fp32
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


def write_pairs(path: Path, count: int, seed: int = 0) -> Path:
    """`count` pairs: the chosen side counts right, the rejected one skips; 8–40 numbers each."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        start, step = rng.randint(0, 500), rng.randint(1, 9)
        right = " ".join(str(start + step * i) for i in range(rng.randint(8, 40)))
        wrong = " ".join(str(start + step * i + rng.randint(1, 3)) for i in range(rng.randint(8, 40)))
        rows.append({"prompt": f"Count from {start} in steps of {step}:", "chosen": " " + right, "rejected": " " + wrong})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_trl(python: Path, work: Path, model: Path, pairs: Path, dtype: str, steps: int) -> dict:
    spec = {
        "model": str(model), "pairs": str(pairs), "batch_size": BATCH, "micro_batch_size": MICRO, "lr": LR, "epochs": 2,
        "steps_per_epoch": steps, "dtype": dtype, "device": "cpu", "gradient_checkpointing": False,
    }
    step, record = trl_run(python, "trl_rm_runner.py", work, spec, steps)
    accuracy = [log["accuracy"] for log in record["logged"] if "accuracy" in log]
    return {"step": step, "accuracy": accuracy[-1] if accuracy else None}


def run_rlctl(work: Path, model: Path, pairs: Path, dtype: str, asked: str) -> dict:
    sets = ["--set", f"reward_model.micro_batch_size={MICRO}"] + ([] if asked == "auto" else ["--set", f"reward_model.bf16={str(dtype == 'bf16').lower()}"])
    manifest = rlctl_run(work, ["reward-model", "--data", str(pairs), "--model", str(model), "--epochs", "2", "--lr", str(LR), "--batch-size", str(BATCH), *sets])
    second = manifest["state"]["epochs"][-1]
    return {"step": second["seconds"] / second["steps"], "accuracy": second["accuracy"], "bf16": manifest["config"]["reward_model"]["bf16"]}


def main() -> None:
    args = parser(__doc__).parse_args()
    rounds, dtype = alternate(
        args, lambda work: write_pairs(work / "pairs.jsonl", BATCH * args.steps),
        lambda python, work, model, data, dtype: run_trl(python, work, model, data, dtype, args.steps),
        lambda work, model, data, dtype: run_rlctl(work, model, data, dtype, args.dtype),
    )
    finish(report(rounds, args, dtype), args)


def report(rounds: dict[str, list[dict]], args, dtype: str) -> str:
    trl = statistics.median(r["step"] for r in rounds["trl"])
    ours = statistics.median(r["step"] for r in rounds["rlctl"])

    def accuracy(side: str) -> str:
        values = [r["accuracy"] for r in rounds[side] if r["accuracy"] is not None]
        return f"{statistics.median(values):.2f}" if values else "—"

    return "\n".join([
        machine_line(),
        f"- command: `python -m bench.rm_bench --rounds {args.rounds} --steps {args.steps} --dtype {args.dtype} --preset {args.preset}` "
        f"(decided: {dtype}); TRL {TRL_VERSION} RewardTrainer, activations kept on both sides",
        f"- workload: {args.preset} preset, {BATCH} pairs per optimizer step in micro-batches of {MICRO} pairs; seconds per step over the "
        f"second epoch of {args.steps} steps, median over {args.rounds} rounds",
        f"- per round: TRL {per_round(rounds, 'trl')}; rlctl {per_round(rounds, 'rlctl')}",
        "",
        "| | TRL | rlctl | rlctl / TRL |",
        "|---|---|---|---|",
        f"| seconds per optimizer step | {trl:.3f} | {ours:.3f} | {ours / trl:.2f} |",
        f"| second epoch's training accuracy | {accuracy('trl')} | {accuracy('rlctl')} | — |",
    ])


if __name__ == "__main__":
    main()
