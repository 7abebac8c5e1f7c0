"""Benchmark: rlctl and TRL's GRPOTrainer side by side on identical work.

The same small-preset model (made here, random weights), the same 256 addition prompts and
the same reward function (bench/addition_reward.py, TRL's calling form, which rlctl accepts
as it is), the same shape: 16 prompts × 4 samples × 64 new tokens per step, a reference model
in the loss (k3, β = 0.04, TRL's estimator), one optimizer step per batch, token-mean loss,
activations kept for the backward on both sides (GRPOConfig's default would recompute them:
`--trl-checkpointing`).
TRL runs in a virtual environment of its own, made on first use (`--venv`), with the torch
version this environment has. Rounds alternate TRL and rlctl in fresh processes; each
round's figure is the median over its steps after the first two (warm-up); the table gives
the median over rounds, phase by phase.

    python -m bench.trl_bench --rounds 2 --steps 6                # dtype: what rlctl's auto decides here
    python -m bench.trl_bench --rounds 2 --steps 6 --dtype fp32
    python -m bench.trl_bench --rounds 2 --steps 6 --trl-mkl-kernels rlctl  # TRL on the GEMM kernels rlctl runs
    python -m bench.trl_bench --rounds 2 --steps 6 --trl-checkpointing     # TRL as GRPOConfig defaults it
    python -m bench.trl_bench --device cuda --preset medium --tokens 128 --python python3  # a GPU, TRL installed there
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRL_VERSION = "1.16.0"
PROMPTS_PER_STEP, SAMPLES, NEW_TOKENS, LR, KL = 16, 4, 64, 1e-5, 0.04


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run; the first two are warm-up")
    parser.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"))
    parser.add_argument("--venv", type=Path, default=Path.home() / ".cache" / "rlctl-bench" / f"trl-{TRL_VERSION}")
    parser.add_argument("--python", help="a Python that imports trl and datasets already (no venv is made)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--preset", default="small", help="the model preset both sides train (rlctl model init --preset)")
    parser.add_argument("--tokens", type=int, default=NEW_TOKENS, help="new tokens per sample")
    parser.add_argument(
        "--trl-mkl-kernels", default="default", choices=("default", "rlctl"),
        help="default: TRL as its users run it (MKL's own kernel choice); rlctl: TRL's process preloads the library "
        "rlctl.mkl_kernels loads, so both sides run MKL's Intel kernels (as both would on an Intel CPU)",
    )
    parser.add_argument(
        "--trl-checkpointing", action="store_true",
        help="TRL recomputes activations in the backward, as GRPOConfig does by default (one more forward per "
        "update); off unless given, since rlctl keeps its activations: the same work on both sides",
    )
    parser.add_argument("--append", type=Path, help="append the Markdown result to this file")
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be at least 3 (two warm-up steps, then the timed ones)")

    from rlctl.dtypes import compute_dtype

    dtype = compute_dtype(args.dtype, args.device)
    python = Path(args.python) if args.python else ensure_trl_venv(args.venv)
    shape = Shape(
        args.device, args.tokens, trl_preload=intel_kernels_library() if args.trl_mkl_kernels == "rlctl" else None,
        trl_checkpointing=args.trl_checkpointing,
    )
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = work / args.preset
        subprocess.run([sys.executable, "-m", "rlctl", "model", "init", str(model), "--preset", args.preset], check=True, stdout=subprocess.DEVNULL)
        prompts = write_prompts(work / "addition.jsonl")
        rounds: dict[str, list[dict]] = {"trl": [], "rlctl": []}
        for r in range(args.rounds):
            rounds["trl"].append(run_trl(python, work / f"trl{r}", model, prompts, args.steps, dtype, shape))
            rounds["rlctl"].append(run_rlctl(work / f"rlctl{r}", model, prompts, args.steps, dtype, args.dtype, shape))
    text = report(rounds, args, dtype)
    print(text)
    if args.append:
        with open(args.append, "a") as f:
            f.write(text + "\n")


@dataclass(frozen=True)
class Shape:
    """Where both sides run, how long the responses are, and what TRL's process loads first."""

    device: str = "cpu"
    new_tokens: int = NEW_TOKENS
    trl_preload: Path | None = None  # a library TRL's process loads first (LD_PRELOAD)
    trl_checkpointing: bool = False  # TRL recomputes activations in its backward (GRPOConfig's default)


def intel_kernels_library() -> Path:
    """The library rlctl.mkl_kernels loads (built into its cache if missing); exits if it cannot be."""
    from rlctl import mkl_kernels

    library = mkl_kernels.build(mkl_kernels.cache_dir(), mkl_kernels.find_compiler())
    if library is None:
        sys.exit("--trl-mkl-kernels rlctl: the library rlctl.mkl_kernels loads could not be built (no working C compiler?)")
    return library


def ensure_trl_venv(venv: Path) -> Path:
    """The TRL venv's Python, made (torch first, our version, then TRL) when it is missing."""
    import torch

    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import trl, datasets"], capture_output=True).returncode == 0:
        return python
    print(f"making TRL's venv at {venv} (torch {torch.__version__}, trl {TRL_VERSION}) ...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"torch=={torch.__version__.split('+')[0]}"], check=True)
    subprocess.run([*pip, f"trl=={TRL_VERSION}", "datasets"], check=True)
    return python


def write_prompts(path: Path, count: int = 256, seed: int = 0) -> Path:
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append({"id": f"add{i:03d}", "prompt": f"What is {a} + {b}? Answer:", "ground_truth": str(a + b), "data_source": "addition"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_trl(python: Path, work: Path, model: Path, prompts: Path, steps: int, dtype: str, shape: Shape) -> dict[str, float]:
    work.mkdir()
    spec = {
        "model": str(model), "prompts": str(prompts), "reward_file": str(HERE / "addition_reward.py"), "reward_function": "addition_reward",
        "prompts_per_step": PROMPTS_PER_STEP, "samples": SAMPLES, "max_new_tokens": shape.new_tokens, "lr": LR, "kl_coef": KL,
        "steps": steps, "dtype": dtype, "seed": 0, "device": shape.device, "gradient_checkpointing": shape.trl_checkpointing,
    }
    (work / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if shape.trl_preload:
        env["LD_PRELOAD"] = " ".join(filter(None, [str(shape.trl_preload), env.get("LD_PRELOAD", "")]))
    _run([str(python), str(HERE / "trl_runner.py"), str(work / "spec.json"), str(work / "out.json")], env=env)
    record = json.loads((work / "out.json").read_text())
    timed = record["steps"][2:]

    def median(key: str) -> float:
        return statistics.median(s.get(key, 0.0) for s in timed)

    phases = {"generation": median("generate"), "reference forward": median("reference"), "reward": median("reward")}
    step = median("step_s")
    phases["policy forward + backward + AdamW"] = statistics.median(
        s["step_s"] - s.get("generate", 0.0) - s.get("reference", 0.0) - s.get("reward", 0.0) for s in timed
    )
    return {**phases, "step": step, "mkl_cpu_type": record.get("mkl_cpu_type"), "checkpointing": record.get("gradient_checkpointing")}


def run_rlctl(work: Path, model: Path, prompts: Path, steps: int, dtype: str, asked: str, shape: Shape) -> dict[str, float | str]:
    work.mkdir()
    config = work / "bench.toml"
    config.write_text(
        f'[model]\npath = "{model}"\nref = "{model}"\ndevice = "{shape.device}"\n'
        f'[data]\nprompts = "{prompts}"\nbatch_size = {PROMPTS_PER_STEP}\n'
        f'[rollout]\nn = {SAMPLES}\nmax_new_tokens = {shape.new_tokens}\n'
        f'[score]\nreward = "{HERE / "addition_reward.py"}:addition_reward"\n'
        '[advantage]\nestimator = "grpo"\nkl_coef = 0.0\n'
        f'[update]\nlr = {LR}\nuse_kl_loss = true\nkl_loss_coef = {KL}\nkl_loss_estimator = "k3"\n'
        f'micro_batch_size = {PROMPTS_PER_STEP * SAMPLES}\nloss_agg_mode = "token-mean"\n'
        f'[pipeline]\niterations = {steps}\nsave_every = {steps}\nkeep_checkpoints = 1\n'
    )
    sets = [] if asked == "auto" else ["--set", f"rollout.dtype={dtype}", "--set", f"score.dtype={dtype}", "--set", f"update.bf16={str(dtype == 'bf16').lower()}"]
    run = work / "run"
    _run([sys.executable, "-m", "rlctl", "pipeline", str(config), "--run-dir", str(run), "--quiet", *sets])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][2:]

    def median(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in rows)

    phases = {"generation": median("seconds/rollout"), "reference forward": median("seconds/score"), "reward": 0.0}
    phases["policy forward + backward + AdamW"] = median("seconds/update")
    return {**phases, "step": median("seconds/total"), "mkl_kernels": recorded_kernels(run)}


def recorded_kernels(run: Path) -> str:
    """The MKL kernels rlctl's stages ran on (rlctl.mkl_kernels), as their manifests record."""
    for manifest in sorted(run.glob("iter-*/rollout/_manifest.json")):
        return str(json.loads(manifest.read_text()).get("state", {}).get("mkl_kernels", "not recorded"))
    return "not recorded"


def _run(command: list[str], env: dict[str, str] | None = None) -> None:
    """Run one side; if it fails, stop with the end of what it printed."""
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command[:4])} ... failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")


def trl_kernels(args, trl_rounds: list[dict]) -> str:
    """How TRL's GEMMs were dispatched, in words: what was asked and MKL's detected CPU type."""
    asked = "the library rlctl loads, preloaded" if args.trl_mkl_kernels == "rlctl" else "MKL's own choice"
    types = sorted({str(r.get("mkl_cpu_type")) for r in trl_rounds})
    return f"{asked} (`mkl_serv_cpu_detect` = {'/'.join(types)}; 0 is MKL's generic path)"


def trl_checkpointing(trl_rounds: list[dict]) -> str:
    """Whether TRL's model recomputed activations in the backward, as its runs recorded it."""
    seen = {r.get("checkpointing") for r in trl_rounds}
    if seen == {False}:
        return "off (the same work as rlctl)"
    if seen == {True}:
        return "on (GRPOConfig's default: one more forward in each backward)"
    return f"recorded as {'/'.join(sorted(map(str, seen)))}"


def report(rounds: dict[str, list[dict]], args, dtype: str) -> str:
    from bench.pipeline_bench import _cpu_name, _gpu_name
    from rlctl.dtypes import native_bf16

    def med(side: str, key: str) -> float:
        return statistics.median(r[key] for r in rounds[side])

    keys = ["generation", "reference forward", "reward", "policy forward + backward + AdamW", "step"]
    flags = "native bf16 (avx512_bf16/amx_bf16)" if native_bf16("cpu") else "no native bf16"
    machine = f"{_cpu_name()}, {os.cpu_count()} cores, {flags}" if args.device == "cpu" else _gpu_name()
    trl_from = f"`{args.python}`" if args.python else "its own venv"
    lines = [
        f"- machine: {machine}, Python {platform.python_version()}",
        f"- command: `python -m bench.trl_bench --rounds {args.rounds} --steps {args.steps} --dtype {args.dtype} --device {args.device} --preset {args.preset} --tokens {args.tokens} --trl-mkl-kernels {args.trl_mkl_kernels}{' --trl-checkpointing' if args.trl_checkpointing else ''}` (decided: {dtype}); TRL {TRL_VERSION} in {trl_from}",
        f"- TRL's activation checkpointing: {trl_checkpointing(rounds['trl'])}; rlctl keeps its activations",
        f"- workload: {args.preset} preset, {PROMPTS_PER_STEP} prompts × {SAMPLES} samples × {args.tokens} new tokens, GRPO, k3 KL loss β = {KL} to a reference, one optimizer step per batch",
        f"- figures: seconds per step, median over steps 3–{args.steps} of each run, then over {args.rounds} alternating rounds",
        f"- fp32 GEMMs: rlctl on MKL's {'/'.join(sorted({r['mkl_kernels'] for r in rounds['rlctl']}))} kernels (rlctl.mkl_kernels); "
        f"TRL on {trl_kernels(args, rounds['trl'])}",
        "",
        "| phase | TRL | rlctl | rlctl / TRL |",
        "|---|---|---|---|",
    ]
    for key in keys:
        trl, ours = med("trl", key), med("rlctl", key)
        ratio = f"{ours / trl:.2f}" if trl > 0.005 else "—"
        name = "**iteration (whole step)**" if key == "step" else key
        lines.append(f"| {name} | {trl:.2f} | {ours:.2f} | {ratio} |")
    tokens = PROMPTS_PER_STEP * SAMPLES * args.tokens
    per = "GPU" if args.device == "cuda" else "process"
    trl_gen, our_gen = med("trl", "generation"), med("rlctl", "generation")
    if trl_gen > 0 and our_gen > 0:
        lines.append(f"| generation tokens/s per {per} (at full length, {tokens:,} tokens) | {tokens / trl_gen:,.0f} | {tokens / our_gen:,.0f} | — |")
    trl_step, our_step = med("trl", "step"), med("rlctl", "step")
    lines.append(f"| whole-step response tokens/s per {per} | {tokens / trl_step:,.0f} | {tokens / our_step:,.0f} | — |")
    lines.append("")
    lines.append("rlctl's reward time is inside its reference-forward column (the score stage does both); "
                 "its step also holds the advantage stage and the shard writes.")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
