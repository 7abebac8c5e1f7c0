"""Benchmark: a bf16 update with each weight cast once per optimizer step (`casts_kept`) against
a cast per pass, the same batch, the same gradient bits.

The small preset (made here), a GRPO-shaped batch of 64 rows (16 prompts × 4 samples, 64
response tokens) in passes of `--micro` rows, one optimizer step's passes (forward + backward),
alternating the two ways in one process; the median over `--repeats` of each.

    python -m bench.casts_kept_bench --micro 4 --repeats 5
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--preset", default="small")
    args = parser.parse_args()

    from rlctl import mkl_kernels

    mkl_kernels.enable()
    import torch

    import rlctl.trainer as trainer_module
    from rlctl.backends.hf import HFPolicy
    from rlctl.config import UpdateConfig
    from rlctl.trainer import TrainBatch, Trainer

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / args.preset
        subprocess.run([sys.executable, "-m", "rlctl", "model", "init", str(model), "--preset", args.preset], check=True, stdout=subprocess.DEVNULL)
        policy = HFPolicy.load(str(model), "cpu")
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (24,), generator=generator).tolist() for _ in range(16)]
    rows = [(p, torch.randint(3, 500, (int(torch.randint(32, 65, (1,), generator=generator)),), generator=generator).tolist()) for p in prompts for _ in range(4)]
    width = max(len(r) for _, r in rows)
    mask = torch.tensor([[t < len(r) for t in range(width)] for _, r in rows])
    batch = TrainBatch(
        prompt_ids=[p for p, _ in rows], response_ids=[r for _, r in rows], response_mask=mask,
        advantages=torch.where(mask, torch.randn(len(rows), width, generator=generator), 0), old_logprobs=torch.where(mask, -6.0, 0),
        ref_logprobs=None, old_values=None, returns=None,
    )
    trainer = Trainer(policy, UpdateConfig(micro_batch_size=args.micro, bf16="true"))
    kept = trainer_module.casts_kept
    seconds: dict[str, list[float]] = {"cast per pass": [], "cast once per step": []}
    trainer.accumulate_gradients(batch, torch.arange(batch.size))  # warm-up
    for _ in range(args.repeats):
        for name in seconds:
            trainer_module.casts_kept = kept if name == "cast once per step" else (lambda device, bf16: contextlib.nullcontext())
            started = time.perf_counter()
            trainer.accumulate_gradients(batch, torch.arange(batch.size))
            seconds[name].append(time.perf_counter() - started)
    trainer_module.casts_kept = kept
    from bench.pipeline_bench import _cpu_name

    print(f"- machine: {_cpu_name()}, {os.cpu_count()} cores; command: `python -m bench.casts_kept_bench --micro {args.micro} --repeats {args.repeats} --preset {args.preset}`")
    print(f"- {len(rows)} rows of 24 + 32–64 tokens, passes of {args.micro} rows, bf16 autocast; seconds for one optimizer step's passes (forward + backward), median of {args.repeats}")
    for name, values in seconds.items():
        print(f"  - {name}: {statistics.median(values):.3f} s ({', '.join(f'{v:.3f}' for v in values)})")


if __name__ == "__main__":
    main()
