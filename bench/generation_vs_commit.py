"""Benchmark: the HF engine's generation tokens/s with this tree against another commit's, on
the same model, batch and sampling.

Issue 12 asks for generation at ≥ 2× the tokens/s of the code it was filed on (`FILED_ON`) for
64 rows × 64 new tokens. The commit's `rlctl/` is exported into a scratch folder (`git archive`)
and each tree generates in processes of its own, the two alternating pair by pair (which goes
first swaps each pair: a small shared machine drifts over minutes). A process runs
`--generations` generations of one batch (16 addition prompts × 4 samples for 64 rows) and
reports its first three (a fresh process: fresh memory, the products packed for the first time)
and the median of its last `--steady` (the plateau a pipeline's resident rollout worker runs
at). Each tree runs as its code would from the `rlctl` command: today's process setup (MKL's
kernels, malloc thresholds) where the tree has `rlctl/process_setup.py`, none where it has not.
On a CPU that is not Intel's, an older commit's process ran MKL's own (generic) kernels;
`--commit-kernels intel` loads rlctl.mkl_kernels' library into it first, so that both trees
compute on MKL's Intel kernels, as both do on an Intel Xeon (the CPU issue 12 was filed on).

    python -m bench.generation_vs_commit --pairs 3 --generations 12 --dtype fp32 [--commit 8cab09b] [--commit-kernels intel]
    python -m bench.generation_vs_commit --dtype default   # each tree with its own default settings

With `--dtype default` each tree generates in its own default rollout.dtype as its rollout stage
decides it on this machine: the code issue 12 was filed on in fp32 (it had no "auto"), today's
tree in "auto" (bf16 where the CPU has it natively).

This file is also the measuring process (`--one TREE`): run by path, it imports nothing of rlctl
before it has put TREE first on the import path (the `bench` package itself loads rlctl).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FILED_ON = "8cab09b"  # the commit issue 12 was filed on
REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", default=FILED_ON, help="the commit to compare with (its rlctl/ folder)")
    parser.add_argument("--model", help="a model folder (default: the small preset, made here)")
    parser.add_argument("--dtype", default="fp32",
                        help="compute dtype of both trees (a tree without the option generates as it did); default: each tree's "
                        "default rollout.dtype, decided for this machine as its rollout stage decides it")
    parser.add_argument("--rows", type=int, default=64, help="rows per generation (a multiple of 4: prompts × 4 samples)")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per row")
    parser.add_argument("--generations", type=int, default=12, help="generations per process")
    parser.add_argument("--steady", type=int, default=6, help="the last this many generations of a process give its steady time")
    parser.add_argument("--pairs", type=int, default=3, help="processes per tree, alternating")
    parser.add_argument("--commit-kernels", default="own", choices=("own", "intel"),
                        help="MKL's kernels in the commit's processes: its own choice, as it ran then, or MKL's Intel kernels as this tree loads them")
    parser.add_argument("--append", help="append the Markdown result to this file")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: one process's measurement with this tree
    parser.add_argument("--preload", help=argparse.SUPPRESS)  # internal: a library the process loads before torch
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(Path(args.one), args.model, args.dtype, args.rows, args.tokens, args.generations, args.preload)))
        return
    if args.rows < 4 or args.rows % 4 or not 1 <= args.steady <= args.generations or args.generations < 3:
        parser.error("--rows must be a multiple of 4; --generations ≥ 3 and ≥ --steady ≥ 1")

    sys.path.insert(0, str(REPO))
    from bench.pipeline_bench import machine_name, publish
    from rlctl.modelinit import init_model

    preload = []
    if args.commit_kernels == "intel":
        from rlctl import mkl_kernels

        library = mkl_kernels.build(mkl_kernels.cache_dir(), mkl_kernels.find_compiler())
        if library is None:
            sys.exit("generation_vs_commit: --commit-kernels intel needs rlctl.mkl_kernels' library, and no C compiler could build it")
        preload = ["--preload", str(library)]
    this = describe()
    names = [args.commit, this if this != args.commit else f"{this} (this tree)"]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    scratch = Path(tempfile.mkdtemp(prefix="rlctl-gen-vs-commit-"))
    try:
        trees = dict(zip(names, (export(args.commit, scratch / "tree"), REPO)))
        model = args.model or str(init_model(scratch / "small", "small", seed=0))
        for pair in range(args.pairs):
            for name in names if pair % 2 == 0 else names[::-1]:
                command = [sys.executable, str(Path(__file__).resolve()), "--one", str(trees[name]), "--model", model, "--dtype", args.dtype,
                           "--rows", str(args.rows), "--tokens", str(args.tokens), "--generations", str(args.generations)]
                command += preload if name == args.commit else []
                done = subprocess.run(command, capture_output=True, text=True, cwd=scratch)
                if done.returncode:
                    sys.exit(f"generation_vs_commit: the process for {name} failed:\n{done.stderr[-2000:]}")
                runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    def steady(run: dict) -> float:
        return statistics.median(run["seconds"][-args.steady :])

    def cell(run: dict) -> str:
        first = ", ".join(f"{s:.2f}" for s in run["seconds"][:3])
        return f"{first} | {steady(run):.3f} s ({run['tokens'] / steady(run):,.0f} tok/s)"

    old, new = names
    medians = {name: statistics.median(steady(run) for run in runs[name]) for name in names}
    firsts = {name: statistics.median(s for run in runs[name] for s in run["seconds"][:3]) for name in names}
    tokens = {name: sorted({run["tokens"] for run in runs[name]}) for name in names}
    lines = [
        f"- machine: {machine_name('cpu')}, Python {platform.python_version()}",
        f"- command: `python -m bench.generation_vs_commit --commit {args.commit} --dtype {args.dtype} --rows {args.rows} --tokens {args.tokens}"
        f" --generations {args.generations} --steady {args.steady} --pairs {args.pairs} --commit-kernels {args.commit_kernels}`",
        f"- {old}: {runs[old][0]['setup']}; {new}: {runs[new][0]['setup']}; tokens per generation {tokens[old]} / {tokens[new]}",
        f"- per process: its first three generations (s), and the median of its last {args.steady} (steady)",
        "",
        f"| pair | {old}: first three | {old}: steady | {new}: first three | {new}: steady | steady ratio |",
        "|---|---|---|---|---|---|",
        *(
            f"| {i + 1} | {cell(a)} | {cell(b)} | {steady(a) / steady(b):.2f}× |"
            for i, (a, b) in enumerate(zip(runs[old], runs[new]))
        ),
        "",
        f"Steady: **{medians[old] / medians[new]:.2f}×** the tokens/s of {old} (ratio of the medians); "
        f"first three generations of a process: {firsts[old] / firsts[new]:.2f}×.",
    ]
    publish(lines, args.append)


def export(commit: str, folder: Path) -> Path:
    """`commit`'s rlctl/ folder exported under `folder` (the tree's root)."""
    folder.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "rlctl"], capture_output=True)
    if archive.returncode:
        sys.exit(f"generation_vs_commit: cannot export {commit}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return folder


def describe() -> str:
    """This tree's commit, marked when the working tree has changes."""
    done = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return done.stdout.strip() or "this tree"


def measure(tree: Path, model: str, dtype: str, rows: int, tokens: int, generations: int, preload: str | None) -> dict:
    """In this process: rlctl from `tree`, `generations` generations of one batch (`preload`: a
    library loaded first, as rlctl.mkl_kernels loads its own)."""
    sys.path.insert(0, str(tree))
    has_setup = (tree / "rlctl" / "process_setup.py").exists()
    if preload:
        import ctypes
        import os

        ctypes.CDLL(preload, mode=os.RTLD_GLOBAL | os.RTLD_NOW)
    if has_setup:  # the command's setup, before torch loads
        from rlctl import process_setup

        process_setup.prepare()
    import inspect

    import rlctl
    from rlctl.backends.base import SamplingParams
    from rlctl.backends.hf import HFPolicy

    if not Path(rlctl.__file__).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"rlctl came from {rlctl.__file__}, not from {tree}")
    policy = HFPolicy.load(model, "cpu")
    texts = [f"{i} + {i + 3} =" for i in range(rows // 4)]
    prompts = [ids for ids in policy.tokenizer(texts, add_special_tokens=False)["input_ids"] for _ in range(4)]
    params = SamplingParams(tokens, temperature=1.0, seed=1)
    if dtype == "default":
        dtype = tree_default_dtype()
    accepts_dtype = "compute_dtype" in inspect.signature(policy.generate).parameters
    options = {"compute_dtype": dtype} if accepts_dtype else {}
    seconds, count = [], 0
    for _ in range(generations):
        began = time.perf_counter()
        results = policy.generate(prompts, params, **options)
        seconds.append(time.perf_counter() - began)
        count = sum(len(r.response_ids) for r in results)
    setup = (f"{dtype}, " if accepts_dtype else "fp32, ") + "no process setup" + (", MKL's Intel kernels loaded by the bench" if preload else "")
    if has_setup:
        from rlctl import cpu_linear, mkl_kernels

        setup = f"{dtype}, MKL kernels {mkl_kernels.state()}, fp32 products {cpu_linear.linear_path()}"
    return {"seconds": seconds, "tokens": count, "setup": setup}


def tree_default_dtype() -> str:
    """The imported tree's default rollout.dtype, "auto" decided for this machine's CPU."""
    from rlctl.config import RolloutConfig

    dtype = RolloutConfig().dtype
    if dtype != "auto":
        return dtype
    from rlctl.dtypes import compute_dtype

    return compute_dtype(dtype, "cpu")


if __name__ == "__main__":
    main()
