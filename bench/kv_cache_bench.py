"""Benchmark: generation with the KV cache grown in blocks against transformers' DynamicCache.

The HF engine's `generate` on the same prompts with RLCTL_KV_CACHE=blocks and =dynamic
alternating in one process, for each response length asked (the longer the responses, the more
a per-step copy of the cache costs), tokens/s as the median of the rounds after a warm-up. Both
caches must give the same tokens; the bench checks it and says so.

    python -m bench.kv_cache_bench --preset small --tokens 64,512
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
from pathlib import Path

from bench.alternating import alternate
from bench.pipeline_bench import machine_name, publish


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--model", help="an HF folder to use instead of a fresh preset")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"))
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--tokens", default="64,512", help="comma-separated new-token counts, one row each")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--append", help="append the Markdown result to this file")
    args = parser.parse_args()

    import torch

    from rlctl.backends.base import SamplingParams
    from rlctl.backends.hf import HFPolicy
    from rlctl.backends.kv_cache import OVERRIDE_ENV
    from rlctl.dtypes import compute_dtype
    from rlctl.modelinit import init_model

    folder = Path(args.model) if args.model else init_model(Path(tempfile.mkdtemp()) / args.preset, args.preset, seed=0)
    policy = HFPolicy.load(str(folder), args.device)
    dtype = compute_dtype(args.dtype, policy.device.type)
    prompts = policy.tokenizer([f"Benchmark prompt number {i}: explain step {i}." for i in range(args.sequences)], add_special_tokens=False)["input_ids"]
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        params = SamplingParams(tokens, temperature=1.0, seed=1)
        seconds, outputs = alternate(
            policy, prompts, params, env=OVERRIDE_ENV, settings=("dynamic", "blocks"), rounds=args.rounds, dtype=dtype, batch_size=args.sequences,
        )
        same = all(a.response_ids == b.response_ids for a, b in zip(outputs["dynamic"], outputs["blocks"]))
        generated = sum(len(g.response_ids) for g in outputs["blocks"])
        rate = {mode: statistics.median(generated / s for s in times) for mode, times in seconds.items()}
        rows.append((tokens, generated, rate["dynamic"], rate["blocks"], same))

    lines = [
        f"- machine: {machine_name(policy.device.type)}, compute {dtype}, Python {platform.python_version()}, torch {torch.__version__}",
        f"- command: `python -m bench.kv_cache_bench {f'--model {args.model}' if args.model else f'--preset {args.preset}'} --device {args.device} --dtype {args.dtype} "
        f"--sequences {args.sequences} --tokens {args.tokens} --rounds {args.rounds}`",
        f"- tokens/s generated (rows stop at the end-of-sequence token), median of {args.rounds} rounds after a warm-up",
        "",
        "| new tokens per row | tokens generated | DynamicCache | blocks | speed-up | same tokens |",
        "|---|---|---|---|---|---|",
        *(f"| {t} | {n} | {d:.0f} | {b:.0f} | {b / d:.2f}× | {'yes' if same else 'NO'} |" for t, n, d, b, same in rows),
    ]
    publish(lines, args.append)


if __name__ == "__main__":
    main()
