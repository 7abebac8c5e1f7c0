"""Policy filtration (PF-PPO, Zhang et al. 2024; verl's `use_pf_ppo`): train on a batch drawn
again from the scored batch, with replacement, in proportion to a weight of each sample's
reward, so that the samples whose rewards are the most reliable — in the paper, the best and
the worst — are trained on more and the middling ones less or not at all.

The weights, over the batch's rewards s (verl's `reweight_method`):

    pow         |s|^p                         (`pf_ppo_weight_pow` p)
    max_min     1 for the batch's highest and lowest reward, 0 else
    max_random  0.4 for the highest, 0.1 else

each plus 1e-8 (verl's): a weight of 0 leaves a row that tiny chance, and a batch whose
weights are all 0 is drawn uniformly. The draw takes
as many rows as the batch holds, seeded by `seed` and the batch's own ids and rewards: a replay
of the stage draws the same rows, another batch other rows.
"""

from __future__ import annotations

import hashlib

import numpy as np

WEIGHT_FLOOR = 1e-8  # verl's: every row keeps a chance


def filtration_weights(rewards: np.ndarray, method: str, power: float) -> np.ndarray:
    """The unnormalized draw weight of each row (the module's table)."""
    rewards = np.asarray(rewards, dtype=np.float64)
    if method == "pow":
        weights = np.abs(rewards) ** power
    elif method == "max_min":
        weights = ((rewards == rewards.max()) | (rewards == rewards.min())).astype(np.float64) if rewards.size else rewards
    elif method == "max_random":
        weights = np.where(rewards == rewards.max(), 0.4, 0.1) if rewards.size else rewards
    else:
        raise ValueError(f"unknown policy filtration {method!r}")
    return np.maximum(weights + WEIGHT_FLOOR, WEIGHT_FLOOR)


def filtered_rows(ids: list[str], rewards: np.ndarray, *, method: str, power: float, seed: int) -> np.ndarray:
    """Row indices of the filtered batch: len(rewards) draws with replacement in proportion to
    `filtration_weights`, in ascending order (a prompt's rows stay together, so its prompt
    still runs once for them in the update)."""
    weights = filtration_weights(rewards, method, power)
    if weights.size == 0:
        return np.zeros(0, dtype=np.int64)
    rng = np.random.default_rng([seed, *batch_entropy(ids, rewards)])
    return np.sort(rng.choice(len(weights), size=len(weights), replace=True, p=weights / weights.sum()))


def batch_entropy(ids: list[str], rewards: np.ndarray) -> list[int]:
    """Four 32-bit words of the batch's ids and rewards (sha256): the draw's seed beside `seed`."""
    digest = hashlib.sha256()
    for key in ids:
        digest.update(str(key).encode())
        digest.update(b"\0")
    digest.update(np.asarray(rewards, dtype=np.float64).tobytes())
    return [int.from_bytes(digest.digest()[i : i + 4], "little") for i in range(0, 16, 4)]
