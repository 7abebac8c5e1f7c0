"""`rlctl plot RUN`: one PNG of reward, KL, entropy, response length and validation score by
iteration, from RUN/metrics.jsonl.

    rlctl plot runs/grpo --out runs/grpo/metrics.png
"""

from __future__ import annotations

from pathlib import Path

from rlctl.runinfo import read_metrics

PANELS = (("reward_mean", "reward (mean)"), ("kl", "KL to reference"), ("entropy", "entropy"), ("response_length", "response length (tokens)"), ("val/score", "validation score"))


def plot_run(run_dir: str, out: str | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    target = Path(out) if out else Path(run_dir) / "metrics.png"
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.2), constrained_layout=True)
    for ax, (key, title) in zip(axes, PANELS):
        points = [(r["iteration"], r[key]) for r in rows if r.get(key) is not None]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", markersize=3)
            if key == "reward_mean" and all("reward_std" in r for r in rows):
                std = [r["reward_std"] for r in rows]
                ax.fill_between(xs, [y - s for y, s in zip(ys, std)], [y + s for y, s in zip(ys, std)], alpha=0.2)
        else:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    fig.suptitle(str(run_dir))
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return str(target)
