"""`rlctl show URI`: a shard's first rows, a manifest, a checkpoint, a run or one of its
iterations, as a table on stdout (`--json` for machines).

    rlctl show runs/x/iter-0001/rollout --rows 5
    rlctl show runs/x --columns groups/equal_rewards,response_length/clip_ratio --rows 20

A shard's rows are a table while every column gets a readable width on the terminal, and
otherwise records — one block per row, a line per column — so that a rollout's prompt and
response can be read on an 80-column terminal (`--layout` chooses).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from rlctl.choices import SHOW_LAYOUTS
from rlctl.config import RESOLVED_CONFIG
from rlctl.errors import InputError
from rlctl.manifest import MANIFEST_NAME, Manifest
from rlctl.row_filter import list_means, rows_where
from rlctl.shards import STDIO, filesystem, local_path, read

TOKEN_ID_COLUMNS = ("prompt_ids", "response_ids")
TABLE_CELL_WIDTH = 40  # a table's cells at most, unless --width says otherwise
SHARD_ROWS = 10  # a shard's rows shown unless --rows says
READABLE_CELL_WIDTH = 24  # auto: narrower table cells than this, and the rows become records


def show(
    uri: str,
    *,
    rows: int | None = None,
    width: int | None = None,
    as_json: bool = False,
    columns: list[str] | None = None,
    layout: str = "auto",
    sort: str | None = None,
    where: list[str] | None = None,
) -> None:
    if layout not in SHOW_LAYOUTS:
        raise InputError(f"unknown layout {layout!r}; use {', '.join(SHOW_LAYOUTS)}")
    console = Console(soft_wrap=False)
    kind = classify(uri)
    if kind != "shards" and (where or sort):
        raise InputError(f"{uri}: --where and --sort pick a shard's rows; a {kind} has none (a run: --columns and --rows pick its metrics)")
    if kind == "run":
        from rlctl.runinfo import run_summary

        summary = run_summary(uri, columns=columns, last=rows)
        _emit(console, summary, as_json, lambda: _run_view(summary))
    elif kind == "iteration":
        from rlctl.runinfo import iteration_summary

        summary = iteration_summary(uri)
        _emit(console, summary, as_json, lambda: _iteration_view(summary))
    elif kind == "checkpoint":
        summary = checkpoint_summary(uri)
        _emit(console, summary, as_json, lambda: _dict_table(f"checkpoint {uri}", summary))
    elif kind == "manifest":
        manifest = Manifest.from_json(_read_text(uri))
        data = json.loads(manifest.to_json())
        _emit(console, data, as_json, lambda: _dict_table(f"manifest {uri}", _manifest_summary(manifest)))
    else:
        shards = read(uri)
        rows = SHARD_ROWS if rows is None else rows
        selected = rows_where(shards.table, where or [], uri)
        head = sorted_rows(selected, sort, uri).slice(0, rows) if sort else selected.slice(0, rows)
        if columns:
            missing = [c for c in columns if c not in head.column_names]
            if missing:
                raise InputError(f"{uri}: no column {missing[0]!r}; columns: {', '.join(head.column_names)}")
            head = head.select(columns)
        else:  # token ids are for machines; --columns or --json shows them
            head = head.drop_columns([c for c in TOKEN_ID_COLUMNS if c in head.column_names])
        data = {
            "uri": uri,
            "rows": shards.table.num_rows,
            "matched": selected.num_rows if where else None,
            "schema": _schema_name(shards.table.schema),
            "manifest": json.loads(shards.manifest.to_json()) if shards.manifest else None,
            "head": head.to_pylist(),
        }
        title = _shard_title(uri, shards.table, shards.manifest) + (f"; {selected.num_rows} where {' and '.join(where)}" if where else "")
        fit = max(6, (console.width - 1) // max(len(head.column_names), 1) - 3)  # every column stays visible
        narrow = fit < min(width or TABLE_CELL_WIDTH, READABLE_CELL_WIDTH)
        if head.num_rows and (layout == "records" or (layout == "auto" and narrow)):
            line = max(8, console.width - max((len(c) for c in head.column_names), default=0) - 7)  # the value's room on a line
            _emit(console, data, as_json, lambda: _shard_records(title, head, min(width or line, line)))
        else:
            _emit(console, data, as_json, lambda: _shard_table(title, head, min(width or TABLE_CELL_WIDTH, fit)))


def sorted_rows(table: pa.Table, sort: str, uri: str) -> pa.Table:
    """The rows by one column, ascending, or descending for `-COLUMN` (the lowest rewards
    first, or `-reward` for the highest); a list column sorts by its mean, nulls last."""
    name, order = (sort[1:], "descending") if sort.startswith("-") else (sort, "ascending")
    if name not in table.column_names:
        raise InputError(f"{uri}: no column {name!r} to sort by; columns: {', '.join(table.column_names)}")
    column = table.column(name)
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        if not pa.types.is_floating(column.type.value_type) and not pa.types.is_integer(column.type.value_type):
            raise InputError(f"{uri}: column {name!r} holds lists of {column.type.value_type}; sort by a number or text column")
        column = list_means(column)
    key = "_rlctl_sort_key"
    keyed = table.append_column(key, column)
    return keyed.sort_by([(key, order)]).drop_columns([key])


def classify(uri: str) -> str:
    if uri == STDIO:
        return "shards"
    fs, path = filesystem(uri)
    if not fs.exists(path):
        raise InputError(f"{uri!r} does not exist")
    if path.endswith(MANIFEST_NAME):
        return "manifest"
    if fs.isdir(path):
        if fs.exists(path.rstrip("/") + "/metrics.jsonl") or fs.exists(path.rstrip("/") + "/" + RESOLVED_CONFIG):
            return "run"
        if fs.exists(path.rstrip("/") + "/config.json"):
            return "checkpoint"
        local = local_path(uri)
        if local is not None and not fs.exists(path.rstrip("/") + "/" + MANIFEST_NAME):
            from rlctl.runinfo import is_iteration_folder

            if is_iteration_folder(Path(local)):
                return "iteration"
    return "shards"


def checkpoint_summary(uri: str) -> dict[str, Any]:
    path = Path(uri)
    config = json.loads((path / "config.json").read_text())
    weights = sorted(path.glob("*.safetensors"))
    summary: dict[str, Any] = {
        "architecture": ", ".join(config.get("architectures", [])) or config.get("model_type", "?"),
        "dtype": config.get("torch_dtype") or config.get("dtype"),
        "layers": config.get("num_hidden_layers"),
        "hidden_size": config.get("hidden_size"),
        "vocab_size": config.get("vocab_size"),
        "weights": [f.name for f in weights],
        "weight_bytes": sum(f.stat().st_size for f in weights),
        "parameters": _parameter_count(weights),
    }
    state = path / "trainer_state" / "state.json"
    if state.exists():
        summary["step"] = json.loads(state.read_text())["step"]
    summary["critic"] = (path / "critic").exists()
    if (path / MANIFEST_NAME).exists():
        manifest = Manifest.from_json((path / MANIFEST_NAME).read_text())
        summary["stage"] = manifest.stage
        summary["metrics"] = manifest.metrics
    return summary


def _parameter_count(files: list[Path]) -> int:
    from safetensors import safe_open

    total = 0
    for file in files:
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                shape = f.get_slice(key).get_shape()
                count = 1
                for dim in shape:
                    count *= dim
                total += count
    return total


def _manifest_summary(m: Manifest) -> dict[str, Any]:
    return {
        "stage": m.stage,
        "schema": f"{m.schema} {m.schema_version}" if m.schema else None,
        "rows": m.rows,
        "files": len(m.files),
        "inputs": [i.uri for i in m.inputs],
        "seed": m.seed,
        "key": m.key,
        "seconds": m.timings.get("seconds"),
        "rlctl": m.rlctl_version,
        **({"metrics": m.metrics} if m.metrics else {}),
        **({"state": m.state} if m.state else {}),
    }


def _schema_name(schema: pa.Schema) -> str | None:
    meta = schema.metadata or {}
    name = meta.get(b"rlctl.schema")
    version = meta.get(b"rlctl.schema_version")
    return f"{name.decode()} {version.decode()}" if name else None


def _read_text(uri: str) -> str:
    fs, path = filesystem(uri)
    with fs.open(path, "rt") as f:
        return f.read()


def _emit(console: Console, data: Any, as_json: bool, render) -> None:
    if as_json:
        print(json.dumps(data, indent=2, default=str, sort_keys=True))
    else:
        console.print(render())


def _cell(value: Any) -> str:
    """Lists as `[n] v0 v1 …` with short numbers, so a row stays on one line."""
    if isinstance(value, list) and value and not isinstance(value[0], dict):
        return f"[{len(value)}] " + " ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in value[:16])
    if isinstance(value, float):
        return f"{value:.4g}"
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def _cut(value: Any, width: int) -> str:
    text = _cell(value)
    text = text.replace("\n", "⏎")
    return text if len(text) <= width else text[: width - 1] + "…"


def _shard_title(uri: str, table: pa.Table, manifest: Manifest | None) -> str:
    schema = _schema_name(table.schema) or "no schema"
    stage = f", stage {manifest.stage}" if manifest else ""
    return f"{uri}: {table.num_rows} rows, {schema}{stage}"


def _shard_table(title: str, head: pa.Table, width: int) -> Table:
    out = Table(title=title, title_justify="left", min_width=len(title))  # the title on one line (rich caps it at the terminal)
    for name in head.column_names:
        out.add_column(name, no_wrap=True, overflow="ellipsis", max_width=width)
    for row in head.to_pylist():
        out.add_row(*(_cut(row[c], width) for c in head.column_names))
    return out


def _shard_records(title: str, head: pa.Table, width: int) -> Group:
    """One two-column block per row: the column's name, then its value on one line."""
    blocks = []
    for index, row in enumerate(head.to_pylist()):
        block = Table(title=title if index == 0 else None, title_justify="left", show_header=False, min_width=len(title))
        block.add_column("column", style="bold")
        block.add_column(f"row {index}", no_wrap=True, overflow="ellipsis", max_width=width)
        block.add_row("row", str(index), end_section=True)
        for name in head.column_names:
            block.add_row(name, _cut(row[name], width))
        blocks.append(block)
    return Group(*blocks)


def _dict_table(title: str, data: dict[str, Any]) -> Table:
    out = Table(title=title, title_justify="left", show_header=False)
    out.add_column("key", style="bold")
    out.add_column("value")
    for key, value in data.items():
        if isinstance(value, dict):
            for sub, v in value.items():
                out.add_row(f"{key}.{sub}", _cut(_round(v), 80))
        else:
            out.add_row(key, _cut(value, 80))
    return out


def _round(value: Any) -> Any:
    return round(value, 6) if isinstance(value, float) else value


ITERATION_METRICS = {  # a stage's metrics worth a glance (all of them: --json)
    "rollout": ("response_length", "response_length/clip_ratio", "rollout_tokens_per_s"),
    "score": ("reward_min", "reward_max", "groups/equal_rewards"),
    "advantage": ("reward_mean", "reward_std", "kl", "advantage_mean"),
    "update": ("pg_loss", "pg_clipfrac", "entropy", "kl_divergence", "grad_norm", "vf_loss"),
    "validate": ("val/score",),
}


def _iteration_view(summary: dict[str, Any]) -> Group:
    """The iteration's stages in the loop's order (rows, seconds, key metrics), then its row of
    the run's metrics."""
    stages = Table(title=f"iteration {summary['iteration']}: {summary['folder']}", title_justify="left")
    for name, justify in (("stage", "left"), ("rows", "right"), ("seconds", "right"), ("metrics", "left")):
        stages.add_column(name, justify=justify)
    for stage in summary["stages"]:
        shown = [f"{k} {_fmt(stage['metrics'][k])}" for k in ITERATION_METRICS.get(stage["stage"], ()) if stage["metrics"].get(k) is not None]
        stages.add_row(stage["folder"], _fmt(stage["rows"]), _fmt(stage["seconds"]), "  ".join(shown))
    for name in summary["uncommitted"]:
        stages.add_row(name, "-", "-", "not committed (the run stopped here, or a stage is running)")
    parts: list[Any] = [stages]
    if summary["metrics"]:
        parts.append(_dict_table("the run's metrics for this iteration", summary["metrics"]))
    return Group(*parts)


def _run_view(summary: dict[str, Any]) -> Group:
    """The run's metrics table, then what its metrics suggest changing (rlctl.run_checks)."""
    parts: list[Any] = [_run_table(summary)]
    best = summary.get("best")
    if best:
        where = best["checkpoint"] or "its checkpoint is gone"
        parts.append(Text(f"best {best['metric']} {_fmt(best['value'])} at iteration {best['iteration']}: {where}", style="green"))
    parts.extend(Text(f"! {check['message']}", style="yellow") for check in summary["checks"])
    return Group(*parts)


def _run_table(summary: dict[str, Any]) -> Table:
    out = Table(title=f"run {summary['run_dir']}: {summary['iterations_done']} iterations", title_justify="left")
    columns = summary["columns"]
    labels = {"iteration": "iter", "reward_mean": "reward", "response_length": "len", "response_length/clip_ratio": "cut", "pg_clipfrac": "clip", "grad_norm": "grad", "val/score": "val", "seconds/total": "s"}
    for name in columns:
        out.add_column(labels.get(name, name), justify="right")
    for row in summary["rows"]:
        out.add_row(*(_fmt(row.get(c)) for c in columns))
    return out


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
