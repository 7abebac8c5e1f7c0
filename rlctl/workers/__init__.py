"""Who holds the models: `LocalWorkers` (this process) or `RayWorkers` (a Ray worker group).

Both offer the same methods (engine, policy, ref, critic, trainer, hand_over_weights,
weights_digest, critic_digest, save, close); `make_workers` picks one from `[workers]`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from rlctl.config import Config, ModelConfig, RolloutConfig, UpdateConfig, VLLMConfig, WorkersConfig


def held_reward_models(score, workers: WorkersConfig) -> dict[str, dict]:
    """The `rm:` folders of a ScoreConfig that a Ray group's ranks hold, each a replica scoring
    its rank's share of the samples ({folder: {"batch_size", "dtype"}}); none for local workers,
    where a reward model loads in this process."""
    from rlctl.rewards import reward_model_folders

    if workers.backend != "ray":
        return {}
    return {folder: {"batch_size": score.batch_size, "dtype": score.dtype} for folder in reward_model_folders(score)}


def make_workers(cfg: Config, *, policy_source: str, critic_source: str | None, log_dir: Path | None = None, scorers: dict[str, dict] | None = None):
    """The pipeline's workers; a Ray group copies Ray's logs into `log_dir` when it stops, and
    holds the `rm:` reward models of `scorers` ({folder: {"batch_size", "dtype"}}) on its ranks."""
    if cfg.workers.backend == "ray":
        from rlctl.workers.ray import RayWorkers

        return RayWorkers(cfg, policy_source=policy_source, critic_source=critic_source, log_dir=log_dir, scorers=scorers)
    from rlctl.workers.local import LocalWorkers

    return LocalWorkers(cfg, policy_source=policy_source, critic_source=critic_source)


@contextmanager
def worker_group(
    workers: WorkersConfig, *, policy: str | None = None, ref: str | None = None, critic: str | None = None,
    update: UpdateConfig | None = None, temperature: float = 1.0, device: str = "auto",
    rollout: RolloutConfig | None = None, engine: VLLMConfig = VLLMConfig(), scorers: dict[str, dict] | None = None,
) -> Iterator:
    """The workers `workers` names, holding just these models, stopped when the block ends.
    A Ray group trains only when `update` is given; otherwise it generates and scores, and its
    ranks hold the `rm:` reward models of `scorers` (as make_workers). Local workers always
    hold a trainer (they need a policy). `rollout` (with `engine`) picks the rollout engine;
    without it the policy generates with the HF engine at `temperature`."""
    cfg = Config(
        model=ModelConfig(path=policy or "", ref=ref or "", critic=critic or "", device=device),
        rollout=rollout or RolloutConfig(temperature=temperature), workers=workers, update=update or UpdateConfig(), vllm=engine,
    )
    with ExitStack() as stack:  # on the way out: the group stops, then the thread count is given back
        if workers.backend == "ray":
            from rlctl.workers.ray import RayWorkers

            group = RayWorkers(cfg, policy_source=policy, critic_source=critic, train=update is not None, temperature=cfg.rollout.temperature, scorers=scorers)
        else:
            from rlctl.threads import ThreadGovernor
            from rlctl.workers.local import LocalWorkers

            stack.callback(ThreadGovernor(workers.threads).restore)  # the count a pipeline's stage would run at
            group = LocalWorkers(cfg, policy_source=policy, critic_source=critic)
        stack.callback(group.close)
        yield group
