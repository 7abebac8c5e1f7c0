"""What `rlctl pipeline` shows on stderr: a rich live view on a terminal (iteration progress,
the current stage with its own progress, the last iterations' key metrics), or one plain line
per iteration (`--quiet`, or stderr not a terminal)."""

from __future__ import annotations

import sys
import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from rlctl.completion_log import PROMPT_TAIL, RESPONSE_HEAD, Completion, console_lines, shortened

KEY_METRICS = (("reward", "reward_mean"), ("kl", "kl"), ("entropy", "entropy"), ("len", "response_length"), ("clip", "pg_clipfrac"), ("grad", "grad_norm"))


def plain_line(row: dict[str, Any], total: int | None = None, eta_seconds: float | None = None) -> str:
    parts = [f"iter {row['iteration']}" + (f"/{total}" if total else "")]
    for label, key in KEY_METRICS:
        value = row.get(key)
        if value is not None:
            parts.append(f"{label} {value:.4g}" if key != "reward_mean" else f"{label} {value:.3f}")
    if "val/score" in row:
        parts.append(f"val {row['val/score']:.3f}")
    parts.append(f"{row.get('seconds/total', 0.0):.1f}s")
    if eta_seconds is not None:
        parts.append(f"eta {duration(eta_seconds)}")
    return "  ".join(parts)


def duration(seconds: float) -> str:
    """1m20s, 2h05m, 45s: a time left, to the unit that matters."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class Eta:
    """Time left from the pace of the iterations run by this process (start-up excluded)."""

    def __init__(self) -> None:
        self.started: float | None = None
        self.first: int | None = None

    def start(self, iteration_before: int) -> None:
        if self.started is None:
            self.started, self.first = time.monotonic(), iteration_before

    def seconds_left(self, iteration: int, total: int) -> float | None:
        if self.started is None or self.first is None or iteration <= self.first:
            return None
        pace = (time.monotonic() - self.started) / (iteration - self.first)
        return pace * max(total - iteration, 0)


class PlainView:
    def __init__(self, stream=None, first_iteration: int = 0) -> None:
        self.stream = stream or sys.stderr
        self.first_iteration = first_iteration
        self.eta = Eta()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        """Nothing to tear down: each line was printed when its iteration ended."""

    def stage(self, name: str, total: float | None) -> None:
        """Plain output shows iterations only, not stages (the first one starts the clock)."""
        self.eta.start(self.first_iteration)

    def advance(self, amount: float) -> None:
        """Plain output has no per-stage progress."""

    def message(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def iteration_done(self, row: dict[str, Any], total: int) -> None:
        print(plain_line(row, total, self.eta.seconds_left(row["iteration"], total)), file=self.stream, flush=True)

    def completions(self, iteration: int, completions: list[Completion]) -> None:
        for line in console_lines(iteration, completions):
            print(line, file=self.stream, flush=True)


class LiveView:
    def __init__(self, first_iteration: int, total: int) -> None:
        self.console = Console(stderr=True)
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(), console=self.console)
        self.iterations = self.progress.add_task("iterations", total=total, completed=first_iteration)
        self.current = self.progress.add_task("starting", total=None)
        self.rows: list[dict[str, Any]] = []
        self.live = Live(self._render(), console=self.console, refresh_per_second=8, transient=False)

    def __enter__(self):
        self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.live.update(self._render())
        self.live.__exit__(*exc)

    def stage(self, name: str, total: float | None) -> None:
        self.progress.reset(self.current, description=name)
        # rich reads total=None as "unchanged"; a stage without a known size must pulse instead
        next(t for t in self.progress.tasks if t.id == self.current).total = total

    def advance(self, amount: float) -> None:
        self.progress.advance(self.current, amount)

    def message(self, text: str) -> None:
        self.console.print(text, markup=False)  # paths and values may hold brackets

    def completions(self, iteration: int, completions: list[Completion]) -> None:
        """Printed above the live view, so they scroll by as the iterations go."""
        table = Table(title=f"iteration {iteration}: samples", title_justify="left", show_lines=True)
        for name, justify in (("row", "right"), ("reward", "right"), ("adv", "right"), ("prompt", "left"), ("response", "left")):
            table.add_column(name, justify=justify, overflow="fold")
        for c in completions:
            response = shortened(c.response, RESPONSE_HEAD) + (" [cut at the limit]" if c.finish_reason == "length" else "")
            table.add_row(str(c.row), f"{c.reward:.4g}", f"{c.advantage:+.3g}", Text(shortened(c.prompt, PROMPT_TAIL, tail=True)), Text(response))  # Text: no markup read from samples
        self.console.print(table)

    def iteration_done(self, row: dict[str, Any], total: int) -> None:
        self.rows.append(row)
        self.progress.update(self.iterations, completed=row["iteration"], total=total)
        self.live.update(self._render())

    def _render(self):
        table = Table(title="last iterations", title_justify="left")
        table.add_column("iter", justify="right")
        for label, _ in KEY_METRICS:
            table.add_column(label, justify="right")
        table.add_column("s", justify="right")
        for row in self.rows[-5:]:
            cells = [f"{row[k]:.4g}" if row.get(k) is not None else "-" for _, k in KEY_METRICS]
            table.add_row(str(row["iteration"]), *cells, f"{row.get('seconds/total', 0):.1f}")
        return Group(self.progress, table)


def make_view(*, quiet: bool, first_iteration: int, total: int):
    if quiet or not sys.stderr.isatty():
        return PlainView(first_iteration=first_iteration)
    return LiveView(first_iteration, total)
