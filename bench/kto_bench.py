"""Benchmark: `rlctl kto` and TRL's KTOTrainer side by side on identical work.

The same small-preset model (made here, random weights), the same labelled examples (the
preference pairs of bench/dpo_bench.py taken apart: a prompt, then a completion of 8–40 counted
numbers, desirable where it counts right), the same shape: 16 examples per optimizer step in
micro-batches of 4, constant lr, AdamW, β = 0.1, λ_D = λ_U = 1, activations kept for the backward
on both sides (KTOConfig's default would recompute them), the reference's log-probs computed
once before training on both sides (TRL's `precompute_ref_log_probs`; `--trl-reference-each-step`
for TRL's default), and on both sides a no-grad forward over mismatched pairs for the reference
point (TRL: per micro-batch; rlctl: per optimizer step). Each side runs two epochs in a fresh
process; the figure is the second epoch's seconds per optimizer step (the first is warm-up),
then the median over alternating rounds. TRL runs in the venv bench/trl_bench.py makes.

    python -m bench.kto_bench --rounds 3                 # dtype: what rlctl's auto decides here
    python -m bench.kto_bench --rounds 3 --dtype fp32
"""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

from bench.rm_bench import write_pairs
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

BATCH, MICRO, LR, BETA = 16, 4, 1e-5, 0.1


def write_examples(path: Path, count: int) -> Path:
    """`count` labelled examples: bench/dpo_bench.py's pairs, each side an example, in a seeded
    shuffle (TRL pairs each row's prompt with the next row's completion for its reference point:
    the two sides of a pair side by side would share a prompt)."""
    pairs = [json.loads(line) for line in write_pairs(path.with_suffix(".pairs.jsonl"), -(-count // 2)).read_text().splitlines()]
    rows = [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"} for p in pairs for side in ("chosen", "rejected")][:count]
    random.Random(0).shuffle(rows)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_trl(python: Path, work: Path, model: Path, examples: Path, dtype: str, steps: int, precompute: bool) -> dict:
    spec = {
        "model": str(model), "examples": str(examples), "batch_size": BATCH, "micro_batch_size": MICRO, "lr": LR, "beta": BETA, "epochs": 2,
        "steps_per_epoch": steps, "dtype": dtype, "device": "cpu", "gradient_checkpointing": False, "precompute_ref_log_probs": precompute,
    }
    step, record = trl_run(python, "trl_kto_runner.py", work, spec, steps)
    kl = [log["kl"] for log in record["logged"] if "kl" in log]
    return {"step": step, "kl": kl[-1] if kl else None}


def run_rlctl(work: Path, model: Path, examples: Path, dtype: str, asked: str) -> dict:
    sets = ["--set", f"kto.micro_batch_size={MICRO}"] + ([] if asked == "auto" else ["--set", f"kto.bf16={str(dtype == 'bf16').lower()}"])
    manifest = rlctl_run(work, ["kto", "--data", str(examples), "--model", str(model), "--epochs", "2", "--lr", str(LR), "--batch-size", str(BATCH), "--beta", str(BETA), *sets])
    second = manifest["state"]["epochs"][-1]
    return {"step": second["seconds"] / second["steps"], "kl": second["kl"], "bf16": manifest["config"]["kto"]["bf16"]}


def main() -> None:
    options = parser(__doc__)
    options.add_argument("--trl-reference-each-step", action="store_true", help="TRL's default: the reference model's forwards in every step")
    args = options.parse_args()
    precompute = not args.trl_reference_each_step
    rounds, dtype = alternate(
        args, lambda work: write_examples(work / "examples.jsonl", BATCH * args.steps),
        lambda python, work, model, data, dtype: run_trl(python, work, model, data, dtype, args.steps, precompute),
        lambda work, model, data, dtype: run_rlctl(work, model, data, dtype, args.dtype),
    )
    finish(report(rounds, args, dtype, precompute), args)


def report(rounds: dict[str, list[dict]], args, dtype: str, precompute: bool) -> str:
    trl = statistics.median(r["step"] for r in rounds["trl"])
    ours = statistics.median(r["step"] for r in rounds["rlctl"])

    def kl(side: str) -> str:
        values = [r["kl"] for r in rounds[side] if r["kl"] is not None]
        return f"{statistics.median(values):.3g}" if values else "—"

    reference = "computed once before training on both sides" if precompute else "TRL: the reference's forwards in every step (its default); rlctl: once"
    return "\n".join([
        machine_line(),
        f"- command: `python -m bench.kto_bench --rounds {args.rounds} --steps {args.steps} --dtype {args.dtype} --preset {args.preset}"
        f"{'' if precompute else ' --trl-reference-each-step'}` (decided: {dtype}); TRL {TRL_VERSION} KTOTrainer, activations kept on both sides",
        f"- workload: {args.preset} preset, {BATCH} examples per optimizer step in micro-batches of {MICRO}, β = {BETA}; the reference's log-probs "
        f"{reference}; seconds per step over the second epoch of {args.steps} steps, median over {args.rounds} rounds",
        f"- per round: TRL {per_round(rounds, 'trl')}; rlctl {per_round(rounds, 'rlctl')}",
        "",
        "| | TRL | rlctl | rlctl / TRL |",
        "|---|---|---|---|",
        f"| seconds per optimizer step | {trl:.3f} | {ours:.3f} | {ours / trl:.2f} |",
        f"| second epoch's last reference point (kl) | {kl('trl')} | {kl('rlctl')} | — |",
    ])


if __name__ == "__main__":
    main()
