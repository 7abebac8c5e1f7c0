"""Benchmark: where a checkpoint save's time goes — the weights (save_pretrained), the trainer
state (AdamW's moments), and hashing every file for the manifest — with the files hashed one at
a time or several at once.

In one process with rlctl's process setup: the model (a fresh `--preset` one by default), an
AdamW state for every weight (one step on random gradients), then per round and per hashing
setting one save into a fresh folder, as `rlctl.checkpoint.save_checkpoint` writes it, each part
timed. The first round faults the page cache and the writes' buffers in; compare the later ones.

    python -m bench.checkpoint_bench --preset medium --rounds 3 --hash-threads 1,2
"""

from __future__ import annotations

import argparse
import platform
import shutil
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="medium")
    parser.add_argument("--model", help="a model folder (default: a new one of --preset, removed afterwards)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hash-threads", default="1,2", help="files hashed at once, comma-separated settings (rlctl: the CPUs available)")
    parser.add_argument("--append", help="append the Markdown result to this file")
    args = parser.parse_args()

    from rlctl import process_setup

    process_setup.prepare()
    from bench.pipeline_bench import machine_name, publish
    from rlctl.modelinit import init_model

    settings = [int(n) for n in args.hash_threads.split(",")]
    with tempfile.TemporaryDirectory(prefix="rlctl-checkpoint-bench-") as scratch:
        folder = Path(args.model) if args.model else init_model(Path(scratch) / args.preset, args.preset, seed=0)
        rows, sizes = measure(folder, Path(scratch), args.rounds, settings)
    source = f"--model {args.model}" if args.model else f"--preset {args.preset}"
    publish([
        f"- machine: {machine_name('cpu')}, Python {platform.python_version()}",
        f"- command: `python -m bench.checkpoint_bench {source} --rounds {args.rounds} --hash-threads {args.hash_threads}`",
        f"- files: {', '.join(f'{name} {size / 1e9:.2f} GB' for name, size in sizes if size > 1e6)} (and small ones)",
        "",
        "| round | files hashed at once | weights (s) | trainer state (s) | hashing (s) | save (s) |",
        "|---|---|---|---|---|---|",
        *rows,
    ], args.append)


def measure(folder: Path, scratch: Path, rounds: int, settings: list[int]) -> tuple[list[str], list[tuple[str, int]]]:
    import torch

    from rlctl import folders
    from rlctl.backends.hf import HFPolicy
    from rlctl.checkpoint import STATE_DIR, save_trainer_state
    from rlctl.shards import filesystem
    from rlctl.trainer import adamw

    policy = HFPolicy.load(str(folder), "cpu")
    params = list(policy.model.parameters())
    optimizer = adamw(params, lr=1e-5, weight_decay=0.0)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    rows, sizes = [], []
    for r in range(1, rounds + 1):
        for threads in settings:
            folders.available_cpus = lambda threads=threads: threads  # what files_sha256 sizes its pool by
            out = Path(tempfile.mkdtemp(dir=scratch))
            began = time.perf_counter()
            policy.model.save_pretrained(out)
            policy.tokenizer.save_pretrained(out)
            weights = time.perf_counter()
            save_trainer_state(out / STATE_DIR, {"step": 1, "optimizer": optimizer.state_dict()})
            state = time.perf_counter()
            fs, path = filesystem(str(out))
            names = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
            folders.describe_files(fs, path, names)
            hashed = time.perf_counter()
            sizes = [(name, (out / name).stat().st_size) for name in names]
            shutil.rmtree(out)
            rows.append(f"| {r} | {threads} | {weights - began:.2f} | {state - weights:.2f} | {hashed - state:.2f} | {hashed - began:.2f} |")
    return rows, sizes


if __name__ == "__main__":
    main()
