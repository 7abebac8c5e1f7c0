"""DAPO's dynamic sampling: keep the prompt groups whose rewards differ, until the batch is full.

A group (the n samples of one prompt) whose rewards are all equal has no advantage under
group-relative estimators: it trains nothing and only dilutes the batch. The pipeline scores
rounds of prompts until `batch_prompts` groups with differing rewards are kept (or its round
cap is reached); this module decides, from the rounds' rewards alone, which rows make the
batch. When the cap leaves the batch short, it is filled with dropped groups in order, so the
batch keeps its shape (mini-batch sizes still divide it) and the filling carries no signal.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class GroupSelection:
    rows: list[tuple[int, int]]  # (round, row within the round), in batch order
    kept: int  # groups with differing rewards in the batch
    dropped: int  # groups seen with all-equal rewards
    filled: int  # dropped groups taken back to fill the batch


def groups_with_signal(rewards: list[float], n: int) -> list[bool]:
    """For each group of `n` adjacent rows: do its rewards differ?"""
    if len(rewards) % n:
        raise ValueError(f"{len(rewards)} rewards do not make groups of {n}")
    groups = np.asarray(rewards, dtype=np.float64).reshape(-1, n)
    return [bool(g.max() > g.min()) for g in groups]


def enough(rounds: list[list[float]], n: int, batch_prompts: int) -> bool:
    """Have the rounds scored so far kept a full batch?"""
    return sum(sum(groups_with_signal(r, n)) for r in rounds) >= batch_prompts


def select_groups(rounds: list[list[float]], n: int, batch_prompts: int) -> GroupSelection:
    """The rows of the batch: the first `batch_prompts` groups with signal, round by round and
    in row order within a round; short of that, dropped groups (same order) fill it."""
    kept: list[tuple[int, int]] = []
    dropped: list[tuple[int, int]] = []
    for r, rewards in enumerate(rounds):
        for g, signal in enumerate(groups_with_signal(rewards, n)):
            (kept if signal else dropped).append((r, g))
    chosen = kept[:batch_prompts]
    filling = dropped[: max(batch_prompts - len(chosen), 0)]
    in_order = sorted(chosen + filling)  # round, then position: the order the rows were generated
    rows = [(r, g * n + s) for r, g in in_order for s in range(n)]
    return GroupSelection(rows, kept=len(chosen), dropped=len(dropped), filled=len(filling))
