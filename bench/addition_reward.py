"""The reward of bench/trl_bench.py, in TRL's calling form, so that TRL and rlctl call the very
same function: 1 for the right sum first in the completion, else a tenth of the share of digit
characters (a random model earns a little, so advantages are not all zero)."""

from __future__ import annotations

import re


def addition_reward(prompts, completions, ground_truth, **kwargs) -> list[float]:
    rewards = []
    for completion, truth in zip(completions, ground_truth):
        number = re.search(r"-?\d+", completion)
        if number and number.group() == str(truth):
            rewards.append(1.0)
        else:
            digits = sum(ch.isdigit() for ch in completion)
            rewards.append(0.1 * digits / max(len(completion), 1))
    return rewards
