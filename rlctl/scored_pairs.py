"""Preference pairs from scored rollouts: each prompt's best and worst sample, in the tokens the
policy sampled them in.

`rlctl dpo --data RUN/iter-N/score` (or `kto`) trains on the policy's own samples ranked by the
reward (online or iterative DPO: OpenRLHF's iterative DPO, TRL's OnlineDPOTrainer in rounds),
so rollout → score → dpo, repeated, is that loop out of the stage commands. No text is
re-tokenized: a pair's prompt and responses are the rollout's token ids, and a tool's tokens
(`loss_mask` False) stay context, as in the RL update.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from rlctl.errors import InputError

SCORED_COLUMNS = ("id", "reward", "prompt_ids", "response_ids")


def is_scored(table: pa.Table) -> bool:
    """Whether `table` is scored rollouts (the scores schema) rather than written pairs."""
    names = set(table.column_names)
    return set(SCORED_COLUMNS) <= names and "chosen" not in names and "rejected" not in names


@dataclass(frozen=True)
class ScoredPair:
    """One prompt's best and worst sample: token ids, and which response tokens are the policy's."""

    id: str
    prompt_ids: list[int]
    chosen: tuple[list[int], list[bool]]
    rejected: tuple[list[int], list[bool]]
    chosen_reward: float
    rejected_reward: float


def best_and_worst(table: pa.Table, *, min_gap: float, source: str) -> list[ScoredPair]:
    """For each prompt (rows of one `id`, in the order they first appear) with two or more
    samples, its highest-rewarded sample as chosen and its lowest as rejected (the first of
    equals), where the rewards differ by more than `min_gap`; none at all is an error."""
    ids = table.column("id").cast(pa.string()).to_pylist()
    rewards = table.column("reward").to_pylist()
    prompts = table.column("prompt_ids").to_pylist()
    responses = table.column("response_ids").to_pylist()
    masks = table.column("loss_mask").to_pylist() if "loss_mask" in table.column_names else [None] * len(ids)
    groups: dict[str, list[int]] = {}
    for row, prompt_id in enumerate(ids):
        groups.setdefault(prompt_id, []).append(row)

    def side(row: int) -> tuple[list[int], list[bool]]:
        return responses[row], masks[row] if masks[row] is not None else [True] * len(responses[row])

    pairs = []
    for prompt_id, rows in groups.items():
        best = max(rows, key=lambda r: rewards[r])
        worst = min(rows, key=lambda r: rewards[r])
        if len(rows) > 1 and rewards[best] - rewards[worst] > min_gap:
            pairs.append(ScoredPair(prompt_id, prompts[best], side(best), side(worst), rewards[best], rewards[worst]))
    if not pairs:
        raise InputError(
            f"{source}: no prompt's samples differ in reward by more than {min_gap:g}: scored rollouts make pairs of a prompt's best and worst sample "
            "(roll out more samples a prompt, or lower min_reward_gap)"
        )
    return pairs
