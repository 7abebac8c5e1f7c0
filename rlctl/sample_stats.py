"""What a batch of samples looks like beyond its mean reward: how long prompts and responses
are, how many responses the length limit cut off, and how many prompt groups gave all their
samples the same reward (group-relative estimators learn nothing from those). Names follow
verl's (`response_length/clip_ratio`) and TRL's ideas (its `frac_reward_zero_std`) where they
have one; the pipeline's metrics row and the rollout and score manifests carry them."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from rlctl.tensors import list_lengths

EQUAL_REWARD_TOLERANCE = 1e-6  # rewards this close count as equal: the group's std is ~0


REPEAT_NGRAM = 4  # response_repetition counts repeated token 4-grams


def repeated_ngrams(ids: np.ndarray, n: int = REPEAT_NGRAM) -> tuple[int, int]:
    """(n-grams that repeat an earlier one of the same response, n-grams) of one response's
    token ids: a loop ("the cat the cat the cat") repeats nearly all of its n-grams."""
    count = len(ids) - n + 1
    if count <= 0:
        return 0, 0
    ids = np.asarray(ids, dtype=np.uint64)
    keys = np.zeros(count, dtype=np.uint64)  # each n-gram as one 64-bit key (wrapping arithmetic: collisions ~count²/2⁶⁴)
    for k in range(n):
        keys = keys * np.uint64(1_000_003) ^ ids[k : k + count]
    return count - len(np.unique(keys)), count


def rollout_stats(rollouts: pa.Table) -> dict[str, float | None]:
    """Response and prompt lengths in tokens, the share of responses that ended at the length
    limit (`finish_reason == "length"`) rather than at a stop token or string, the share of the
    responses' token 4-grams that repeat an earlier one of the same response
    (`response_repetition`: a policy looping on itself), and with a tool (rollout.tool) its
    calls per response (`tool_calls`)."""
    return merged_rollout_stats([rollout_tally(rollouts)])


def rollout_tally(rollouts: pa.Table) -> dict[str, int]:
    """The counts, sums and extremes `rollout_stats` is made of, so that rows spread over
    several writers (a worker group's ranks, each writing its own part) give the statistics
    of all of them without the rows travelling: `merged_rollout_stats` of their tallies."""
    if rollouts.num_rows == 0:
        return {"rows": 0}
    responses = list_lengths(rollouts.column("response_ids"))
    prompts = list_lengths(rollouts.column("prompt_ids"))
    cut = np.asarray(rollouts.column("finish_reason").to_pylist(), dtype=object) == "length"
    repeats = [repeated_ngrams(ids) for ids in rollouts.column("response_ids").to_numpy(zero_copy_only=False)]
    tally = {
        "rows": rollouts.num_rows,
        "response_tokens": int(responses.sum()), "response_max": int(responses.max()), "response_min": int(responses.min()),
        "cut": int(cut.sum()),
        "prompt_tokens": int(prompts.sum()), "prompt_max": int(prompts.max()),
        "repeated_ngrams": sum(r for r, _ in repeats), "ngrams": sum(c for _, c in repeats),
    }
    if "tool_calls" in rollouts.column_names:  # rollout.tool
        tally["tool_calls"] = int(np.asarray(rollouts.column("tool_calls").to_numpy(zero_copy_only=False)).sum())
    return tally


def merged_rollout_stats(tallies: list[dict[str, int]]) -> dict[str, float | None]:
    """`rollout_stats` of the rows that `tallies` (from `rollout_tally`) counted together."""
    tallies = [tally for tally in tallies if tally["rows"]]
    if not tallies:
        return {}
    rows = sum(tally["rows"] for tally in tallies)
    calls = {"tool_calls": sum(tally["tool_calls"] for tally in tallies) / rows} if all("tool_calls" in tally for tally in tallies) else {}
    ngrams = sum(tally.get("ngrams", 0) for tally in tallies)
    return {
        **calls,
        "response_repetition": sum(tally.get("repeated_ngrams", 0) for tally in tallies) / ngrams if ngrams else None,
        "response_length": sum(tally["response_tokens"] for tally in tallies) / rows,
        "response_length/max": float(max(tally["response_max"] for tally in tallies)),
        "response_length/min": float(min(tally["response_min"] for tally in tallies)),
        "response_length/clip_ratio": sum(tally["cut"] for tally in tallies) / rows,
        "prompt_length": sum(tally["prompt_tokens"] for tally in tallies) / rows,
        "prompt_length/max": float(max(tally["prompt_max"] for tally in tallies)),
    }


def reward_stats(scores: pa.Table) -> dict[str, float | None]:
    """The rewards' range, and `groups/equal_rewards`: the share of prompt groups (rows of one
    `id`, two or more of them) whose samples all got the same reward. None where no group has
    two samples (rollout.n = 1): there is nothing to compare then."""
    if scores.num_rows == 0:
        return {}
    rewards = np.asarray(scores.column("reward").to_pylist(), dtype=np.float64)
    stats = {"reward_max": float(rewards.max()), "reward_min": float(rewards.min()), "groups/equal_rewards": equal_reward_share(scores)}
    if "response_ids" in scores.column_names:  # a reward that favours length (a reward model's length bias) shows here
        stats["reward_length_corr"] = correlation(rewards, np.asarray(list_lengths(scores.column("response_ids")), dtype=np.float64))
    if "baseline_reward" in scores.column_names:  # the greedy responses' reward (ReMax's baselines), a row's its prompt's
        stats["baseline_reward_mean"] = float(np.mean(scores.column("baseline_reward").to_numpy()))
    return stats


def correlation(a: np.ndarray, b: np.ndarray) -> float | None:
    """Pearson's correlation of two samples; None where either is constant."""
    if len(a) < 2 or a.std() == 0 or b.std() == 0:
        return None
    return float(np.corrcoef(a, b)[0, 1])


def equal_reward_share(scores: pa.Table) -> float | None:
    if "id" not in scores.column_names:
        return None
    highest, lowest, sizes = group_extremes(scores)
    compared = sizes > 1
    if not compared.any():
        return None
    return float((highest[compared] - lowest[compared] <= EQUAL_REWARD_TOLERANCE).mean())


def group_extremes(scores: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each prompt group's (rows of one `id`) highest and lowest reward and its size, groups
    in the order of their ids."""
    rewards = np.asarray(scores.column("reward").to_pylist(), dtype=np.float64)
    ids = np.asarray(scores.column("id").to_pylist(), dtype=object).astype(str)
    _, group, sizes = np.unique(ids, return_inverse=True, return_counts=True)
    highest, lowest = np.full(len(sizes), -np.inf), np.full(len(sizes), np.inf)
    np.maximum.at(highest, group, rewards)
    np.minimum.at(lowest, group, rewards)
    return highest, lowest, sizes


def reward_component_means(scores: pa.Table, prefix: str = "reward_mean/") -> dict[str, float | None]:
    """`reward_mean/NAME` (`prefix` NAME) for every numeric `reward/NAME` column (components,
    reported values, score's shaping terms), over the rows that have one (None: no row has)."""
    means = {}
    for name in scores.column_names:
        column = scores.column(name)
        if name.startswith("reward/") and pa.types.is_floating(column.type):
            values = np.asarray(column.to_pylist(), dtype=np.float64)
            present = values[~np.isnan(values)]
            means[prefix + name.removeprefix("reward/")] = float(present.mean()) if present.size else None
    return means


def source_stats(scores: pa.Table) -> dict[str, float]:
    """On a batch of several `data_source`s, each one's `source/SOURCE/reward_mean`,
    `.../response_length` (mean tokens) and `.../samples`: how each part of a mixed dataset
    trains, which the batch's means hide. Nothing for a batch of one source."""
    if "data_source" not in scores.column_names:
        return {}
    sources = np.asarray([s or "unknown" for s in scores.column("data_source").to_pylist()], dtype=object)
    names = sorted(set(sources))
    if len(names) < 2:
        return {}
    rewards = np.asarray(scores.column("reward").to_pylist(), dtype=np.float64)
    lengths = list_lengths(scores.column("response_ids")) if "response_ids" in scores.column_names else None
    out: dict[str, float] = {}
    for name in names:
        rows = sources == name
        out[f"source/{name}/reward_mean"] = float(rewards[rows].mean())
        if lengths is not None:
            out[f"source/{name}/response_length"] = float(np.asarray(lengths)[rows].mean())
        out[f"source/{name}/samples"] = int(rows.sum())
    return out


def validation_metrics(scored: pa.Table, samples: int, answers=None) -> dict[str, float]:
    """`val/score`: the mean reward over every sample (verl's mean@N), overall and per
    `data_source`; with several samples per prompt also `val/best_of_N`: the mean over prompts
    of their best sample's reward (verl's best@N; pass@N for a 0/1 reward), and with the
    samples' `answers` (rlctl.evaluate.Answers, one per row) `val/maj_of_N`: the mean over
    prompts of their most common answer's reward (verl's maj@N). Each numeric `reward/NAME`
    column gives `val/reward/NAME` (and per source `val/reward/NAME/SOURCE`): the mean of what a
    reward reported (e.g. `acc`) or of a component or shaping term, over the samples that have it."""
    from rlctl.evaluate import majority_mean, sample_columns

    ids, rewards = sample_columns(scored) if answers is not None else (None, None)
    everything = np.arange(scored.num_rows)
    parts = {"": everything}
    if "data_source" in scored.column_names:
        sources = np.asarray([s or "unknown" for s in scored.column("data_source").to_pylist()], dtype=object)
        parts.update({f"/{source}": np.flatnonzero(sources == source) for source in sorted(set(sources))})
    out = {}
    for suffix, rows in parts.items():
        part = scored.take(pa.array(rows))
        out[f"val/score{suffix}"] = float(np.mean(part.column("reward").to_pylist()))
        out.update({f"{name}{suffix}": mean for name, mean in reward_component_means(part, prefix="val/reward/").items() if mean is not None})
        if samples > 1:
            out[f"val/best_of_{samples}{suffix}"] = float(group_extremes(part)[0].mean())
            if answers is not None:
                out[f"val/maj_of_{samples}{suffix}"] = majority_mean(ids, rewards, answers, rows)
    return out
