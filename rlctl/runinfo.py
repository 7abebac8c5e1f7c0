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
    checkpoints = sorted(p.name for p in (Path(run_dir) / "checkpoints").glob("iter-*")) if (Path(run_dir) / "checkpoints").exists() else []
    return {"run_dir": str(run_dir), "iterations_done": len(rows), "columns": columns, "rows": rows, "checkpoints": checkpoints}
