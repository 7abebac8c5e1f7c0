"""Writes digit_prefs.jsonl and digit_prefs_val.jsonl, the preference pairs of rm_grpo.toml:

    python examples/make_digit_prefs.py

Each side is 3–16 tokens of the tiny preset's tokenizer, each a digit with a probability drawn
per string; half of the strings draw from a palette of 2–5 tokens, as a collapsing policy
writes. The side with the larger share of digit characters (by at least 0.1) is chosen.
"""

import json
import random
import tempfile
from pathlib import Path

from transformers import AutoTokenizer

from rlctl.modelinit import init_model

HERE = Path(__file__).resolve().parent


def digit_share(text: str) -> float:
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


def main(seed: int = 0, train: int = 1024, held_out: int = 128) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tok = AutoTokenizer.from_pretrained(init_model(Path(tmp) / "tiny", "tiny", seed=0))
    rng = random.Random(seed)
    vocab = [i for i in range(tok.vocab_size) if i not in tok.all_special_ids]
    digits = [i for i in vocab if tok.decode([i]).isdigit()]
    others = [i for i in vocab if (text := tok.decode([i])).isprintable() and "\ufffd" not in text and not any(c.isdigit() for c in text)]
    prompts = [json.loads(line)["prompt"] for line in (HERE / "digits.jsonl").read_text().splitlines()]

    def sample() -> str:
        p = rng.random()
        palette = (rng.sample(digits, rng.randint(1, 2)), rng.sample(others, rng.randint(1, 3))) if rng.random() < 0.5 else (digits, others)
        return tok.decode([rng.choice(palette[0]) if rng.random() < p else rng.choice(palette[1]) for _ in range(rng.randint(3, 16))])

    def pair(i: int) -> dict:
        while True:
            a, b = sample(), sample()
            if a.strip() and b.strip() and abs(digit_share(a) - digit_share(b)) >= 0.1:
                break
        chosen, rejected = (a, b) if digit_share(a) > digit_share(b) else (b, a)
        return {"id": f"d{i:04d}", "prompt": rng.choice(prompts), "chosen": chosen, "rejected": rejected}

    rows = [pair(i) for i in range(train + held_out)]
    (HERE / "digit_prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:train]))
    (HERE / "digit_prefs_val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[train:]))


if __name__ == "__main__":
    main()
