"""Benchmark: the HF engine and the vLLM engine side by side on the same model and prompts.

Generation tokens/s on 64 sequences × 64 new tokens (the small preset, fp32, no early stop
counted out: every generated token counts), median of several rounds after a warm-up, the two
engines alternating in one process. The pipeline's iteration time with each engine comes from
bench/pipeline_bench.py with `--set rollout.backend=vllm`.

    python -m bench.engines_bench --rounds 3
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--model", help="an HF folder to use instead of a fresh preset")
    parser.add_argument("--engines", default="hf,vllm", help="comma-separated: hf, vllm (hf alone where vLLM is not installed)")
    args = parser.parse_args()

    import torch

    from rlctl.backends.base import SamplingParams
    from rlctl.backends.hf import HFPolicy
    from rlctl.modelinit import init_model

    names = [name.strip() for name in args.engines.split(",") if name.strip()]
    folder = Path(args.model) if args.model else init_model(Path(tempfile.mkdtemp()) / args.preset, args.preset, seed=0)
    params = SamplingParams(args.tokens, temperature=1.0, seed=1)
    engines, start_seconds = {}, None
    if "hf" in names:
        engines["hf"] = HFPolicy.load(str(folder), args.device)
    if "vllm" in names:
        from rlctl.backends.vllm_engine import VLLMEngine

        started = time.perf_counter()
        engines["vllm"] = VLLMEngine.load(str(folder), args.device, compute_dtype=args.dtype, params=params)
        start_seconds = time.perf_counter() - started
    tokenizer = next(iter(engines.values())).tokenizer
    prompts = tokenizer([f"Benchmark prompt number {i}: explain step {i}." for i in range(args.sequences)], add_special_tokens=False)["input_ids"]

    def rate(engine) -> float:
        began = time.perf_counter()
        out = engine.generate(prompts, params, batch_size=args.sequences, compute_dtype=args.dtype)
        return sum(len(g.response_ids) for g in out) / (time.perf_counter() - began)

    for engine in engines.values():
        rate(engine)  # warm-up: the first call of each engine is slow
    rounds: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            rounds[name].append(rate(engine))
    from bench.pipeline_bench import _cpu_name, _gpu_name

    print(f"- machine: {_cpu_name()}, {_gpu_name()}, Python {platform.python_version()}, torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}")
    print(f"- command: `python -m bench.engines_bench --rounds {args.rounds} --dtype {args.dtype} --device {args.device} {f'--model {args.model}' if args.model else f'--preset {args.preset}'} --engines {','.join(engines)}` ({args.sequences} sequences × {args.tokens} new tokens)")
    if start_seconds is not None:
        print(f"- vLLM engine start: {start_seconds:.1f} s (import, load, KV cache)")
    print("\n| engine | tokens/s (median) | rounds |")
    print("|---|---|---|")
    for name, values in rounds.items():
        print(f"| {name} | {statistics.median(values):,.0f} | {', '.join(f'{v:,.0f}' for v in values)} |")

if __name__ == "__main__":
    main()
