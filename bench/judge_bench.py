"""A judge model trained here, then GRPO against it: RLAIF end to end on the CPU.

1. Labelled questions: random token strings of the tiny preset's vocabulary, 0 to 16 tokens
   (half drawn from its digit-bearing tokens), each put into the judge's question, answered
   "Yes" when at least half of its characters are digits, else "No" (an empty one too: without
   empty responses among them, the policy learned to stop at once, which the judge had never
   seen and passed: reward 0.95, digit share 0; bench/RESULTS.md).
2. `rlctl sft` teaches a fresh tiny model (seed 1) to answer them: the judge.
3. `rlctl pipeline examples/grpo.toml` with `score.reward = "judge:JUDGE"` (the same question):
   the policy (seed 0) is trained by the judge's p(yes) alone, never by the digit rule.

    python bench/judge_bench.py [--iterations 30]

prints the judge's held-out accuracy and, per iteration, the judge's mean reward beside the
responses' true digit share (the rule it was taught; bench/RESULTS.md)."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "Response: {response}\nIs this response mostly digits? Answer Yes or No."


def digit_share(text: str) -> float:
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


def labelled_questions(tokenizer, count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    vocab = list(range(tokenizer.vocab_size))
    digits = [t for t in vocab if any(c.isdigit() for c in tokenizer.decode([t]))]
    rows = []
    for k in range(count):
        pool = digits if k % 2 else vocab
        response = tokenizer.decode([rng.choice(pool) for _ in range(rng.randint(0, 16))]).strip()  # empty too: no digits, "No"
        answer = "Yes" if digit_share(response) >= 0.5 else "No"
        rows.append({"messages": [{"role": "user", "content": QUESTION.format(response=response)}], "response": answer})
    return rows


def main() -> None:
    from transformers import AutoTokenizer

    from rlctl import shards
    from rlctl.judge import JudgeReward, JudgeSettings

    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=30)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="judge-"))
    rlctl = [sys.executable, "-m", "rlctl"]
    subprocess.run([*rlctl, "model", "init", str(work / "base"), "--preset", "tiny", "--seed", "1"], check=True, stdout=subprocess.DEVNULL)
    tokenizer = AutoTokenizer.from_pretrained(work / "base")
    for name, count, seed in (("train", 2048, 0), ("val", 256, 1)):
        (work / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in labelled_questions(tokenizer, count, seed)))
    subprocess.run([*rlctl, "sft", "--data", str(work / "train.jsonl"), "--model", str(work / "base"), "--out", str(work / "judge"),
                    "--epochs", "3", "--lr", "1e-3"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    judge = JudgeReward(str(work / "judge"), settings=JudgeSettings(QUESTION, "Yes", "No"))
    held_out = [json.loads(line) for line in (work / "val.jsonl").read_text().splitlines()]
    responses = [row["messages"][0]["content"].removeprefix("Response: ").split("\nIs this")[0] for row in held_out]
    shares = judge(prompts=[""] * len(responses), responses=responses, ground_truths=[None] * len(responses))
    accuracy = sum((s >= 0.5) == (row["response"] == "Yes") for s, row in zip(shares, held_out)) / len(held_out)
    print(f"judge: held-out accuracy {accuracy:.3f} on {len(held_out)} questions ({sum(r['response'] == 'Yes' for r in held_out)} yes)")

    run = work / "run"
    subprocess.run([
        *rlctl, "pipeline", str(ROOT / "examples" / "grpo.toml"), "--run-dir", str(run), "--quiet", "--iterations", str(args.iterations),
        "--set", f"score.reward=judge:{work / 'judge'}", "--set", f"score.judge_template={json.dumps(QUESTION)}", "--set", "pipeline.val_every=0",
    ], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for i in sorted({1, 5, 10, 15, 20, 25, 30, args.iterations} & set(range(1, len(rows) + 1))):
        table = shards.read(str(run / f"iter-{i:04d}" / "score"), "scores").table
        true_share = sum(map(digit_share, table.column("response").to_pylist())) / table.num_rows
        print(f"iteration {i}: judge reward {rows[i - 1]['reward_mean']:.3f}, digit share {true_share:.3f}, seconds {rows[i - 1]['seconds/total']:.2f}")


if __name__ == "__main__":
    main()
