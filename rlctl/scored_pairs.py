"""Scored rollouts as training data, in the tokens the policy sampled them in: preference pairs
(each prompt's best and worst sample) and demonstrations (its best samples over a reward bar).

`rlctl dpo --data RUN/iter-N/score` (or `kto`) trains on the policy's own samples ranked by the
reward (online or iterative DPO: OpenRLHF's iterative DPO, TRL's OnlineDPOTrainer in rounds),
so rollout → score → dpo, repeated, is that loop out of the stage commands. No text is
re-tokenized: a pair's prompt and responses are the rollout's token ids, and a tool's tokens
(`loss_mask` False) stay context, as in the RL update. `rlctl sft --data RUN/iter-N/score`
keeps each prompt's best samples at or above a reward (rejection-sampling fine-tuning: RAFT's
best of n, ReST-EM's every correct sample); `rlctl reward-model` reads the pairs' text, as `rm:`
scoring reads text.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from rlctl.algos.preference import ranked_pairs
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
    rows: tuple[int, int]  # the chosen and the rejected sample's rows in the table


@dataclass(frozen=True)
class ScoredSample:
    """A kept sample: its prompt's id, token ids, and which response tokens are the policy's."""

    id: str
    prompt_ids: list[int]
    response: tuple[list[int], list[bool]]
    reward: float


def _groups(table: pa.Table) -> dict[str, list[int]]:
    """The rows of each prompt (`id`), prompts in the order they first appear."""
    groups: dict[str, list[int]] = {}
    for row, prompt_id in enumerate(table.column("id").cast(pa.string()).to_pylist()):
        groups.setdefault(prompt_id, []).append(row)
    return groups


def _responses(table: pa.Table) -> list[tuple[list[int], list[bool]]]:
    """Each row's response ids with its trained-token mask (a tool's tokens: False)."""
    responses = table.column("response_ids").to_pylist()
    masks = table.column("loss_mask").to_pylist() if "loss_mask" in table.column_names else [None] * len(responses)
    return [(ids, mask if mask is not None else [True] * len(ids)) for ids, mask in zip(responses, masks)]


def best_samples(table: pa.Table, *, min_reward: float, per_prompt: int, source: str) -> list[ScoredSample]:
    """Each prompt's samples rewarded at least `min_reward`, best first (the first of equals),
    at most `per_prompt` of them (0: all); none at all is an error."""
    rewards, prompts, responses = table.column("reward").to_pylist(), table.column("prompt_ids").to_pylist(), _responses(table)
    kept = []
    for prompt_id, rows in _groups(table).items():
        good = sorted((r for r in rows if rewards[r] >= min_reward), key=lambda r: -rewards[r])
        kept += [ScoredSample(prompt_id, prompts[r], responses[r], rewards[r]) for r in (good[:per_prompt] if per_prompt else good)]
    if not kept:
        raise InputError(f"{source}: no sample is rewarded {min_reward:g} or more: scored rollouts keep each prompt's best samples at or above sft.min_reward")
    return kept


def best_and_worst(table: pa.Table, *, min_gap: float, source: str, which: str = "best_worst") -> list[ScoredPair]:
    """For each prompt (rows of one `id`, in the order they first appear) with two or more
    samples, its highest-rewarded sample as chosen and its lowest as rejected (the first of
    equals), where the rewards differ by more than `min_gap`; with `which = "all"` every two of
    its samples whose rewards differ by more than `min_gap`, the better one chosen (in row
    order). None at all is an error."""
    rewards, prompts, responses = table.column("reward").to_pylist(), table.column("prompt_ids").to_pylist(), _responses(table)
    pairs = []
    for prompt_id, rows in _groups(table).items():
        pairs += [ScoredPair(prompt_id, prompts[a], responses[a], responses[b], rewards[a], rewards[b], (a, b)) for a, b in ranked_pairs(rows, rewards, which, min_gap)]
    if not pairs:
        raise InputError(
            f"{source}: no prompt's samples differ in reward by more than {min_gap:g}: scored rollouts make pairs of a prompt's best and worst sample "
            "(roll out more samples a prompt, or lower min_reward_gap)"
        )
    return pairs


def as_text_pairs(table: pa.Table, *, min_gap: float, source: str) -> pa.Table:
    """The best-and-worst pairs as written preference pairs (`id`, the prompt columns and
    `data_source` of the prompt, `chosen` and `rejected` the two responses' text): for a reader
    of text, the reward model, which scores what `rm:` reads rather than sampled tokens."""
    pairs = best_and_worst(table, min_gap=min_gap, source=source)
    keep = [c for c in ("id", "prompt", "messages", "data_source") if c in table.column_names]
    chosen = table.take(pa.array([pair.rows[0] for pair in pairs], pa.int64()))
    rejected = table.take(pa.array([pair.rows[1] for pair in pairs], pa.int64()))
    return chosen.select(keep).append_column("chosen", chosen.column("response")).append_column("rejected", rejected.column("response"))
