"""Shared fixtures: a tiny local model (made once per session), a CLI runner with a fixed
terminal width, and small prompt files."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from rlctl import mkl_kernels

# MKL's kernels chosen before torch loads, as the CLI does (rlctl.mkl_kernels), so that runs in
# this process and `rlctl` subprocesses compute alike (tests compare their last bits); where
# this process cannot have them, neither do the subprocesses.
if mkl_kernels.enable() != mkl_kernels.INTEL:
    os.environ["RLCTL_MKL_KERNELS"] = "default"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# "auto" dtypes decide as on a CPU without native bf16 (fp32), whatever CPU runs the suite: the
# tests' exact comparisons are fp32's. tests/unit/test_dtypes.py checks the decision itself.
os.environ.setdefault("RLCTL_NATIVE_BF16", "0")

CLI_ENV = {"COLUMNS": "100", "TERMINAL_WIDTH": "100", "NO_COLOR": "1", "_TYPER_FORCE_DISABLE_TERMINAL": "1"}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from rlctl.backends.hf import quiet_transformers
    from rlctl.modelinit import init_model

    quiet_transformers()
    return str(init_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0))


# the Llama-layout classes' test models: tiny widths, grouped-query attention
LLAMA_FAMILY_SHAPE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}


def model_folder(tmp_path_factory, tiny_model: str, kind: str) -> str:
    """A random model of transformers' `kind` (qwen2, llama, mistral, qwen3: LLAMA_FAMILY_SHAPE)
    beside the tiny model's tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp(kind)
    for file in Path(tiny_model).iterdir():
        if "tokenizer" in file.name or file.name in ("special_tokens_map.json", "generation_config.json", "chat_template.jinja"):
            shutil.copy(file, folder / file.name)
    vocab = AutoConfig.from_pretrained(tiny_model).vocab_size
    extra = {"sliding_window": None} if kind == "mistral" else {}
    config = AutoConfig.for_model(kind, vocab_size=vocab, **LLAMA_FAMILY_SHAPE, **extra)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def ray_session():
    """One embedded Ray for the module; each worker group (and each in-process command) joins
    it instead of starting Ray of its own."""
    ray = pytest.importorskip("ray")
    from rlctl.workers.ray import WORKER_SETUP_HOOK

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR", runtime_env={"worker_process_setup_hook": WORKER_SETUP_HOOK})
    yield
    ray.shutdown()


@pytest.fixture
def cli():
    """Run `rlctl ARGS` in-process; returns the result (exit_code, stdout, stderr)."""
    from typer.testing import CliRunner

    from rlctl.cli import app

    runner = CliRunner(env=CLI_ENV)

    def invoke(*args: str, input: bytes | str | None = None):
        return runner.invoke(app, [str(a) for a in args], input=input)

    return invoke


@pytest.fixture
def prompts_file(tmp_path) -> str:
    rows = [
        {"id": "p0", "prompt": "The answer is", "ground_truth": "42", "data_source": "toy"},
        {"id": "p1", "messages": [{"role": "user", "content": "What is 2 + 2?"}], "ground_truth": "4", "data_source": "toy"},
        {"id": "p2", "prompt": "Count: one two", "ground_truth": "3", "data_source": "count"},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def one_line_error(result) -> str:
    """The single stderr line of a failed command (asserts there is exactly one)."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one stderr line, got: {result.stderr!r}"
    return lines[0]


def part_files(folder: str | Path) -> list[Path]:
    """The part files a committed folder's manifest lists, in order."""
    manifest = json.loads((Path(folder) / "_manifest.json").read_text())
    return [Path(folder) / entry["path"] for entry in manifest["files"]]


def assert_not_written(path: str | Path) -> None:
    p = Path(path)
    assert not p.exists() or not any(p.iterdir()), f"{p} was written"


def metrics_without_timings(run_dir: str | Path) -> list[dict]:
    """A run's metrics.jsonl rows less what the clock decides (seconds, tokens per second): what
    a resumed run must reproduce bit for bit."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("seconds") and "tokens_per_s" not in k} for r in rows]


def assert_same_metrics(run: str | Path, other: str | Path) -> None:
    ours, theirs = metrics_without_timings(run), metrics_without_timings(other)
    differing = [(i, k, a.get(k), b.get(k)) for i, (a, b) in enumerate(zip(ours, theirs)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]
    assert len(ours) == len(theirs) and not differing, differing
