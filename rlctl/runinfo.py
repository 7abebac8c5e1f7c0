"""Reading a finished or running pipeline run: its metrics rows and a summary."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rlctl.choices import PIPELINE_STAGES
from rlctl.config import suggest
from rlctl.errors import InputError
from rlctl.manifest import MANIFEST_NAME, Manifest
from rlctl.run_checks import resolved_config, run_findings
from rlctl.shards import PART_SUFFIX

SUMMARY_COLUMNS = (
    "iteration", "reward_mean", "kl", "entropy", "response_length", "response_length/clip_ratio", "pg_clipfrac", "grad_norm", "val/score", "seconds/total",
)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise InputError(f"{run_dir}: no metrics.jsonl (not a pipeline run, or no iteration finished yet)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_summary(run_dir: str | Path, *, columns: list[str] | None = None, last: int | None = None) -> dict[str, Any]:
    """A run's metrics rows with the columns worth a glance (or `columns`, any metrics the rows
    have, the iteration first), its last `last` iterations only where given, its checkpoints,
    and what its metrics suggest changing (judged on every row)."""
    rows = read_metrics(run_dir)
    if columns:
        known = sorted({key for row in rows for key in row})
        missing = [c for c in columns if c not in known]
        if missing:
            raise InputError(f"{run_dir}: no metric {missing[0]!r}{suggest(missing[0], known)}")
        chosen = ["iteration", *(c for c in columns if c != "iteration")]
    else:
        chosen = [c for c in SUMMARY_COLUMNS if any(c in r for r in rows)]
    shown = rows if last is None else rows[max(len(rows) - last, 0):]
    if columns:
        shown = [{c: r.get(c) for c in chosen} for r in shown]
    checkpoints = [p.name for p in iteration_folders(Path(run_dir) / "checkpoints")]
    cfg = resolved_config(run_dir)
    checks = [asdict(f) for f in run_findings(rows, cfg, run_dir)]
    summary = {"run_dir": str(run_dir), "iterations_done": sum(row["iteration"] > 0 for row in rows), "columns": chosen, "rows": shown, "checkpoints": checkpoints, "checks": checks}
    if cfg is not None and cfg.pipeline.keep_best:
        summary["best"] = _best(rows, cfg.pipeline.keep_best, cfg.pipeline.best_is, Path(run_dir))
    return summary


def _best(rows: list[dict[str, Any]], metric: str, best_is: str, run_dir: Path) -> dict[str, Any] | None:
    """pipeline.keep_best's pick: the metric, its best value, the iteration and its checkpoint."""
    iteration = best_iteration(rows, metric, best_is)
    if iteration is None:
        return None
    value = next(row[metric] for row in rows if row["iteration"] == iteration)
    checkpoint = run_dir / "checkpoints" / f"iter-{iteration:04d}"
    return {"metric": metric, "value": value, "iteration": iteration, "checkpoint": str(checkpoint) if (checkpoint / MANIFEST_NAME).exists() else None}


def best_iteration(rows: list[dict[str, Any]], metric: str, best_is: str = "max") -> int | None:
    """The iteration whose `metric` was best (`best_is`: max or min), the first of equals: the
    one pipeline.keep_best keeps a checkpoint of; None where no row measured it."""
    measured = [(row[metric], row["iteration"]) for row in rows if row["iteration"] > 0 and isinstance(row.get(metric), (int, float))]  # 0: the initial weights
    if not measured:
        return None
    sign = 1 if best_is == "max" else -1
    return max(measured, key=lambda pair: (sign * pair[0], -pair[1]))[1]


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


STAGE_ORDER = ("prompts", *PIPELINE_STAGES, "val")  # an iteration folder's outputs, in the loop's order


def is_iteration_folder(path: Path) -> bool:
    """`RUN/iter-N`: named so, holding at least one committed stage output."""
    return iteration_number(path) is not None and any((p / MANIFEST_NAME).is_file() for p in path.iterdir() if p.is_dir())


def iteration_summary(folder: str | Path) -> dict[str, Any]:
    """One iteration of a run: each committed stage's rows, seconds and metrics, in the loop's
    order, and the iteration's row of RUN/metrics.jsonl where the run has one."""
    path = Path(folder)
    number = iteration_number(path)
    folders = [p for p in path.iterdir() if p.is_dir()]
    committed = [p for p in folders if (p / MANIFEST_NAME).is_file()]
    uncommitted = sorted(p.name for p in folders if p not in committed)
    stages = []
    for stage_dir in sorted(committed, key=lambda p: (STAGE_ORDER.index(p.name) if p.name in STAGE_ORDER else len(STAGE_ORDER), p.name)):
        manifest = Manifest.from_json((stage_dir / MANIFEST_NAME).read_text())
        rows = manifest.rows if _holds_rows(manifest) else None
        stages.append({"folder": stage_dir.name, "stage": manifest.stage, "rows": rows, "seconds": manifest.timings.get("seconds"), "metrics": manifest.metrics})
    run_metrics = path.parent / "metrics.jsonl"
    rows = read_metrics(path.parent) if run_metrics.exists() else []
    metrics = next((r for r in rows if r.get("iteration") == number), None)
    return {"iteration": number, "folder": str(folder), "stages": stages, "uncommitted": uncommitted, "metrics": metrics}


def _holds_rows(manifest: Manifest) -> bool:
    """A shard output (rows), not a checkpoint or weights folder (files without rows)."""
    if not manifest.files:  # an empty shard output still has its schema
        return manifest.schema is not None
    return any(f.path.endswith(tuple(PART_SUFFIX.values())) for f in manifest.files)
