"""Benchmark: the pipeline on a preset model (`small`, ≈24M parameters, by default) for a few iterations.

Reports, as the median over several runs: seconds per stage per iteration, rollout and
training tokens/s, and the share of wall time spent on shard I/O and manifests.

    python bench/pipeline_bench.py --runs 3 --iterations 3          # prints a Markdown table
    python bench/pipeline_bench.py --runs 3 --append bench/RESULTS.md
    python bench/pipeline_bench.py --preset medium --set model.device=cuda --runs 1   # a GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlctl.config import load_config

PROMPTS = [{"id": f"b{i}", "prompt": f"Benchmark prompt number {i}: explain step {i}.", "data_source": "bench"} for i in range(32)]
STAGES = ("prompts", "rollout", "score", "advantage", "update", "handover")


def one_run(
    workdir: Path, model: Path, iterations: int, batch: int, n: int, tokens: int, overrides: list[str], *, save_every: int | None = None, env: dict | None = None
) -> dict[str, float]:
    """One `rlctl pipeline` process (`env`: its environment; a checkpoint every `save_every`
    iterations, at the end only by default): per-stage seconds, tokens/s, the process's wall
    time and largest resident size, and the update's token cap as the run decided it."""
    prompts = workdir / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    config = workdir / "bench.toml"
    config.write_text(
        f'[model]\npath = "{model}"\nref = "{model}"\n'
        f'[data]\nprompts = "{prompts}"\nbatch_size = {batch}\n'
        f'[rollout]\nn = {n}\nmax_new_tokens = {tokens}\n'
        '[score]\nreward = "builtin:length"\n'
        '[advantage]\nestimator = "grpo"\nkl_coef = 0.01\n'
        f'[update]\nlr = 1e-5\nmicro_batch_size = {batch * n // 2}\n'
        f'[pipeline]\niterations = {iterations}\nsave_every = {save_every or iterations}\nkeep_checkpoints = 1\n'
    )
    run = workdir / "run"
    started = time.perf_counter()
    sets = [arg for item in overrides for arg in ("--set", item)]
    command = [sys.executable, "-m", "rlctl", "pipeline", str(config), "--run-dir", str(run), "--quiet", *sets]
    log = workdir / "pipeline.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stderr=out, stdout=out, env=env)
        _, status, usage = os.wait4(process.pid, 0)  # this child's own rusage (RUSAGE_CHILDREN: the largest of all so far)
    if os.waitstatus_to_exitcode(status):
        sys.exit(f"{' '.join(command[:4])} ... failed ({os.waitstatus_to_exitcode(status)}):\n{log.read_text(errors='replace')[-3000:]}")
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    out = {f"{s} s/iter": statistics.mean(r.get(f"seconds/{s}", 0.0) for r in rows) for s in STAGES}
    out["shard I/O + manifests s/iter"] = statistics.mean(r["seconds/io"] for r in rows)
    out["iteration s"] = statistics.mean(r["seconds/total"] for r in rows)
    out["I/O share %"] = 100 * out["shard I/O + manifests s/iter"] / out["iteration s"]
    out["rollout tok/s"] = statistics.mean(r["rollout_tokens_per_s"] for r in rows)
    out["train tok/s"] = statistics.mean(r["train_tokens_per_s"] for r in rows)
    out["process wall s (incl. start, model load, checkpoint)"] = wall
    out["largest resident size GB"] = usage.ru_maxrss * 1024 / 1e9  # Linux reports kB
    out["update.micro_batch_tokens"] = float(load_config(run / "config.resolved.toml").update.micro_batch_tokens)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--preset", default="small", help="the model: a `rlctl model init` preset")
    parser.add_argument("--model", type=Path, help="an HF folder to use instead of a fresh preset")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override, e.g. update.bf16=true")
    parser.add_argument("--append", type=Path, help="append the Markdown result to this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or Path(tmp) / args.preset
        if args.model is None:
            subprocess.run([sys.executable, "-m", "rlctl", "model", "init", str(model), "--preset", args.preset], check=True, stdout=subprocess.DEVNULL)
        results = []
        for r in range(args.runs):
            workdir = Path(tmp) / f"run{r}"
            workdir.mkdir()
            results.append(one_run(workdir, model, args.iterations, args.batch, args.n, args.tokens, args.overrides))
    medians = {k: statistics.median(r[k] for r in results) for k in results[0]}
    cpu = _cpu_name()
    sets = "".join(f" --set {o}" for o in args.overrides)
    command = f"python bench/pipeline_bench.py {f'--model {args.model} ' if args.model else ''}--preset {args.preset} --runs {args.runs} --iterations {args.iterations} --batch {args.batch} --n {args.n} --tokens {args.tokens}{sets}"
    lines = [
        f"### pipeline, `{args.preset}` preset — {time.strftime('%Y-%m-%d')}",
        "",
        f"- machine: {cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, torch threads default, {_gpu_name()}",
        f"- command: `{command}`",
        f"- workload: {args.batch} prompts × {args.n} samples × {args.tokens} new tokens per iteration, GRPO with a reference model, fp32 weights{' (' + ', '.join(args.overrides) + ')' if args.overrides else ''}",
        f"- median of {args.runs} runs (each the mean over its {args.iterations} iterations)",
        "",
        "| metric | median |",
        "|---|---|",
        *[f"| {k} | {v:.3f} |" if v < 100 else f"| {k} | {v:,.0f} |" for k, v in medians.items()],
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.append:
        with open(args.append, "a") as f:
            f.write(text + "\n")


def _gpu_name() -> str:
    import torch

    if not torch.cuda.is_available():
        return "no GPU"
    return f"{torch.cuda.device_count()} × {torch.cuda.get_device_name(0)} (torch {torch.__version__}, CUDA {torch.version.cuda})"


def machine_name(device_type: str) -> str:
    """The CPU and its core count, or the GPUs: the machine line of a result."""
    return _cpu_name() + f", {os.cpu_count()} cores" if device_type == "cpu" else _gpu_name()


def publish(lines: list[str], append: str | None) -> None:
    """Print a Markdown result, and append it to the file `append` names."""
    text = "\n".join(lines)
    print(text)
    if append:
        with open(append, "a", encoding="utf-8") as f:
            f.write("\n" + text + "\n")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    main()
