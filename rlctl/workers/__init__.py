"""Who holds the models: `LocalWorkers` (this process) or `RayWorkers` (a Ray worker group).

Both offer the same methods (engine, policy, ref, critic, trainer, hand_over_weights,
weights_digest, critic_digest, save, close); `make_workers` picks one from `[workers]`.
"""

from __future__ import annotations

from rlctl.config import Config


def make_workers(cfg: Config, *, policy_source: str, critic_source: str | None):
    if cfg.workers.backend == "ray":
        from rlctl.workers.ray import RayWorkers

        return RayWorkers(cfg, policy_source=policy_source, critic_source=critic_source)
    from rlctl.workers.local import LocalWorkers

    return LocalWorkers(cfg, policy_source=policy_source, critic_source=critic_source)
