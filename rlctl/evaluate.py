"""`rlctl eval`: how good a model is on held-out prompts — n samples per prompt, scored by a
reward, summarized per `data_source`: the mean reward (mean@n), the mean of each prompt's
best (best@n), pass@k for k = 1, 2, 4, ... n, the unbiased estimate (Chen et al. 2021)
of the chance that at least one of k samples passes (reward ≥ the pass threshold), and where
the samples' answers are known, maj@n: the reward of each prompt's most common answer
(self-consistency, Wang et al. 2022; verl's maj@N). With a `PromptFilter` it also keeps the
prompts whose pass rate lies in a range: the offline difficulty filtering done before RL
(Skywork-OR1, POLARIS, DAPO's data: prompts the model always or never solves teach GRPO nothing)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from math import comb

import numpy as np
import pyarrow as pa

from rlctl.config import Config
from rlctl.errors import InputError
from rlctl.manifest import Manifest


def pass_at_k(n: int, passed: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k): the chance that k of the n samples, drawn without
    replacement, hold at least one of the c that passed."""
    if n - passed < k:
        return 1.0
    return 1.0 - comb(n - passed, k) / comb(n, k)


def ks_up_to(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
    return ks if ks[-1] == n else [*ks, n]


@dataclass(frozen=True)
class EvalRow:
    source: str  # a data_source, or "all"
    prompts: int
    samples: int  # per prompt
    mean: float  # mean@n: the mean reward over every sample
    best: float  # best@n: the mean over prompts of their best sample's reward
    pass_at: dict[int, float]  # k → the mean over prompts of pass@k
    majority: float | None = None  # maj@n: the mean over prompts of their most common answer's reward; None: no answers known


@dataclass(frozen=True)
class Answers:
    """Each sample's answer (None: it gave none) and when two answers are the same one."""

    values: list[str | None]
    same: Callable[[str, str], bool]


def majority_reward(answers: list[str | None], rewards: np.ndarray, same: Callable[[str, str], bool]) -> float:
    """The reward of the first sample whose answer is the most common among the samples that
    gave one (answers that are `same` count as one; a tie goes to the answer given first); a
    prompt whose samples gave none scores as its first sample."""
    classes: list[list[int]] = []
    for i, answer in enumerate(answers):
        if answer is None:
            continue
        home = next((members for members in classes if same(answers[members[0]], answer)), None)
        if home is None:
            classes.append([i])
        else:
            home.append(i)
    if not classes:
        return float(rewards[0])
    winner = max(classes, key=len)  # max keeps the first of equal lengths
    return float(rewards[winner[0]])


def sample_columns(scored: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """The rows' prompt ids (as text) and rewards, as arrays."""
    return np.asarray(scored.column("id").to_pylist(), dtype=object).astype(str), np.asarray(scored.column("reward").to_pylist(), dtype=np.float64)


def majority_mean(ids: np.ndarray, rewards: np.ndarray, answers: Answers, rows: np.ndarray) -> float:
    """maj@n over the prompts of `rows` (indices into the rows `ids`, `rewards` and `answers`
    describe, whole prompts): the mean over them of `majority_reward`."""
    ids, rewards = ids[rows], rewards[rows]
    values = [answers.values[i] for i in rows]
    groups = [np.flatnonzero(ids == key) for key in dict.fromkeys(ids)]
    return float(np.mean([majority_reward([values[i] for i in group], rewards[group], answers.same) for group in groups]))


def evaluation(scored: pa.Table, *, threshold: float, answers: Answers | None = None) -> list[EvalRow]:
    """One row over every prompt ("all"), then one per data_source (where there are several);
    with `answers` (one per row of `scored`) each row's maj@n too."""
    ids, rewards = sample_columns(scored)
    sources = np.asarray(
        [s or "unknown" for s in scored.column("data_source").to_pylist()] if "data_source" in scored.column_names else ["all"] * len(ids), dtype=object,
    )
    groups = {key: np.flatnonzero(ids == key) for key in dict.fromkeys(ids)}
    n = min(len(rows) for rows in groups.values())
    parts = {"all": list(groups)}
    names = sorted(set(sources))
    if len(names) > 1:
        for name in names:
            parts[name] = [key for key, rows in groups.items() if sources[rows[0]] == name]
    out = []
    for name, keys in parts.items():
        per_prompt = [rewards[groups[key]] for key in keys]
        out.append(EvalRow(
            source=name, prompts=len(keys), samples=n, mean=float(np.mean(np.concatenate(per_prompt))),
            best=float(np.mean([r.max() for r in per_prompt])),
            pass_at={k: float(np.mean([pass_at_k(len(r), int((r >= threshold).sum()), k) for r in per_prompt])) for k in ks_up_to(n)},
            majority=None if answers is None else majority_mean(ids, rewards, answers, np.concatenate([groups[key] for key in keys])),
        ))
    return out


def known_answers(scored: pa.Table, reward_spec: str) -> Answers | None:
    """The samples' answers: what the reward reported as `pred` (verl's convention: a column
    `reward/pred`), else what a built-in answer reward reads from the response (`gsm8k`,
    `gsm8k_flexible`: the number, as text; `math`: the last box, the same answer as `math`
    judges one; `qa_em`, `qa_f1`: the answer, normalized; `mcq`: the option letter); None for
    any other reward."""
    from rlctl.math_answers import last_boxed, same_answer
    from rlctl.rewards import (
        gsm8k_answer,
        gsm8k_flexible_answer,
        mcq_answer,
        normalize_answer,
        qa_answer,
    )

    if "reward/pred" in scored.column_names:
        return Answers([None if v is None else str(v) for v in scored.column("reward/pred").to_pylist()], str.__eq__)
    extract, same = {
        "builtin:gsm8k": (gsm8k_answer, str.__eq__), "builtin:gsm8k_flexible": (gsm8k_flexible_answer, str.__eq__),
        "builtin:math": (last_boxed, same_answer), "builtin:mcq": (mcq_answer, str.__eq__),
        **dict.fromkeys(("builtin:qa_em", "builtin:qa_f1"), (lambda response: normalize_answer(qa_answer(response)) or None, str.__eq__)),
    }.get(reward_spec, (None, None))
    if extract is None:
        return None
    return Answers([extract(response) for response in scored.column("response").to_pylist()], same)


def as_metrics(rows: list[EvalRow]) -> dict[str, float]:
    """The rows as flat metrics (`eval/mean@8`, `eval/pass@1/SOURCE`, ...) for a manifest."""
    metrics: dict[str, float] = {}
    for row in rows:
        suffix = "" if row.source == "all" else f"/{row.source}"
        metrics[f"eval/mean@{row.samples}{suffix}"] = row.mean
        metrics[f"eval/best@{row.samples}{suffix}"] = row.best
        metrics.update({f"eval/pass@{k}{suffix}": value for k, value in row.pass_at.items()})
        if row.majority is not None:
            metrics[f"eval/maj@{row.samples}{suffix}"] = row.majority
    return metrics


@dataclass(frozen=True)
class PromptFilter:
    """`rlctl eval --keep-prompts OUT --min-pass-rate LO --max-pass-rate HI`."""

    out: object  # an OutputSpec: where the kept prompts are committed
    low: float = 0.0
    high: float = 1.0


def kept_prompts(prompts: pa.Table, rates: dict[str, float], low: float, high: float) -> tuple[pa.Table, dict[str, int]]:
    """The rows of `prompts` whose pass rate lies in [low, high], as they are (every column), and
    the counts: kept, over (above high: solved too often), under (below low), unscored."""
    ids = [str(i) for i in prompts.column("id").to_pylist()]
    keep = [id_ in rates and low <= rates[id_] <= high for id_ in ids]
    counts = {
        "kept": sum(keep), "over": sum(1 for id_ in ids if rates.get(id_, -1.0) > high), "under": sum(1 for id_ in ids if id_ in rates and rates[id_] < low),
        "unscored": sum(1 for id_ in ids if id_ not in rates),
    }
    return prompts.filter(pa.array(keep, pa.bool_())), counts


def run(*, model: str, prompts: str, cfg: Config, threshold: float, device: str = "auto", out=None, keep: PromptFilter | None = None) -> tuple[list[EvalRow], Manifest | None]:
    """Generate `cfg.rollout.n` samples per prompt with `model` (the rollout settings: engine,
    temperature, stop strings, tool), score them with `cfg.score`'s reward, summarize; with
    `out` (an OutputSpec) commit the scored rows, the summary in their manifest's metrics; with
    `keep`, commit the prompts whose pass rate (samples with reward ≥ `threshold`, the reward
    as given, before score's shaping) lies in its range."""
    from rlctl.backends.base import ROLLOUT_BACKENDS
    from rlctl.backends.hf import check_model_dir, read_trainer_step
    from rlctl.dtypes import compute_dtype, models_device
    from rlctl.lineage import make_manifest, model_ref, shards_ref
    from rlctl.rewards import load_rewards
    from rlctl.shards import read, write
    from rlctl.stages.rollout import rollout_table, stage_config
    from rlctl.stages.score import ScoringModels, score_table
    from rlctl.tool_turns import check_tool

    rollout = replace(cfg.rollout, dtype=compute_dtype(cfg.rollout.dtype, models_device(device, cfg.workers)), greedy_baseline=False)
    check_tool(rollout.tool, rollout.stop)
    source = read(prompts, "prompts")
    check_model_dir(model)
    reward = load_rewards(cfg.score, device=device)
    engine = ROLLOUT_BACKENDS.get(rollout.backend)(model, device, rollout, cfg.vllm)
    try:
        generated = rollout_table(source.table, engine, rollout, cfg.data, policy_version=read_trainer_step(model))
    finally:
        if hasattr(engine, "close"):
            engine.close()
    scored = score_table(generated, reward, ScoringModels(), cfg.score)
    rows = evaluation(scored, threshold=threshold, answers=known_answers(scored, reward.spec))
    config = {**stage_config(rollout, cfg.data, cfg.vllm), "reward": reward.spec, "pass_threshold": threshold}
    inputs = [shards_ref(source), model_ref(model)]
    if keep is not None:
        from rlctl.prompt_stream import pass_rates

        kept, counts = kept_prompts(source.table, pass_rates([scored], threshold), keep.low, keep.high)
        if not kept.num_rows:
            raise InputError(f"--keep-prompts: no prompt's pass rate lies in [{keep.low:g}, {keep.high:g}] ({counts['over']} above, {counts['under']} below): nothing to keep")
        manifest = make_manifest("prompt-filter", {**config, "min_pass_rate": keep.low, "max_pass_rate": keep.high}, inputs, seed=rollout.seed)
        manifest.metrics = {f"prompts/{name}": value for name, value in counts.items()}
        write(kept, keep.out.uri, manifest, schema="prompts", format=keep.out.format, rows_per_part=keep.out.rows_per_part)
        print(
            f"rlctl: kept {counts['kept']} of {source.table.num_rows} prompts in {keep.out.uri}: pass rate in [{keep.low:g}, {keep.high:g}] "
            f"({counts['over']} passed more often, {counts['under']} less" + (f", {counts['unscored']} not sampled" if counts["unscored"] else "") + ")",
            file=sys.stderr, flush=True,
        )
    if out is None:
        return rows, None
    manifest = make_manifest("eval", config, inputs, seed=rollout.seed)
    manifest.metrics = as_metrics(rows)
    return rows, write(scored, out.uri, manifest, schema="scores", format=out.format, rows_per_part=out.rows_per_part)
