"""Benchmark: what stop strings (rollout.stop) and tool turns (rollout.tool) cost the HF engine's
generation, against the same generation without them.

Three variants of one batch (16 addition prompts × 4 samples, 64 new tokens, sampling at
temperature 1), alternating within one process after a warm-up, each run `--rounds` times:
- `plain`: no stop strings;
- `stop (never hit)`: a stop string no response holds, so every row still runs to its end and
  the difference is the work of looking for it (the engine's per-step look at each row's last
  tokens, then the cut over every response);
- `tool`: a stop string most responses hit early and a tool (one Python function in a child
  process, answering a fixed short text) called once per such response, then the second turn:
  what a rollout with a tool costs beyond its tokens.

    python -m bench.stop_strings_bench --rounds 5 [--model DIR] [--dtype fp32]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

TOOL = "def answer(responses):\n    return [' <r>42</r> ' for _ in responses]\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model folder (default: the small preset, made here)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="fp32")
    args = parser.parse_args()

    import pyarrow as pa

    from rlctl.backends.hf import HFPolicy
    from rlctl.config import DataConfig, RolloutConfig
    from rlctl.modelinit import init_model
    from rlctl.process_setup import prepare
    from rlctl.stages.rollout import rollout_table

    prepare()
    scratch = Path(tempfile.mkdtemp(prefix="rlctl-stop-bench-"))
    model = args.model or str(init_model(scratch / "small", "small", seed=0))
    (scratch / "tools.py").write_text(TOOL)
    engine = HFPolicy.load(model, "cpu")
    prompts = pa.table({"id": [f"q{i}" for i in range(16)], "prompt": [f"{i} + {i + 7} =" for i in range(16)]})
    base = RolloutConfig(n=4, max_new_tokens=64, temperature=1.0, dtype=args.dtype, seed=1)
    frequent = most_frequent_character(engine, prompts, base)
    variants = {
        "plain": base,
        "stop (never hit)": RolloutConfig(**{**base.__dict__, "stop": ("\x00never\x00",)}),
        "tool": RolloutConfig(**{**base.__dict__, "stop": (frequent,), "tool": f"{scratch / 'tools.py'}:answer", "max_tool_calls": 1}),
    }
    data = DataConfig(max_prompt_tokens=64)
    rollout_table(prompts, engine, base, data, policy_version=0, on_tokens=lambda _: None)  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    tokens: dict[str, list[int]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, cfg in variants.items():
            started = time.perf_counter()
            table = rollout_table(prompts, engine, cfg, data, policy_version=0, on_tokens=lambda _: None)
            seconds[name].append(time.perf_counter() - started)
            tokens[name].append(sum(len(ids) for ids in table.column("response_ids").to_pylist()))
    print(f"machine: {platform.processor() or platform.machine()}, model {Path(model).name}, dtype {args.dtype}, 64 rows × 64 tokens, {args.rounds} rounds")
    print(f"tool variant: stop string {frequent!r}, one call per response that hits it")
    plain = statistics.median(seconds["plain"])
    print("| variant | median s | tokens | tokens/s | time vs plain |")
    print("|---|---|---|---|---|")
    for name in variants:
        median, count = statistics.median(seconds[name]), statistics.median(tokens[name])
        print(f"| {name} | {median:.3f} ({', '.join(f'{s:.3f}' for s in seconds[name])}) | {count:.0f} | {count / median:.0f} | {median / plain:.3f}× |")


def most_frequent_character(engine, prompts, cfg) -> str:
    """A letter most responses hold in their first half: the tool variant's stop string."""
    from rlctl.config import DataConfig
    from rlctl.stages.rollout import rollout_table

    responses = rollout_table(prompts, engine, cfg, DataConfig(max_prompt_tokens=64), policy_version=0, on_tokens=lambda _: None).column("response").to_pylist()
    return max("etaoinsr", key=lambda c: sum(c in r[: len(r) // 2] for r in responses))


if __name__ == "__main__":
    main()
