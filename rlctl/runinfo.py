"""Reading a finished or running pipeline run: its metrics rows and a summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlctl.errors import InputError

SUMMARY_COLUMNS = ("iteration", "reward_mean", "kl", "entropy", "response_length", "pg_clipfrac", "grad_norm", "val/score", "seconds/total")


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise InputError(f"{run_dir}: no metrics.jsonl (not a pipeline run, or no iteration finished yet)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_summary(run_dir: str | Path) -> dict[str, Any]:
    rows = read_metrics(run_dir)
    columns = [c for c in SUMMARY_COLUMNS if any(c in r for r in rows)]
    checkpoints = [p.name for p in iteration_folders(Path(run_dir) / "checkpoints")]
    return {"run_dir": str(run_dir), "iterations_done": len(rows), "columns": columns, "rows": rows, "checkpoints": checkpoints}


def iteration_number(folder: Path) -> int | None:
    """`iter-0042` → 42 (any width: iter-10000 follows iter-9999); None for other names."""
    prefix, _, number = folder.name.partition("-")
    return int(number) if prefix == "iter" and number.isdigit() else None


def iteration_folders(root: Path) -> list[Path]:
    """The `iter-N` folders under `root`, in numeric order."""
    if not root.is_dir():
        return []
    found = [(n, p) for p in root.iterdir() if p.is_dir() and (n := iteration_number(p)) is not None]
    return [p for _, p in sorted(found)]
