"""data.retire_pass_rate on a prompt set of which half is solved from the start: examples/grpo.toml's
64 digit prompts and 64 prompts every response passes. Without retirement half of every batch
is groups of equal rewards, which GRPO gives no advantage; with it those prompts leave after
the first epoch (16 iterations of 8 prompts) and every later batch is digit prompts.

    python bench/retire_solved.py [--iterations 40]

prints, for each setting, the digit prompts' mean reward by iteration, the iteration it first
reaches 0.9, and the share of groups with equal rewards before and after the first epoch
(bench/RESULTS.md). The retiring run ends when fewer than a batch of prompts is left in play."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def reward(prompts: list[str], responses: list[str]) -> list[float]:
    """A "Say anything" prompt passes whatever the response; a digit prompt scores its digit share."""
    return [1.0 if p.startswith("Say anything") else (sum(c.isdigit() for c in r) / len(r) if r else 0.0) for p, r in zip(prompts, responses)]


def mixed_prompts(path: Path) -> None:
    digits = [json.loads(line) for line in (ROOT / "examples" / "digits.jsonl").read_text().splitlines()]
    solved = [{"id": f"s{k:03d}", "prompt": f"Say anything: {k}", "data_source": "solved"} for k in range(len(digits))]
    path.write_text("".join(json.dumps(row) + "\n" for pair in zip(digits, solved) for row in pair))


def digit_rewards(run: Path, iterations: int) -> list[float]:
    from rlctl import shards

    means = []
    for i in range(1, iterations + 1):
        table = shards.read(str(run / f"iter-{i:04d}" / "score"), "scores").table
        rewards = [r for r, source in zip(table.column("reward").to_pylist(), table.column("data_source").to_pylist()) if source == "digits"]
        means.append(sum(rewards) / len(rewards) if rewards else float("nan"))
    return means


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=40)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="retire-"))
    mixed_prompts(work / "mixed.jsonl")
    for rate in (0.0, 1.0):
        run = work / f"rate-{rate:g}"
        command = [
            sys.executable, "-m", "rlctl", "pipeline", str(ROOT / "examples" / "grpo.toml"), "--run-dir", str(run), "--quiet",
            "--iterations", str(args.iterations), "--set", f"data.prompts={work / 'mixed.jsonl'}",
            "--set", f"score.reward={ROOT / 'bench' / 'retire_solved.py'}:reward", "--set", f"data.retire_pass_rate={rate}",
            "--set", "pipeline.val_every=0",
        ]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        digits = digit_rewards(run, len(rows))
        first = next((i + 1 for i, m in enumerate(digits) if m >= 0.9), None)
        equal = [r.get("groups/equal_rewards", 0.0) for r in rows]
        seconds = sum(r["seconds/total"] for r in rows)
        print(
            f"retire_pass_rate {rate:g}: digit reward at 1/10/20/30/40 "
            + " ".join(f"{digits[i - 1]:.3f}" for i in (1, 10, 20, 30, 40) if i <= len(digits))
            + f"; first ≥ 0.9 at iteration {first}; equal-reward groups 1-16 {sum(equal[:16]) / 16:.2f}, 17-32 {sum(equal[16:32]) / 16:.2f}"
            + f"; iterations run {len(rows)}, prompts retired {rows[-1].get('prompts_retired', 0)}; stage seconds {seconds:.1f}"
        )


if __name__ == "__main__":
    main()
