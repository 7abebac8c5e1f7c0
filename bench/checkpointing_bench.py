"""Benchmark: what update.gradient_checkpointing saves in memory and costs in time.

One process per setting and round, alternating: a model of a `rlctl model init` preset trains
one update on a batch of `--rows` random responses of `--tokens` tokens (prompts of 32), all
in one micro-batch, fp32; each process reports its largest resident size (ru_maxrss) after
loading (before the update) and after it, and the update's seconds. The difference of the two
sizes is what the update's activations and optimizer state took.

    python -m bench.checkpointing_bench --preset medium --rows 32 --tokens 256 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="medium")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: one measuring process (a model folder)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.rows, args.tokens, args.checkpointing)))
        return
    from rlctl.modelinit import init_model

    model = str(init_model(Path(tempfile.mkdtemp(prefix="rlctl-ckpt-bench-")) / args.preset, args.preset, seed=0))
    results: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(args.rounds):
        for checkpointing in (False, True):
            command = [sys.executable, "-m", "bench.checkpointing_bench", "--one", model, "--rows", str(args.rows), "--tokens", str(args.tokens)]
            out = subprocess.run(command + (["--checkpointing"] if checkpointing else []), capture_output=True, text=True, check=True)
            results[checkpointing].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"machine: {platform.processor() or platform.machine()}; preset {args.preset}, {args.rows} rows × (32 + {args.tokens}) tokens, one micro-batch, fp32")
    print("| gradient_checkpointing | update s (each) | peak RSS growth in the update, MiB (each) |")
    print("|---|---|---|")
    for checkpointing, runs in results.items():
        seconds = [r["seconds"] for r in runs]
        growth = [r["after_mib"] - r["before_mib"] for r in runs]
        print(f"| {str(checkpointing).lower()} | {statistics.median(seconds):.2f} ({', '.join(f'{s:.2f}' for s in seconds)}) "
              f"| {statistics.median(growth):.0f} ({', '.join(f'{g:.0f}' for g in growth)}) |")


def measure(model: str, rows: int, tokens: int, checkpointing: bool) -> dict:
    import resource
    import time

    import torch

    from rlctl.backends.hf import HFPolicy
    from rlctl.config import UpdateConfig
    from rlctl.process_setup import prepare
    from rlctl.trainer import TrainBatch, Trainer

    prepare()
    policy = HFPolicy.load(model, "cpu")
    g = torch.Generator().manual_seed(0)
    vocab = policy.vocab_size
    mask = torch.ones(rows, tokens, dtype=torch.bool)
    batch = TrainBatch(
        prompt_ids=[torch.randint(3, vocab, (32,), generator=g).tolist() for _ in range(rows)],
        response_ids=[torch.randint(3, vocab, (tokens,), generator=g).tolist() for _ in range(rows)],
        response_mask=mask, advantages=torch.randn(rows, tokens, generator=g), old_logprobs=torch.full((rows, tokens), -6.0),
        ref_logprobs=None, old_values=None, returns=None,
    )
    cfg = UpdateConfig(lr=1e-6, micro_batch_size=rows, micro_batch_tokens=str(rows * (32 + tokens)), bf16="false", gradient_checkpointing=checkpointing)
    trainer = Trainer(policy, cfg)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    started = time.perf_counter()
    trainer.train(batch)
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"seconds": seconds, "before_mib": before, "after_mib": after}


if __name__ == "__main__":
    main()
