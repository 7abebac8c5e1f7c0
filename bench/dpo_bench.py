"""Benchmark: `rlctl dpo` and TRL's DPOTrainer side by side on identical work.

The same small-preset model (made here, random weights), the same preference pairs (a prompt,
then a chosen and a rejected completion of 8–40 counted numbers: sides of uneven length), the
same shape: 16 pairs per optimizer step in micro-batches of 4 pairs (8 sequences), constant lr,
AdamW, β = 0.1, activations kept for the backward on both sides (DPOConfig's default would
recompute them), the reference's log-probs computed once before training on both sides (TRL's
`precompute_ref_log_probs`; `--trl-reference-each-step` for TRL's default, a reference forward
in every step). Each side runs two epochs in a fresh process; the figure is the second epoch's
seconds per optimizer step (the first is warm-up), then the median over alternating rounds. TRL
runs in the venv bench/trl_bench.py makes.

    python -m bench.dpo_bench --rounds 3                 # dtype: what rlctl's auto decides here
    python -m bench.dpo_bench --rounds 3 --dtype fp32
"""

from __future__ import annotations

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


def run_trl(python: Path, work: Path, model: Path, pairs: Path, dtype: str, steps: int, precompute: bool) -> dict:
    spec = {
        "model": str(model), "pairs": str(pairs), "batch_size": BATCH, "micro_batch_size": MICRO, "lr": LR, "beta": BETA, "epochs": 2,
        "steps_per_epoch": steps, "dtype": dtype, "device": "cpu", "gradient_checkpointing": False, "precompute_ref_log_probs": precompute,
    }
    step, record = trl_run(python, "trl_dpo_runner.py", work, spec, steps)
    accuracy = [log[key] for log in record["logged"] for key in ("rewards/accuracies",) if key in log]
    return {"step": step, "accuracy": accuracy[-1] if accuracy else None}


def run_rlctl(work: Path, model: Path, pairs: Path, dtype: str, asked: str) -> dict:
    sets = ["--set", f"dpo.micro_batch_size={MICRO}"] + ([] if asked == "auto" else ["--set", f"dpo.bf16={str(dtype == 'bf16').lower()}"])
    manifest = rlctl_run(work, ["dpo", "--data", str(pairs), "--model", str(model), "--epochs", "2", "--lr", str(LR), "--batch-size", str(BATCH), "--beta", str(BETA), *sets])
    second = manifest["state"]["epochs"][-1]
    return {"step": second["seconds"] / second["steps"], "accuracy": second["accuracy"], "bf16": manifest["config"]["dpo"]["bf16"]}


def main() -> None:
    options = parser(__doc__)
    options.add_argument("--trl-reference-each-step", action="store_true", help="TRL's default: the reference model's forward in every step")
    args = options.parse_args()
    precompute = not args.trl_reference_each_step
    rounds, dtype = alternate(
        args, lambda work: write_pairs(work / "pairs.jsonl", BATCH * args.steps),
        lambda python, work, model, data, dtype: run_trl(python, work, model, data, dtype, args.steps, precompute),
        lambda work, model, data, dtype: run_rlctl(work, model, data, dtype, args.dtype),
    )
    finish(report(rounds, args, dtype, precompute), args)


def report(rounds: dict[str, list[dict]], args, dtype: str, precompute: bool) -> str:
    trl = statistics.median(r["step"] for r in rounds["trl"])
    ours = statistics.median(r["step"] for r in rounds["rlctl"])

    def accuracy(side: str) -> str:
        values = [r["accuracy"] for r in rounds[side] if r["accuracy"] is not None]
        return f"{statistics.median(values):.2f}" if values else "—"

    reference = "computed once before training on both sides" if precompute else "TRL: a reference forward in every step (its default); rlctl: once"
    return "\n".join([
        machine_line(),
        f"- command: `python -m bench.dpo_bench --rounds {args.rounds} --steps {args.steps} --dtype {args.dtype} --preset {args.preset}"
        f"{'' if precompute else ' --trl-reference-each-step'}` (decided: {dtype}); TRL {TRL_VERSION} DPOTrainer, activations kept on both sides",
        f"- workload: {args.preset} preset, {BATCH} pairs per optimizer step in micro-batches of {MICRO} pairs, β = {BETA}; the reference's log-probs "
        f"{reference}; seconds per step over the second epoch of {args.steps} steps, median over {args.rounds} rounds",
        f"- per round: TRL {per_round(rounds, 'trl')}; rlctl {per_round(rounds, 'rlctl')}",
        "",
        "| | TRL | rlctl | rlctl / TRL |",
        "|---|---|---|---|",
        f"| seconds per optimizer step | {trl:.3f} | {ours:.3f} | {ours / trl:.2f} |",
        f"| second epoch's training accuracy (implicit rewards) | {accuracy('trl')} | {accuracy('rlctl')} | — |",
    ])


if __name__ == "__main__":
    main()
