"""What bench/sft_bench.py and bench/rm_bench.py share: an rlctl trainer command and a TRL
trainer beside it on identical work, alternating rounds in fresh processes, TRL in the venv
bench/trl_bench.py makes and timed by a runner script in that venv (each optimizer step's end)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench.trl_bench import TRL_VERSION, _run, ensure_trl_venv

HERE = Path(__file__).resolve().parent


def parser(doc: str) -> argparse.ArgumentParser:
    """The options both benches take."""
    options = argparse.ArgumentParser(description=doc.splitlines()[0])
    options.add_argument("--rounds", type=int, default=3)
    options.add_argument("--steps", type=int, default=8, help="optimizer steps per epoch")
    options.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"))
    options.add_argument("--preset", default="small")
    options.add_argument("--venv", type=Path, default=Path.home() / ".cache" / "rlctl-bench" / f"trl-{TRL_VERSION}")
    options.add_argument("--append", type=Path, help="append the Markdown result to this file")
    return options


def alternate(args, write_data: Callable[[Path], Path], trl_side: Callable, rlctl_side: Callable) -> tuple[dict[str, list[dict]], str]:
    """Rounds of TRL then rlctl on one model (made here, random weights) and one data file:
    (each side's per-round records, the dtype decided). `trl_side(python, work, model, data,
    dtype)` and `rlctl_side(work, model, data, dtype)` run one round each in `work`."""
    from rlctl.dtypes import compute_dtype

    dtype = compute_dtype(args.dtype, "cpu")
    python = ensure_trl_venv(args.venv)
    rounds: dict[str, list[dict]] = {"trl": [], "rlctl": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = work / args.preset
        subprocess.run([sys.executable, "-m", "rlctl", "model", "init", str(model), "--preset", args.preset], check=True, stdout=subprocess.DEVNULL)
        data = write_data(work)
        for r in range(args.rounds):
            rounds["trl"].append(trl_side(python, work / f"trl{r}", model, data, dtype))
            rounds["rlctl"].append(rlctl_side(work / f"rlctl{r}", model, data, dtype))
    return rounds, dtype


def trl_run(python: Path, runner: str, work: Path, spec: dict, steps: int) -> tuple[float, dict]:
    """A TRL run of two epochs of `steps` optimizer steps by `runner`: (its second epoch's
    seconds per step, what the runner recorded)."""
    work.mkdir()
    (work / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    _run([str(python), str(HERE / runner), str(work / "spec.json"), str(work / "out.json")], env=env)
    record = json.loads((work / "out.json").read_text())
    ends = [e["time"] for e in record["ends"]]
    if len(ends) != 2 * steps:
        sys.exit(f"TRL made {len(ends)} optimizer steps, expected {2 * steps}")
    return (ends[-1] - ends[steps - 1]) / steps, record


def rlctl_run(work: Path, command: list[str]) -> dict:
    """An rlctl trainer command writing `work/out`: the manifest it committed."""
    work.mkdir()
    _run([sys.executable, "-m", "rlctl", *command, "--out", str(work / "out")])
    return json.loads((work / "out" / "_manifest.json").read_text())


def machine_line() -> str:
    from bench.pipeline_bench import _cpu_name
    from rlctl.dtypes import native_bf16

    flags = "native bf16 (avx512_bf16/amx_bf16)" if native_bf16("cpu") else "no native bf16"
    return f"- machine: {_cpu_name()}, {os.cpu_count()} cores, {flags}, Python {platform.python_version()}"


def per_round(rounds: dict[str, list[dict]], side: str) -> str:
    return ", ".join(f"{r['step']:.3f}" for r in rounds[side])


def finish(text: str, args) -> None:
    print(text)
    if args.append:
        with open(args.append, "a") as f:
            f.write(text + "\n")
