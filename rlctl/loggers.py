"""Where a pipeline's metrics go besides RUN/metrics.jsonl: `pipeline.loggers`.

    [pipeline]
    loggers = ["console", "jsonl", "tensorboard"]      # verl's trainer.logger, TRL's report_to

`jsonl` (RUN/metrics.jsonl) is always written: resume, `rlctl show` and `rlctl plot` read it,
so it is the source of truth and the others are copies of its rows. `console` is the live view
or the plain `iter N/total ...` lines. `tensorboard` writes event files to RUN/tensorboard;
`wandb` logs to the project `pipeline.wandb_project` (`pipeline.wandb_mode = "offline"` writes
RUN/wandb without a network); `mlflow` logs to `pipeline.mlflow_uri` (default: the file store
RUN/mlruns). Each logs the numeric values of a row at step = iteration, and the resolved config
once. A logger whose package is missing is exit 2 naming the extra to install.

MLflow's file store keeps a metric in a file named by its key, so `val/score` (a file) and
`val/score/odd` (a file in a folder of the same name) cannot both be there: in a file store the
keys read `.` for `/` (`val.score`, `val.score.odd`); a tracking server or database keeps them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from rlctl.algos.registry import Registry
from rlctl.completion_log import Completion, markdown_table
from rlctl.errors import ConfigError

EXTRAS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}  # logger: (module, extra)
ALWAYS = ("console", "jsonl")  # handled by the pipeline itself


class MetricsLogger(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def log_completions(self, completions: list[Completion], step: int) -> None: ...

    def close(self) -> None: ...


LOGGERS: Registry[Callable[..., MetricsLogger]] = Registry("logger")


def check_loggers(names: tuple[str, ...]) -> None:
    """Unknown names and missing packages, before any work (exit 2)."""
    for name in names:
        if name in ALWAYS:
            continue
        LOGGERS.get(name)
        module, extra = EXTRAS[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"pipeline.loggers: {name} needs the {module} package: pip install 'rlctl[{extra}]'")


def numeric(row: dict[str, Any]) -> dict[str, float]:
    """The values a tracker can plot: finite numbers (bools and None left out)."""
    return {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and k != "iteration"}


class Loggers:
    """The trackers of one run, fed every metrics row after it is in metrics.jsonl."""

    def __init__(self, names: tuple[str, ...], *, run_dir: Path, config: dict[str, Any], settings: Any) -> None:
        check_loggers(names)
        self.open = [LOGGERS.get(name)(run_dir=run_dir, config=config, settings=settings) for name in dict.fromkeys(names) if name not in ALWAYS]

    def log(self, row: dict[str, Any]) -> None:
        metrics = numeric(row)
        for logger in self.open:
            logger.log(metrics, int(row["iteration"]))

    def log_completions(self, completions: list[Completion], step: int) -> None:
        """An iteration's samples (`pipeline.log_completions`) to every tracker."""
        if completions:
            for logger in self.open:
                logger.log_completions(completions, step)

    def close(self) -> None:
        for logger in self.open:
            logger.close()
        self.open = []


def flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"update": {"lr": 1e-6}} → {"update.lr": 1e-6}; lists as their text."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return out


@LOGGERS.register("tensorboard")
class TensorBoardLogger:
    def __init__(self, *, run_dir: Path, config: dict[str, Any], settings: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.writer.add_text("config", "\n".join(f"    {k} = {v!r}" for k, v in flat(config).items()), 0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_completions(self, completions: list[Completion], step: int) -> None:
        self.writer.add_text("completions", markdown_table(completions), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


@LOGGERS.register("wandb")
class WandbLogger:
    """One wandb run per run folder: its id is derived from the folder, so a resumed run
    continues the same wandb run."""

    def __init__(self, *, run_dir: Path, config: dict[str, Any], settings: Any) -> None:
        import wandb

        run_id = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
        self.run = wandb.init(
            project=settings.wandb_project, name=run_dir.name, id=run_id, resume="allow", dir=str(run_dir),
            mode=settings.wandb_mode, config=config, settings=wandb.Settings(silent=True, console="off"),
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_completions(self, completions: list[Completion], step: int) -> None:
        import wandb

        columns = ["row", "prompt", "response", "reward", "advantage", "finish_reason"]
        table = wandb.Table(columns=columns, data=[[c.as_record()[k] for k in columns] for c in completions])
        self.run.log({"completions": table}, step=step)

    def close(self) -> None:
        self.run.finish()


def mlflow_file_store_key(name: str) -> str:
    """A metric's key in MLflow's file store, where a key is a path: no key is both a file and
    the folder of another (`response_length` and `response_length/max`)."""
    return name.replace("/", ".")


@LOGGERS.register("mlflow")
class MlflowLogger:
    def __init__(self, *, run_dir: Path, config: dict[str, Any], settings: Any) -> None:
        import mlflow

        uri = settings.mlflow_uri
        if not uri:  # the local default; MLflow 3 keeps its file store only behind this switch
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run_dir / "mlruns").resolve().as_uri()
        self.key = mlflow_file_store_key if urlparse(uri).scheme in ("", "file") else str
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(settings.mlflow_experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(settings.mlflow_experiment)
        runs = self.client.search_runs([experiment_id], filter_string=f"tags.rlctl_run_dir = '{run_dir.resolve()}'", max_results=1)
        if runs:  # a resumed run goes on in the same MLflow run
            self.run_id = runs[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name, tags={"rlctl_run_dir": str(run_dir.resolve())}).info.run_id
            for key, value in flat(config).items():
                self.client.log_param(self.run_id, key, str(value)[:500])

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(self.key(key), value, now, step) for key, value in metrics.items()])

    def log_completions(self, completions: list[Completion], step: int) -> None:
        self.client.log_text(self.run_id, markdown_table(completions) + "\n", f"completions/iter-{step:04d}.md")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
