"""score: rollouts → scores (a scalar reward; optional ref/old log-probs and critic values).

    rlctl score --rollouts runs/r --out runs/s --reward builtin:gsm8k --ref models/tiny
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace

import pyarrow as pa

from rlctl.config import ScoreConfig, WorkersConfig, to_dict
from rlctl.dtypes import compute_dtype, models_device
from rlctl.errors import InputError
from rlctl.lineage import make_manifest, model_ref, shards_ref, up_to_date
from rlctl.manifest import Manifest
from rlctl.rewards import (
    RewardSamples,
    RewardScores,
    RewardSet,
    length_penalty,
    load_rewards,
    overlong_penalty,
    scoring_model_folders,
)
from rlctl.sample_stats import reward_stats
from rlctl.schemas import spec
from rlctl.shards import OutputSpec, read, write
from rlctl.stages.rollout import sampling_of
from rlctl.tensors import check_token_ids, list_column, set_columns


@dataclass
class ScoringModels:
    """Models score may use; any may be absent. The pipeline keeps these resident."""

    ref: object | None = None  # HFPolicy
    policy: object | None = None  # HFPolicy
    critic: object | None = None  # ValueModel


def run(
    *, rollouts: str, out: OutputSpec, cfg: ScoreConfig, ref: str | None = None, critic: str | None = None,
    policy: str | None = None, device: str = "auto", force: bool = False, workers: WorkersConfig = WorkersConfig(),
) -> Manifest:
    from rlctl.backends.hf import HFPolicy, ValueModel, check_model_dir, resolve_device

    if cfg.sum_pi_squared and not policy:
        raise InputError("score.sum_pi_squared comes from the policy's forward: give --policy")
    cfg = replace(cfg, dtype=compute_dtype(cfg.dtype, models_device(device, workers)))  # "auto" decided, and recorded
    source = read(rollouts, "rollouts")
    model_uris = {"ref": ref, "policy": policy, "critic": critic}
    for uri in model_uris.values():
        if uri:
            check_model_dir(uri)
    from rlctl.workers import held_reward_models

    scorers = held_reward_models(cfg, workers)  # on a Ray group its ranks hold the rm: models, loaded with it
    on_workers = workers.backend == "ray" and (any(model_uris.values()) or bool(scorers))
    reward = None if scorers else load_rewards(cfg, device=device)  # loaded (and checked) here
    inputs = [shards_ref(source)] + [model_ref(u) for u in [*model_uris.values(), *scoring_model_folders(cfg)] if u]
    config = {"score": to_dict(cfg), "models": {k: v or "" for k, v in model_uris.items()}}
    manifest = make_manifest("score", config, inputs)
    if (existing := up_to_date(out.uri, manifest, force)) is not None:
        return existing
    manifest.state = {**manifest.state, "workers": to_dict(workers)}
    if on_workers:
        from rlctl.workers import worker_group

        temperature = float(sampling_of(source.table).get("temperature", 1.0))
        with worker_group(workers, policy=policy, ref=ref, critic=critic, temperature=temperature, scorers=scorers) as group:
            reward = reward or load_rewards(cfg, device=device, reward_models=group.reward_model)
            models = ScoringModels(ref=group.ref, policy=group.policy, critic=group.critic)
            if out.uri != "-":
                return score_parts_on_workers(group, source.table, reward, models, cfg, out, manifest)
            table = score_table(source.table, reward, models, cfg)
        manifest.metrics = reward_stats(table)
        return write(table, out.uri, manifest, schema="scores", format=out.format, rows_per_part=out.rows_per_part)
    models = ScoringModels(
        ref=HFPolicy.load(ref, device) if ref else None,
        policy=HFPolicy.load(policy, device) if policy else None,
        critic=ValueModel.load(critic, resolve_device(device)) if critic else None,
    )
    table = score_table(source.table, reward, models, cfg)
    manifest.metrics = reward_stats(table)
    return write(table, out.uri, manifest, schema="scores", format=out.format, rows_per_part=out.rows_per_part)


def reward_samples(table: pa.Table) -> RewardSamples:
    n = table.num_rows
    names = table.column_names

    def column(name):
        return table.column(name).to_pylist() if name in names else [None] * n

    # the prompt text: the plain prompt, else the chat's last message
    chats = column("messages")
    prompts = [p if p is not None else (c[-1]["content"] if c else "") for p, c in zip(column("prompt"), chats)]
    known = {c.name for c in spec("scores").columns}
    extra_names = [c for c in names if c not in known]
    extras = [dict(zip(extra_names, values)) for values in zip(*(column(c) for c in extra_names))] if extra_names else [{} for _ in range(n)]
    return RewardSamples(prompts, column("response"), column("ground_truth"), column("data_source"), extras, chats)


def score_table(table: pa.Table, reward: RewardSet, models: ScoringModels, cfg: ScoreConfig) -> pa.Table:
    """Rewards for every row, then the per-token columns each available model provides."""
    scores = scored_rewards(table, reward, models, cfg)
    table = with_baseline_reward(with_reward_columns(table, scores), reward, cfg)
    return with_model_columns(table, scores.total, models, cfg)


def with_reward_columns(table: pa.Table, scores: RewardScores) -> pa.Table:
    """The `reward/...` columns: components and reported values (numbers, else text); with
    several rewards, which columns are the total's components and their weights, in the schema's
    metadata (`reward_components`: what advantage.estimator = "gdpo" normalizes one by one)."""
    def array(values: list) -> pa.Array:
        if all(v is None or isinstance(v, (int, float)) for v in values):
            return pa.array(values, pa.float64())
        return pa.array([None if v is None else str(v) for v in values], pa.string())

    table = set_columns(table, {name: array(values) for name, values in scores.columns.items()})
    if not scores.components:
        return table
    return table.replace_schema_metadata({**(table.schema.metadata or {}), COMPONENTS_KEY: json.dumps(scores.components, sort_keys=True).encode()})


COMPONENTS_KEY = b"rlctl.reward_components"


def reward_components(table: pa.Table, source: str = "scores") -> dict[str, float]:
    """The reward components a score stage recorded (column → weight), checked against the
    table: each a number column of it, each weight finite; {} for one reward."""
    raw = (table.schema.metadata or {}).get(COMPONENTS_KEY)
    if not raw:
        return {}
    try:
        components = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise InputError(f"{source}: its reward_components metadata is not JSON: {exc}") from exc
    if not isinstance(components, dict) or not components:
        raise InputError(f"{source}: its reward_components metadata must map reward columns to weights")
    for column, weight in components.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise InputError(f"{source}: reward component {column!r} has the weight {weight!r}, not a finite number")
        if column not in table.column_names or not pa.types.is_floating(table.schema.field(column).type):
            raise InputError(f"{source}: reward component {column!r} is not a number column of the table")
    return {column: float(weight) for column, weight in components.items()}


def reward_column(rewards: list[float]) -> pa.Array:
    """The `reward` column as the scores schema holds it (float32)."""
    return pa.array(rewards, pa.float32())


def scored_rewards(table: pa.Table, reward: RewardSet, models: ScoringModels, cfg: ScoreConfig) -> RewardScores:
    """The rewards of every row (token ids checked against the models' vocabulary first)."""
    if table.num_rows == 0:
        raise InputError("rollouts: no rows to score")
    vocab = next((m.vocab_size for m in (models.ref, models.policy, models.critic) if m is not None), None)
    if vocab is not None:
        check_token_ids(table, vocab, source="rollouts")
    return shaped_rewards(table, reward, cfg)


def with_baseline_reward(table: pa.Table, reward: RewardSet, cfg: ScoreConfig) -> pa.Table:
    """With greedy responses beside the samples (rollout.greedy_baseline), `baseline_reward`:
    each prompt's greedy response scored as its samples are (the same reward, the same
    shaping), once per prompt, on every row of the prompt; without them, `table` as it is."""
    if "baseline_response" not in table.column_names:
        return table
    keys = list(zip(map(str, table.column("id").to_pylist()), table.column("baseline_response").to_pylist()))
    first: dict[tuple[str, str], int] = {}
    for row, key in enumerate(keys):
        first.setdefault(key, row)
    greedy = table.take(pa.array(list(first.values()), pa.int64()))
    greedy = set_columns(greedy, {"response": greedy.column("baseline_response"), "response_ids": greedy.column("baseline_response_ids")})
    scored = dict(zip(first, shaped_rewards(greedy, reward, cfg).total))
    return set_columns(table, {"baseline_reward": pa.array([scored[key] for key in keys], pa.float32())})


def shaped_rewards(table: pa.Table, reward: RewardSet, cfg: ScoreConfig) -> RewardScores:
    """The reward of every row's response, with DAPO's overlong shaping and Kimi k1.5's length
    penalty where they are set (both judge the reward as the reward function gave it)."""
    scores = reward.score(reward_samples(table), timeout=cfg.reward_timeout)
    given = list(scores.total)
    if cfg.overlong_buffer > 0:
        limit = sampling_of(table).get("max_new_tokens")
        if not isinstance(limit, int) or cfg.overlong_buffer >= limit:
            raise InputError(
                f"score.overlong_buffer={cfg.overlong_buffer} needs rollouts that record a max_new_tokens above it "
                f"(these record {limit!r})"
            )
        lengths = [len(ids) for ids in table.column("response_ids").to_pylist()]
        shaping = overlong_penalty(lengths, max_new_tokens=limit, buffer=cfg.overlong_buffer, penalty=cfg.overlong_penalty)
        components = {**scores.components, "reward/overlong_penalty": 1.0} if scores.components else {}
        scores = RewardScores([r + p for r, p in zip(scores.total, shaping)], {**scores.columns, "reward/overlong_penalty": shaping}, components)
    if cfg.length_penalty > 0:
        lengths = [len(ids) for ids in table.column("response_ids").to_pylist()]
        correct = [r >= cfg.length_penalty_pass for r in given]
        shaping = length_penalty([str(i) for i in table.column("id").to_pylist()], lengths, correct, weight=cfg.length_penalty)
        components = {**scores.components, "reward/length_penalty": 1.0} if scores.components else {}
        scores = RewardScores([r + p for r, p in zip(scores.total, shaping)], {**scores.columns, "reward/length_penalty": shaping}, components)
    return scores


def with_model_columns(
    table: pa.Table, rewards: list[float], models: ScoringModels, cfg: ScoreConfig, *, ref_logprobs: list | None = None, values: list | None = None,
) -> pa.Table:
    """`table` with its rewards and the ref/old log-probs and values of the models given
    (`ref_logprobs` and `values` computed elsewhere stand in for a reference and a critic)."""
    temperature = float(sampling_of(table).get("temperature", 1.0))
    prompt_ids = table.column("prompt_ids").to_pylist()
    response_ids = table.column("response_ids").to_pylist()
    new = {"reward": reward_column(rewards)}
    if models.ref is not None:
        ref_logprobs = models.ref.logprobs(prompt_ids, response_ids, temperature=temperature, batch_size=cfg.batch_size, batch_tokens=cfg.batch_tokens, compute_dtype=cfg.dtype)
    if ref_logprobs is not None:
        new["ref_logprobs"] = list_column(ref_logprobs, pa.float32())
    if models.policy is not None:
        old_logprobs, sum_pi_squared = models.policy.logprobs_with_statistic(
            prompt_ids, response_ids, statistic="sum_pi_squared" if cfg.sum_pi_squared else None, temperature=temperature,
            batch_size=cfg.batch_size, batch_tokens=cfg.batch_tokens, compute_dtype=cfg.dtype, as_trained=True,
        )
        new["old_logprobs"] = list_column(old_logprobs, pa.float32())
        if sum_pi_squared is not None:
            new["sum_pi_squared"] = list_column(sum_pi_squared, pa.float32())
    if models.critic is not None:
        pad_id = models.policy.pad_id if models.policy is not None else 0
        values = models.critic.values(prompt_ids, response_ids, pad_id=pad_id, batch_size=cfg.batch_size, batch_tokens=cfg.batch_tokens, compute_dtype=cfg.dtype)
    if values is not None:
        new["values"] = list_column(values, pa.float32())
    return set_columns(table, new)


def score_parts_on_workers(group, table: pa.Table, reward: RewardSet, models: ScoringModels, cfg: ScoreConfig, out: OutputSpec, manifest: Manifest) -> Manifest:
    """Rewards here (the reward's child process is the controller's; an `rm:` model the ranks
    hold scores each rank's share there); each rank adds its slice's model columns and writes
    its own part. A reference in a pool of its own
    (`workers.placement = "split"`) and a critic in one score there first; their log-probs
    and values go with the rows."""
    scores = scored_rewards(table, reward, models, cfg)
    rewards, table = scores.total, with_baseline_reward(with_reward_columns(table, scores), reward, cfg)
    prompt_ids, response_ids = table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist()
    ref_logprobs = values = None
    if models.ref is not None and getattr(group, "ref_pool", None) is not None:
        temperature = float(sampling_of(table).get("temperature", 1.0))
        ref_logprobs = models.ref.logprobs(prompt_ids, response_ids, temperature=temperature, batch_size=cfg.batch_size, batch_tokens=cfg.batch_tokens, compute_dtype=cfg.dtype)
        models = ScoringModels(policy=models.policy, critic=models.critic)
    if models.critic is not None and getattr(group, "critic_pool", None) is not None:
        pad_id = models.policy.pad_id if models.policy is not None else 0
        values = models.critic.values(prompt_ids, response_ids, pad_id=pad_id, batch_size=cfg.batch_size, batch_tokens=cfg.batch_tokens, compute_dtype=cfg.dtype)
        models = ScoringModels(ref=models.ref, policy=models.policy)
    roles = [role for role, model in (("ref", models.ref), ("policy", models.policy), ("critic", models.critic)) if model is not None]

    def part_inputs(rows: slice) -> tuple:
        return rewards[rows], roles, to_dict(cfg), ref_logprobs[rows] if ref_logprobs is not None else None, values[rows] if values is not None else None

    manifest.metrics = reward_stats(set_columns(table, {"reward": reward_column(rewards)}))  # the rewards and ids are the controller's
    return group.commit_parts("score_part", table, part_inputs, out, manifest, "scores")
