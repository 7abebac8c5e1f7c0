"""Benchmark: the update's and the reference's forwards over real tokens only (rlctl's unpadded
forward) against transformers' forward over the padded batch.

GRPO's rows (16 prompts × 4 samples) with responses of at most `--tokens` tokens whose lengths
spread as asked: `--spreads 1,0.5,0` draws each response's length uniformly from
[spread × tokens, tokens] (1: no padding; 0: from one token up). For each spread, in one process
with RLCTL_UNPADDED_FORWARD=transformers and =rlctl alternating (bench.alternating): a training
pass (every distinct prompt once, the rows' forward and backward in micro-batches of
`--micro-batch` rows, as the update runs them) and the reference log-probs (`score`'s call);
seconds, the paired ratio, and how far the two forwards' log-probs are apart. `--lora R` trains a
rank-R LoRA adapter on q, v and down instead of every weight; `--fsdp` wraps the model in FSDP2
as a Ray rank does (a one-rank gloo group in this process: the hooks' gathers and reductions
without a second rank's traffic).

    python -m bench.unpadded_bench --preset small --spreads 1,0.5,0 --rounds 5
    python -m bench.unpadded_bench --preset small --spreads 1,0 --rounds 5 --fsdp --lora 8
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
from pathlib import Path

from bench.alternating import alternate_calls, paired_ratios
from bench.pipeline_bench import machine_name, publish

SETTINGS = ("transformers", "rlctl")


def training_pass(policy, prompts: list[list[int]], responses: list[list[int]], micro_batch: int, bf16: bool = False) -> None:
    """Every distinct prompt once, the rows' forward and backward in micro-batches, as the update
    (in bf16: under the update's autocast and attention, `training_forward`)."""
    from rlctl.backends.hf import batches_by_prompt, training_forward

    policy.model.train()
    try:
        for micro in batches_by_prompt(prompts, responses, micro_batch):
            length = max(len(prompts[i]) + len(responses[i]) for i in micro)
            with training_forward(policy.model, policy.device, bf16, rows=len(micro), length=length):
                logp, entropy = policy.forward_sharing_prompts([prompts[i] for i in micro], [responses[i] for i in micro], temperature=1.0, statistic="entropy")
            (logp.sum() + entropy.sum()).backward()
    finally:
        policy.model.zero_grad(set_to_none=True)
        policy.model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--model", help="an HF folder to use instead of a fresh preset")
    parser.add_argument("--tokens", type=int, default=64, help="the longest response")
    parser.add_argument("--spreads", default="1,0.5,0", help="comma-separated; a response's length is drawn from [spread × tokens, tokens]")
    parser.add_argument("--micro-batch", type=int, default=32, help="rows per forward/backward of the training pass")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lora", type=int, default=0, help="train a LoRA adapter of this rank (q, v, down) instead of every weight")
    parser.add_argument("--fsdp", action="store_true", help="wrap the model in FSDP2 (one rank, gloo) as a Ray rank does")
    parser.add_argument("--device", default="cpu", help="cpu | cuda")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="bf16: the update's autocast and the reference's bf16 copy")
    parser.add_argument("--append", help="append the Markdown result to this file")
    args = parser.parse_args()

    import torch

    from rlctl.backends.hf import HFPolicy
    from rlctl.backends.unpadded import OVERRIDE_ENV
    from rlctl.modelinit import init_model

    folder = Path(args.model) if args.model else init_model(Path(tempfile.mkdtemp()) / args.preset, args.preset, seed=0)
    policy = HFPolicy.load(str(folder), args.device)
    cuda, bf16 = policy.device.type == "cuda", args.dtype == "bf16"
    if args.lora:
        from peft import LoraConfig, get_peft_model

        policy.model = get_peft_model(policy.model, LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules=["q_proj", "v_proj", "down_proj"]))
    if args.fsdp:
        import torch.distributed as dist

        from rlctl.workers.ray import _sharded

        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
        policy.model = _sharded(policy.model, dist.device_mesh.init_device_mesh(policy.device.type, (1,)))
    prompts = [ids for ids in policy.tokenizer([f"{i} + {i + 3} =" for i in range(16)], add_special_tokens=False)["input_ids"] for _ in range(4)]
    rows = []
    for spread in [float(s) for s in args.spreads.split(",")]:
        g = torch.Generator().manual_seed(0)
        shortest = max(1, round(spread * args.tokens))
        lengths = torch.randint(shortest, args.tokens + 1, (len(prompts),), generator=g).tolist()
        responses = [torch.randint(4, policy.vocab_size, (n,), generator=g).tolist() for n in lengths]

        train_s, _ = alternate_calls(
            lambda r=responses: training_pass(policy, prompts, r, args.micro_batch, bf16), env=OVERRIDE_ENV, settings=SETTINGS, rounds=args.rounds, cuda=cuda,
        )
        ref_s, scored = alternate_calls(
            lambda r=responses: policy.logprobs(prompts, r, temperature=1.0, compute_dtype=args.dtype), env=OVERRIDE_ENV, settings=SETTINGS, rounds=args.rounds, cuda=cuda,
        )
        apart = max(abs(a - b) for x, y in zip(scored["rlctl"], scored["transformers"]) for a, b in zip(x, y))
        real = sum(len(p) + n for p, n in zip(prompts, lengths))
        padded = len(prompts) * (max(map(len, prompts)) + max(lengths))
        rows.append((spread, sum(lengths), 1 - real / padded, train_s, ref_s, apart))

    def spread_of(values: list[float]) -> str:
        return f"{min(values):.2f}–{max(values):.2f} ({statistics.median(values):.2f})"

    lines = [
        f"- machine: {machine_name(args.device)}, {args.dtype}, Python {platform.python_version()}, torch {torch.__version__}",
        f"- command: `python -m bench.unpadded_bench {f'--model {args.model}' if args.model else f'--preset {args.preset}'} --tokens {args.tokens} "
        f"--spreads {args.spreads} --micro-batch {args.micro_batch} --rounds {args.rounds} --device {args.device} --dtype {args.dtype}{f' --lora {args.lora}' if args.lora else ''}{' --fsdp' if args.fsdp else ''}`",
        f"- 64 rows (16 prompts × 4); seconds per call over {args.rounds} rounds after a warm-up (min–max, median), the two forwards alternating",
        "",
        "| spread | response tokens | padding in a one-batch layout | training pass: transformers / unpadded (s) | ratio | reference: transformers / unpadded (s) | ratio | log-probs apart |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {s:g} | {n} | {pad:.0%} | {spread_of(t['transformers'])} / {spread_of(t['rlctl'])} | {statistics.median(paired_ratios(t, 'rlctl', 'transformers')):.2f} "
            f"| {spread_of(r['transformers'])} / {spread_of(r['rlctl'])} | {statistics.median(paired_ratios(r, 'rlctl', 'transformers')):.2f} | {apart:.1e} |"
            for s, n, pad, t, r, apart in rows
        ),
    ]
    publish(lines, args.append)


if __name__ == "__main__":
    main()
