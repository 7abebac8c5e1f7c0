"""The seed article's training script, written against rlctl's Python API.

    python examples/seed/train_ppo.py            # prints "Step i, Reward: x, KL: y" per step

Reads config.toml (the article's train / model / rl / system sections), maps it onto rlctl's
config sections, and steps a Pipeline, passing the reward function as a Python callable.
"""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from rlctl import Pipeline

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from reward import reward_fn  # noqa: E402


def rlctl_config(seed_cfg: dict) -> dict:
    """The article's sections → rlctl's sections (everything else keeps rlctl's defaults)."""
    train, model, rl, system = (seed_cfg[k] for k in ("train", "model", "rl", "system"))
    return {
        "model": {"path": model["path"], "init_preset": model["name"], "ref": "policy", "critic": "policy", "device": system["device"], "init_seed": system["seed"]},
        "data": {"prompts": str(HERE / "prompts.jsonl"), "batch_size": train["batch_size"]},
        "rollout": {"n": train["samples_per_prompt"], "max_new_tokens": train["max_new_tokens"], "seed": system["seed"]},
        "advantage": {"estimator": "gae", "gamma": rl["gamma"], "lam": rl["lam"], "kl_coef": rl["kl_coef"], "kl_estimator": "k3"},
        "update": {
            "lr": train["learning_rate"], "critic_lr": 2 * train["learning_rate"], "epochs": train["ppo_epochs"],
            "mini_batch_size": train["mini_batch_size"], "micro_batch_size": train["batch_size"] * train["samples_per_prompt"],
            "clip_ratio_low": rl["clip_ratio"], "clip_ratio_high": rl["clip_ratio"], "vf_coef": rl["value_coef"], "seed": system["seed"],
        },
        "pipeline": {"iterations": train["num_iterations"], "run_dir": system["run_dir"], "seed": system["seed"]},
    }


def main() -> None:
    seed_cfg = tomllib.loads((HERE / "config.toml").read_text())
    overrides = sys.argv[1:]  # e.g. pipeline.iterations=3
    pipeline = Pipeline.from_config(rlctl_config(seed_cfg), overrides, reward_fn=reward_fn)
    total = pipeline.cfg.pipeline.iterations
    while pipeline.iteration < total:
        metrics = pipeline.step(total=total)
        print(f"Step {metrics['iteration']}, Reward: {metrics['reward_mean']:.4f}, KL: {metrics['kl_divergence']:.4f}", flush=True)


if __name__ == "__main__":
    main()
