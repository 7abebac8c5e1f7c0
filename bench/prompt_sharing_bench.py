"""Benchmark: the update with each prompt run once per pass against one full forward per row.

GRPO's shape (prompts × samples of random tokens, responses of fixed length, the KL loss, one
optimizer step per update), `Trainer.train` timed with RLCTL_SHARE_PROMPTS=always and =never
alternating in one process, median of the rounds after a warm-up. Each row also gives the
repeated prompt tokens × the model's parameters, the quantity the automatic rule compares
with its device's threshold (rlctl.backends.hf.SHARED_PROMPT_MIN_PARAM_TOKENS), and what the
rule decides: where "always" is faster the rule should say yes.

    python -m bench.prompt_sharing_bench --preset small --prompt-tokens 12,200
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from bench.pipeline_bench import machine_name, publish


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--model", help="an HF folder to use instead of a fresh preset")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt-tokens", default="12,200", help="comma-separated prompt lengths, one row each")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--response-tokens", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--append", help="append the Markdown result to this file")
    args = parser.parse_args()

    import torch

    from rlctl.backends.hf import SHARE_PROMPTS_ENV, HFPolicy
    from rlctl.config import UpdateConfig
    from rlctl.dtypes import compute_dtype
    from rlctl.modelinit import init_model
    from rlctl.trainer import Trainer

    folder = Path(args.model) if args.model else init_model(Path(tempfile.mkdtemp()) / args.preset, args.preset, seed=0)
    policy = HFPolicy.load(str(folder), args.device)
    parameters = sum(p.numel() for p in policy.model.parameters())
    dtype = compute_dtype("auto", policy.device.type)
    cfg = UpdateConfig(lr=1e-7, micro_batch_size=args.micro_batch, use_kl_loss=True, bf16=dtype == "bf16")
    rows = []
    for prompt_tokens in [int(t) for t in args.prompt_tokens.split(",")]:
        batch = grpo_batch(args.prompts, args.samples, prompt_tokens, args.response_tokens, vocab=policy.vocab_size)
        times: dict[str, list[float]] = {"never": [], "always": []}
        for round_ in range(args.rounds + 1):
            for mode in times:
                os.environ[SHARE_PROMPTS_ENV] = mode
                trainer = Trainer(policy, cfg)
                began = time.perf_counter()
                trainer.train(batch)
                if policy.device.type == "cuda":
                    torch.cuda.synchronize()
                if round_:  # the first round warms up
                    times[mode].append(time.perf_counter() - began)
        os.environ.pop(SHARE_PROMPTS_ENV)
        saved = args.prompts * (args.samples - 1) * prompt_tokens
        never, always = statistics.median(times["never"]), statistics.median(times["always"])
        rows.append((prompt_tokens, saved * parameters, never, always, policy.shares_prompts(batch.prompt_ids)))

    lines = [
        f"- machine: {machine_name(policy.device.type)}, compute {dtype}, Python {platform.python_version()}",
        f"- command: `python -m bench.prompt_sharing_bench {f'--model {args.model}' if args.model else f'--preset {args.preset}'} --device {args.device} --prompt-tokens {args.prompt_tokens} "
        f"--prompts {args.prompts} --samples {args.samples} --response-tokens {args.response_tokens} --micro-batch {args.micro_batch} --rounds {args.rounds}`",
        f"- model: {parameters:,} parameters; seconds per update, median of {args.rounds} rounds after a warm-up",
        "",
        "| prompt tokens | repeated prompt tokens × parameters | one forward per row | each prompt once | speed-up | the rule shares |",
        "|---|---|---|---|---|---|",
        *(f"| {p} | {pt:.2g} | {never:.3f} | {always:.3f} | {never / always:.2f}× | {'yes' if auto else 'no'} |" for p, pt, never, always, auto in rows),
    ]
    publish(lines, args.append)


def grpo_batch(prompts: int, samples: int, prompt_tokens: int, response_tokens: int, *, vocab: int):
    """`prompts` random prompts, each sampled `samples` times, with random responses and advantages."""
    import torch

    from rlctl.trainer import TrainBatch

    g = torch.Generator().manual_seed(0)
    distinct = [torch.randint(3, vocab, (prompt_tokens,), generator=g).tolist() for _ in range(prompts)]
    prompt_ids = [distinct[i // samples] for i in range(prompts * samples)]
    response_ids = [torch.randint(3, vocab, (response_tokens,), generator=g).tolist() for _ in prompt_ids]
    rows = len(prompt_ids)
    return TrainBatch(
        prompt_ids=prompt_ids, response_ids=response_ids, response_mask=torch.ones(rows, response_tokens, dtype=torch.bool),
        advantages=torch.randn(rows, response_tokens, generator=g), old_logprobs=torch.full((rows, response_tokens), -8.0),
        ref_logprobs=torch.full((rows, response_tokens), -8.0), old_values=None, returns=None,
    )


if __name__ == "__main__":
    main()
