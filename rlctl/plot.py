"""`rlctl plot RUN [RUN ...]`: one PNG of reward, KL, entropy, response length and validation
score by iteration, from each RUN/metrics.jsonl; several runs share the panels, a line each,
to compare algorithms or settings on the same task.

    rlctl plot runs/grpo                          # runs/grpo/metrics.png
    rlctl plot runs/grpo runs/drgrpo runs/dapo    # runs/compare.png
    rlctl plot runs/grpo --metrics groups/equal_rewards,response_length/clip_ratio   # those panels instead
"""

from __future__ import annotations

import os
from pathlib import Path

from rlctl.config import suggest
from rlctl.errors import InputError
from rlctl.runinfo import read_metrics

PANELS = (("reward_mean", "reward (mean)"), ("kl", "KL to reference"), ("entropy", "entropy"), ("response_length", "response length (tokens)"), ("val/score", "validation score"))
COMPARE_NAME = "compare.png"


def plot_runs(run_dirs: list[str], out: str | None = None, metrics: list[str] | None = None) -> str:
    """Write the panels of `run_dirs` to `out` (default: RUN/metrics.png for one run, the runs'
    common folder's compare.png for several) and return its path. `metrics`: a panel for each
    of these instead of the usual ones (any metric of metrics.jsonl)."""
    if not run_dirs:
        raise InputError("plot: name at least one run folder")
    if len(set(map(os.path.abspath, run_dirs))) < len(run_dirs):
        raise InputError("plot: a run folder is named twice")
    runs = {label: read_metrics(run_dir) for label, run_dir in zip(run_labels(run_dirs), run_dirs)}
    panels = chosen_panels(metrics, runs) if metrics else PANELS
    target = Path(out) if out else default_output(run_dirs)
    fig = metrics_figure(runs, " · ".join(run_dirs), panels)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return str(target)


def chosen_panels(metrics: list[str], runs: dict[str, list[dict]]) -> tuple[tuple[str, str], ...]:
    """A panel per metric asked for, titled as the usual panel where it is one; a metric that
    no run recorded is an error naming the closest that one did."""
    recorded = {key for rows in runs.values() for row in rows for key in row if key != "iteration"}
    for key in metrics:
        if key not in recorded:
            raise InputError(f"plot --metrics: no run recorded {key!r}{suggest(key, recorded)}")
    titles = dict(PANELS)
    return tuple((key, titles.get(key, key)) for key in dict.fromkeys(metrics))


def metrics_figure(runs: dict[str, list[dict]], title: str, panels: tuple[tuple[str, str], ...] = PANELS):
    """The panels, a line per run (label → its metrics rows), a legend where there are several."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colors = [palette[i % len(palette)] for i in range(len(runs))]  # a run keeps its colour on panels where another recorded nothing
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2), constrained_layout=True, squeeze=False)
    axes = axes[0]
    for ax, (key, panel_title) in zip(axes, panels):
        drawn = False
        for color, (label, rows) in zip(colors, runs.items()):
            drawn |= _draw(ax, rows, key, label, color)
        if not drawn:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(panel_title)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    if len(runs) > 1:
        axes[0].legend(fontsize="small")
    fig.suptitle(title)
    return fig


def _draw(ax, rows: list[dict], key: str, label: str, color: str) -> bool:
    """One run's line on one panel (with ±1 std of the reward where recorded); False where the
    run did not record `key`."""
    points = [(r["iteration"], r[key], r.get("reward_std")) for r in rows if r.get(key) is not None]
    if not points:
        return False
    xs, ys, stds = zip(*points)
    ax.plot(xs, ys, marker="o", markersize=3, color=color, label=label)
    if key == "reward_mean" and all(s is not None for s in stds):
        ax.fill_between(xs, [y - s for y, s in zip(ys, stds)], [y + s for y, s in zip(ys, stds)], color=color, alpha=0.2)
    return True


def run_labels(run_dirs: list[str]) -> list[str]:
    """Each run's folder name, or the path as given where two runs share a name."""
    names = [Path(d).name or str(d) for d in run_dirs]
    return names if len(set(names)) == len(names) else [str(d) for d in run_dirs]


def default_output(run_dirs: list[str]) -> Path:
    if len(run_dirs) == 1:
        return Path(run_dirs[0]) / "metrics.png"
    return Path(os.path.commonpath([os.path.abspath(d) for d in run_dirs])) / COMPARE_NAME
