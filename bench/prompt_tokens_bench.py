"""The rollout's prompt preparation with `data.truncate = "drop"`: tokenizing each prompt once
(`fitting_prompt_tokens` handing its tokens to `encode_prompts`) against twice (`fitting_prompts`,
then `encode_prompts` again, as before). The tiny preset's tokenizer and chat template, 2,048
prompts; the median of 5 runs each.

    python -m bench.prompt_tokens_bench
"""

from __future__ import annotations

import statistics
import tempfile
import time

import pyarrow as pa


def main() -> None:
    from rlctl.backends.hf import HFPolicy
    from rlctl.config import DataConfig
    from rlctl.modelinit import init_model
    from rlctl.stages.rollout import encode_prompts, fitting_prompt_tokens, fitting_prompts

    with tempfile.TemporaryDirectory() as folder:
        init_model(folder, preset="tiny", seed=0)
        tokenizer = HFPolicy.load(folder, "cpu").tokenizer
    table = pa.table({"id": [f"p{i}" for i in range(2048)], "prompt": [f"Type the number {i} in digits, then {i * 7} twice." for i in range(2048)]})
    data = DataConfig(truncate="drop", chat_template=True, max_prompt_tokens=64)
    context = {"context_length": 512, "max_new_tokens": 64}

    def twice() -> list:
        kept, _ = fitting_prompts(table, tokenizer, data, **context)
        return encode_prompts(kept, tokenizer, data, **context)

    def once() -> list:
        kept, _, tokenized = fitting_prompt_tokens(table, tokenizer, data, **context)
        return encode_prompts(kept, tokenizer, data, tokenized=tokenized, **context)

    assert once() == twice()
    for name, fn in (("twice (before)", twice), ("once", once)):
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        print(f"{name}: median {statistics.median(times) * 1000:.0f} ms over 5 runs")


if __name__ == "__main__":
    main()
