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

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.trl_bench import TRL_VERSION, _run, ensure_trl_venv

HERE = Path(__file__).resolve().parent
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
    work.mkdir()
    spec = {
        "model": str(model), "pairs": str(pairs), "batch_size": BATCH, "micro_batch_size": MICRO, "lr": LR, "epochs": 2,
        "steps_per_epoch": steps, "dtype": dtype, "device": "cpu", "gradient_checkpointing": False,
    }
    (work / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    _run([str(python), str(HERE / "trl_rm_runner.py"), str(work / "spec.json"), str(work / "out.json")], env=env)
    record = json.loads((work / "out.json").read_text())
    ends = [e["time"] for e in record["ends"]]
    if len(ends) != 2 * steps:
        sys.exit(f"TRL made {len(ends)} optimizer steps, expected {2 * steps}")
    accuracy = [log["accuracy"] for log in record["logged"] if "accuracy" in log]
    return {"step": (ends[-1] - ends[steps - 1]) / steps, "accuracy": accuracy[-1] if accuracy else None}


def run_rlctl(work: Path, model: Path, pairs: Path, dtype: str, asked: str) -> dict:
    work.mkdir()
    sets = ["--set", f"reward_model.micro_batch_size={MICRO}"] + ([] if asked == "auto" else ["--set", f"reward_model.bf16={str(dtype == 'bf16').lower()}"])
    command = [sys.executable, "-m", "rlctl", "reward-model", "--data", str(pairs), "--model", str(model), "--out", str(work / "out"),
               "--epochs", "2", "--lr", str(LR), "--batch-size", str(BATCH), *sets]
    _run(command)
    manifest = json.loads((work / "out" / "_manifest.json").read_text())
    second = manifest["state"]["epochs"][-1]
    return {"step": second["seconds"] / second["steps"], "accuracy": second["accuracy"], "bf16": manifest["config"]["reward_model"]["bf16"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per epoch")
    parser.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"))
    parser.add_argument("--preset", default="small")
    parser.add_argument("--venv", type=Path, default=Path.home() / ".cache" / "rlctl-bench" / f"trl-{TRL_VERSION}")
    parser.add_argument("--append", type=Path, help="append the Markdown result to this file")
    args = parser.parse_args()

    from rlctl.dtypes import compute_dtype

    dtype = compute_dtype(args.dtype, "cpu")
    python = ensure_trl_venv(args.venv)
    rounds: dict[str, list[dict]] = {"trl": [], "rlctl": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = work / args.preset
        subprocess.run([sys.executable, "-m", "rlctl", "model", "init", str(model), "--preset", args.preset], check=True, stdout=subprocess.DEVNULL)
        pairs = write_pairs(work / "pairs.jsonl", BATCH * args.steps)
        for r in range(args.rounds):
            rounds["trl"].append(run_trl(python, work / f"trl{r}", model, pairs, dtype, args.steps))
            rounds["rlctl"].append(run_rlctl(work / f"rlctl{r}", model, pairs, dtype, args.dtype))
    text = report(rounds, args, dtype)
    print(text)
    if args.append:
        with open(args.append, "a") as f:
            f.write(text + "\n")


def report(rounds: dict[str, list[dict]], args, dtype: str) -> str:
    from bench.pipeline_bench import _cpu_name
    from rlctl.dtypes import native_bf16

    trl = statistics.median(r["step"] for r in rounds["trl"])
    ours = statistics.median(r["step"] for r in rounds["rlctl"])
    flags = "native bf16 (avx512_bf16/amx_bf16)" if native_bf16("cpu") else "no native bf16"

    def per_round(side: str) -> str:
        return ", ".join(f"{r['step']:.3f}" for r in rounds[side])

    def accuracy(side: str) -> str:
        values = [r["accuracy"] for r in rounds[side] if r["accuracy"] is not None]
        return f"{statistics.median(values):.2f}" if values else "—"

    return "\n".join([
        f"- machine: {_cpu_name()}, {os.cpu_count()} cores, {flags}, Python {platform.python_version()}",
        f"- command: `python -m bench.rm_bench --rounds {args.rounds} --steps {args.steps} --dtype {args.dtype} --preset {args.preset}` "
        f"(decided: {dtype}); TRL {TRL_VERSION} RewardTrainer, activations kept on both sides",
        f"- workload: {args.preset} preset, {BATCH} pairs per optimizer step in micro-batches of {MICRO} pairs; seconds per step over the "
        f"second epoch of {args.steps} steps, median over {args.rounds} rounds",
        f"- per round: TRL {per_round('trl')}; rlctl {per_round('rlctl')}",
        "",
        "| | TRL | rlctl | rlctl / TRL |",
        "|---|---|---|---|",
        f"| seconds per optimizer step | {trl:.3f} | {ours:.3f} | {ours / trl:.2f} |",
        f"| second epoch's training accuracy | {accuracy('trl')} | {accuracy('rlctl')} | — |",
    ])


if __name__ == "__main__":
    main()
