"""One rich progress bar on stderr for long work; silent when stderr is not a terminal."""

from __future__ import annotations

import sys
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text


class _Silent:
    def advance(self, amount: float = 1) -> None:
        """No terminal, no bar: progress is dropped."""


class _Bar:
    def __init__(self, progress: Progress, task) -> None:
        self._progress, self._task = progress, task

    def advance(self, amount: float = 1) -> None:
        self._progress.update(self._task, advance=amount)


class _RateColumn(ProgressColumn):
    def __init__(self, unit: str) -> None:
        super().__init__()
        self.unit = unit

    def render(self, task) -> Text:
        return Text(f"{task.speed:,.0f} {self.unit}/s" if task.speed else "")


def enabled() -> bool:
    return sys.stderr.isatty()


@contextmanager
def progress_bar(description: str, total: float | None, *, unit: str = "it", show: bool | None = None):
    """`with progress_bar("rollout", total=n, unit="tok") as bar: bar.advance(k)`."""
    if not (enabled() if show is None else show):
        yield _Silent()
        return
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), _RateColumn(unit), TimeElapsedColumn()]
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield _Bar(progress, task)
