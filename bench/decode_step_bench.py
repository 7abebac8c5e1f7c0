"""Benchmark: generation with rlctl's direct decode step against transformers' forward, or
with its products from packed weights against the modules' (`--compare products`), or its decode
loop in inference mode against plain no-grad mode (`--compare inference`).

The HF engine's `generate` on the same prompts with the two settings of the switch alternating
in one process (bench.alternating): RLCTL_DECODE_STEP=transformers and =rlctl,
RLCTL_DECODE_PRODUCTS=modules and =packed, or inference mode off and on (rlctl has no switch
for it: the bench makes `torch.inference_mode` a no-op while INFERENCE_SWITCH says "off"); for
each batch size asked (the fewer the rows, the more a step's fixed cost weighs), seconds per
generation and the paired ratio per round. The two settings give the same tokens, and log-probs
bit for bit (MKL's packed products: to ~2e-6); the bench checks it and says which.

    python -m bench.decode_step_bench --preset small --rows 1,8,64 --rounds 7 [--compare products|inference]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import tempfile
from pathlib import Path

from bench.alternating import alternate, paired_ratios
from bench.pipeline_bench import machine_name, publish

INFERENCE_SWITCH = "BENCH_INFERENCE_MODE"  # the bench's own: "off" makes torch.inference_mode a no-op

# --compare: (the switch, (its old setting, its new one))
SWITCHES = {
    "step": ("RLCTL_DECODE_STEP", ("transformers", "rlctl")),
    "products": ("RLCTL_DECODE_PRODUCTS", ("modules", "packed")),
    "inference": (INFERENCE_SWITCH, ("off", "on")),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--model", help="an HF folder to use instead of a fresh preset")
    parser.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"))
    parser.add_argument("--rows", default="1,8,64", help="comma-separated batch sizes, one table row each")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per row")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--compare", default="step", choices=tuple(SWITCHES), help="the direct step against transformers' forward, packed products against the modules', or the decode loop in inference mode against no-grad mode")
    parser.add_argument("--append", help="append the Markdown result to this file")
    args = parser.parse_args()

    import torch

    if args.compare == "inference":
        switch_inference_mode(torch)
    from rlctl.backends.base import SamplingParams
    from rlctl.backends.hf import HFPolicy
    from rlctl.dtypes import compute_dtype
    from rlctl.modelinit import init_model

    folder = Path(args.model) if args.model else init_model(Path(tempfile.mkdtemp()) / args.preset, args.preset, seed=0)
    policy = HFPolicy.load(str(folder), "cpu")  # the direct step decodes under rlctl's CPU attention only
    dtype = compute_dtype(args.dtype, "cpu")
    texts = [f"{i} + {i + 3} =" for i in range(16)]
    params = SamplingParams(args.tokens, temperature=1.0, seed=1)
    env, (old, new) = SWITCHES[args.compare]
    rows = []
    for count in [int(r) for r in args.rows.split(",")]:
        prompts = [ids for ids in policy.tokenizer(texts, add_special_tokens=False)["input_ids"] for _ in range(4)] * (count // 64 + 1)
        seconds, outputs = alternate(
            policy, prompts[:count], params, env=env, settings=(old, new), rounds=args.rounds, dtype=dtype, batch_size=count,
        )
        same = agreement(outputs[old], outputs[new])
        ratios = paired_ratios(seconds, new, old)
        generated = sum(len(g.response_ids) for g in outputs[new])
        rows.append((count, generated, seconds[old], seconds[new], ratios, same))

    def spread(values: list[float], digits: int = 2) -> str:
        return f"{min(values):.{digits}f}–{max(values):.{digits}f} (median {statistics.median(values):.{digits}f})"

    lines = [
        f"- machine: {machine_name('cpu')}, compute {dtype}, Python {platform.python_version()}, torch {torch.__version__}",
        f"- command: `python -m bench.decode_step_bench {f'--model {args.model}' if args.model else f'--preset {args.preset}'} --dtype {args.dtype} "
        f"--rows {args.rows} --tokens {args.tokens} --rounds {args.rounds} --compare {args.compare}`",
        f"- seconds per generation of {args.tokens} new tokens per row, {args.rounds} rounds after a warm-up, the two settings alternating",
        "",
        f"| rows | tokens generated | {env}={old} (s) | {env}={new} (s) | paired ratio | tokens and log-probs |",
        "|---|---|---|---|---|---|",
        *(f"| {n} | {g} | {spread(t)} | {spread(d)} | {spread(r)} | {same} |" for n, g, t, d, r, same in rows),
    ]
    publish(lines, args.append)


def switch_inference_mode(torch) -> None:
    """Make `torch.inference_mode` follow INFERENCE_SWITCH: plain no-grad mode (what `generate`
    runs in otherwise) while it says "off", torch's own else."""
    own = torch.inference_mode

    def switched(mode: bool = True):
        return contextlib.nullcontext() if os.environ.get(INFERENCE_SWITCH) == "off" else own(mode)

    torch.inference_mode = switched


def agreement(a: list, b: list) -> str:
    """How two settings' generations agree, in words: the same bit for bit, the same tokens with
    log-probs within a bound, or how many rows' tokens differ."""
    differing = sum(x.response_ids != y.response_ids for x, y in zip(a, b))
    if differing:
        return f"tokens differ in {differing} of {len(a)} rows"
    gap = max((abs(p - q) for x, y in zip(a, b) for p, q in zip(x.logprobs, y.logprobs)), default=0.0)
    return "the same bit for bit" if gap == 0 else f"the same tokens, log-probs within {gap:.1e}"


if __name__ == "__main__":
    main()
