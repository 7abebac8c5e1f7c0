"""advantage: scores → batch (per-token rewards with the KL penalty, advantages, returns).

Pure tensor math, no model. The KL controller's coefficient for the next iteration goes into
this output's manifest (`state.kl_controller`); `--kl-state PREV` continues from it.

    rlctl advantage --scores runs/s --out runs/b --estimator grpo --kl-coef 0.05 --kl-estimator k3
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from rlctl.algos.advantages import (
    ESTIMATORS,
    NEEDS_BASELINES,
    NEEDS_COMPONENTS,
    NEEDS_PAIRS,
    NEEDS_SUM_PI_SQUARED,
    NEEDS_VALUES,
    PathWeights,
    PreferencePairs,
    RewardComponents,
    aggregation_divisors,
    decoupled_gae,
    length_adaptive_lams,
    masked_mean,
    online_dpo_stats,
    sequence_mean,
)
from rlctl.algos.filtration import filtered_rows
from rlctl.algos.kl import KL_ESTIMATORS, KLControllerState, next_kl_state
from rlctl.algos.losses import rollout_is_weights
from rlctl.config import AdvantageConfig, to_dict
from rlctl.errors import InputError
from rlctl.lineage import make_manifest, shards_ref, up_to_date
from rlctl.manifest import Manifest
from rlctl.shards import OutputSpec, read, read_manifest, write
from rlctl.tensors import (
    PolicyTokens,
    list_lengths,
    mask_from_lengths,
    padded,
    sampled_mask,
    set_columns,
    unpad,
)


def run(*, scores: str, out: OutputSpec, cfg: AdvantageConfig, kl_state: str | None = None, force: bool = False) -> Manifest:
    check_config(cfg)
    source = read(scores, "scores")
    state = load_kl_state(kl_state, cfg)
    config = {"advantage": to_dict(cfg), "kl_state": {"kl_coef": state.kl_coef, "steps": state.steps}}
    manifest = make_manifest("advantage", config, [shards_ref(source)])
    if (existing := up_to_date(out.uri, manifest, force)) is not None:
        return existing
    table, next_state, stats = advantage_table(source.table, cfg, state)
    manifest.state = {"kl_controller": {"kl_coef": next_state.kl_coef, "steps": next_state.steps}}
    manifest.metrics = stats
    return write(table, out.uri, manifest, schema="batch", format=out.format, rows_per_part=out.rows_per_part)


def check_config(cfg: AdvantageConfig) -> None:
    ESTIMATORS.get(cfg.estimator)
    KL_ESTIMATORS.get(cfg.kl_estimator)
    if cfg.kl_controller not in ("fixed", "adaptive"):
        raise InputError(f"kl_controller must be fixed or adaptive, got {cfg.kl_controller!r}")
    if cfg.kl_controller == "adaptive" and (cfg.kl_target <= 0 or cfg.kl_horizon <= 0):
        raise InputError("the adaptive KL controller needs kl_target > 0 and kl_horizon > 0")
    if cfg.estimator != "gae" and (cfg.critic_lam != -1 or cfg.length_adaptive_alpha):
        raise InputError(f"advantage.critic_lam and length_adaptive_alpha set GAE's λs: estimator {cfg.estimator} has none (use gae)")
    if cfg.estimator in NEEDS_COMPONENTS and cfg.kl_coef > 0:
        raise InputError(f"estimator {cfg.estimator} normalizes each reward's own column, so a KL penalty in the reward (advantage.kl_coef) has no place in it: use update.use_kl_loss")


def load_kl_state(uri: str | None, cfg: AdvantageConfig) -> KLControllerState:
    if not uri:
        return KLControllerState(cfg.kl_coef)
    previous, _ = read_manifest(uri)
    saved = previous.state.get("kl_controller")
    if saved is None:
        raise InputError(f"--kl-state {uri}: its manifest has no kl_controller state (not an advantage output?)")
    return KLControllerState(float(saved["kl_coef"]), int(saved["steps"]))


def advantage_table(table: pa.Table, cfg: AdvantageConfig, state: KLControllerState) -> tuple[pa.Table, KLControllerState, dict]:
    """Per-token rewards, advantages and returns for every row; the next KL state; stats."""
    names = table.column_names
    if cfg.estimator in NEEDS_VALUES and ("values" not in names or table.column("values").null_count):
        raise InputError(f"estimator {cfg.estimator} needs critic values: score with --critic")
    if cfg.estimator in NEEDS_BASELINES and "baseline_reward" not in names:
        raise InputError(f"estimator {cfg.estimator} needs baseline_reward: roll out with rollout.greedy_baseline = true (--greedy-baseline), then score")
    if cfg.estimator in NEEDS_SUM_PI_SQUARED and any(name not in names or table.column(name).null_count for name in ("old_logprobs", "sum_pi_squared")):
        raise InputError(f"estimator {cfg.estimator} needs the policy's old_logprobs and sum_pi_squared: score with --policy and --sum-pi-squared")
    if cfg.estimator in NEEDS_PAIRS and ("ref_logprobs" not in names or table.column("ref_logprobs").null_count):
        raise InputError(f"estimator {cfg.estimator} compares with the reference: score with --ref")
    components = reward_components_of(table) if cfg.estimator in NEEDS_COMPONENTS else None
    kl_coef = state.kl_coef
    if kl_coef > 0 and ("ref_logprobs" not in names or table.column("ref_logprobs").null_count):
        raise InputError("kl_coef > 0 needs ref_logprobs: score with --ref")
    lengths = list_lengths(table.column("response_ids"))
    width = int(lengths.max(initial=0))
    full_mask = mask_from_lengths(lengths, width)
    sampled = sampled_mask(table, lengths, width)
    tokens = PolicyTokens(sampled) if sampled is not None else None  # the policy's tokens only, where a tool wrote some

    def policy(tensor: torch.Tensor) -> torch.Tensor:
        return tokens.compact(tensor) if tokens is not None else tensor

    policy_lengths = tokens.lengths if tokens is not None else lengths
    mask = tokens.mask if tokens is not None else full_mask
    rewards = torch.from_numpy(table.column("reward").to_numpy().astype(np.float64))
    token_rewards = torch.zeros(mask.shape, dtype=torch.float64)
    rows_with_tokens = torch.from_numpy(policy_lengths > 0)
    last = torch.from_numpy(np.maximum(policy_lengths - 1, 0))
    token_rewards[torch.arange(len(lengths))[rows_with_tokens], last[rows_with_tokens]] = rewards[rows_with_tokens]  # on the policy's last token
    stats = {"reward_mean": float(rewards.mean()) if len(rewards) else 0.0, "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0}
    observed_kl: float | None = None  # no reference, no KL: "not recorded", not 0
    sampled_logprobs = ref_logprobs = None  # the sampling policy's and the reference's, where the scores have the reference's
    if "ref_logprobs" in names and not table.column("ref_logprobs").null_count:
        policy_column = "old_logprobs" if "old_logprobs" in names and not table.column("old_logprobs").null_count else "rollout_logprobs"
        sampled_logprobs, ref_logprobs = (policy(padded(table.column(name), width=width)) for name in (policy_column, "ref_logprobs"))
        kl = KL_ESTIMATORS.get(cfg.kl_estimator)(logprobs=sampled_logprobs, ref_logprobs=ref_logprobs)
        kl = torch.where(mask, kl, 0)
        observed_kl = float(sequence_mean(kl, mask))  # as verl: tokens within a sequence, then sequences
        if kl_coef > 0:
            token_rewards = token_rewards - kl_coef * kl
    values = policy(padded(table.column("values"), width=width)) if cfg.estimator in NEEDS_VALUES else None
    with_sum_pi_squared = all(name in names and not table.column(name).null_count for name in ("old_logprobs", "sum_pi_squared"))
    old_logprobs, sum_pi_squared = (policy(padded(table.column(name), width=width)) for name in ("old_logprobs", "sum_pi_squared")) if with_sum_pi_squared else (None, None)
    _, group_index = np.unique(np.asarray(table.column("id").to_pylist(), dtype=object).astype(str), return_inverse=True)
    groups = torch.from_numpy(group_index.astype(np.int64))
    pairs = preference_pairs(cfg, sampled_logprobs, ref_logprobs, width, mask) if cfg.estimator in NEEDS_PAIRS else None
    if cfg.estimator == "gae" and (cfg.critic_lam != -1 or cfg.length_adaptive_alpha):  # VAPO's λs
        policy_lam = length_adaptive_lams(mask.sum(-1), cfg.length_adaptive_alpha) if cfg.length_adaptive_alpha else cfg.lam
        critic_lam = cfg.lam if cfg.critic_lam == -1 else cfg.critic_lam
        result = decoupled_gae(token_rewards=token_rewards, response_mask=mask, values=values, gamma=cfg.gamma, policy_lam=policy_lam, critic_lam=critic_lam)
    else:
        result = ESTIMATORS.get(cfg.estimator)(
            token_rewards=token_rewards, response_mask=mask, values=values, group_index=groups,
            gamma=cfg.gamma, lam=cfg.lam, norm_by_std=cfg.norm_by_std, std_scope=cfg.std_scope,
            baselines=torch.from_numpy(table.column("baseline_reward").to_numpy().astype(np.float64)) if cfg.estimator in NEEDS_BASELINES else None,
            paths=path_weights(table, cfg, old_logprobs, sum_pi_squared, policy, width, mask) if cfg.estimator in NEEDS_SUM_PI_SQUARED else None,
            pairs=pairs, components=components,
        )
    if pairs is not None:
        stats.update(online_dpo_stats(token_rewards, mask, groups, pairs))
    advantages, returns = result.advantages, result.returns
    if tokens is not None:
        token_rewards, advantages, returns = tokens.spread(token_rewards), tokens.spread(advantages), tokens.spread(returns)
    next_state = next_kl_state(
        state, controller=cfg.kl_controller, observed_kl=observed_kl or 0.0, batch_sequences=len(lengths), target=cfg.kl_target, horizon=cfg.kl_horizon
    )
    stats.update({"kl": observed_kl, "kl_coef": kl_coef, "advantage_mean": float(masked_mean(result.advantages, mask))})
    if with_sum_pi_squared:
        stats.update(variance_proxy(result.advantages, mask, old_logprobs, sum_pi_squared))
    table = set_columns(table, {
        "token_rewards": unpad(token_rewards, lengths),
        "advantages": unpad(advantages, lengths),
        "returns": unpad(returns, lengths),
    })
    if cfg.pf_ppo != "off":
        table, filtration = filtered(table, rewards.numpy(), cfg)
        stats.update(filtration)
    return table, next_state, stats


def reward_components_of(table: pa.Table) -> RewardComponents:
    """GDPO's inputs: the columns of the rewards a score stage summed (None: NaN, not applicable)
    and their weights, from what it recorded (rlctl.stages.score.reward_components)."""
    from rlctl.stages.score import reward_components

    components = reward_components(table)
    if not components:
        raise InputError(
            "estimator gdpo normalizes each of several rewards on its own, and these scores have one reward: "
            "score with score.rewards (two or more; with one reward, grpo with advantage.std_scope = batch is the same idea)"
        )
    columns = [table.column(name).to_numpy(zero_copy_only=False).astype(np.float64) for name in components]
    return RewardComponents(torch.from_numpy(np.stack(columns, axis=1)), torch.tensor(list(components.values()), dtype=torch.float64))


def preference_pairs(cfg: AdvantageConfig, sampled_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, width: int, mask: torch.Tensor) -> PreferencePairs:
    """Online DPO's inputs: the sampling policy's log-probs (score's recomputed old ones, else the
    rollout's) and the reference's, as the KL reads them, and each row's divisor in the update's
    aggregation (`dpo_loss_agg`; unresolved auto: the update's default, token-mean)."""
    mode = "token-mean" if cfg.dpo_loss_agg == "auto" else cfg.dpo_loss_agg
    return PreferencePairs(
        logprobs=sampled_logprobs, ref_logprobs=ref_logprobs, divisors=aggregation_divisors(mask, mode, cfg.dpo_loss_horizon or width), beta=cfg.dpo_beta,
        loss=cfg.dpo_loss, which=cfg.dpo_pairs,
    )


def path_weights(
    table: pa.Table, cfg: AdvantageConfig, old_logprobs: torch.Tensor, sum_pi_squared: torch.Tensor, policy, width: int, mask: torch.Tensor,
) -> PathWeights:
    """The optimal token baseline's inputs: score's old log-probs and Σπ² (the policy's tokens
    only, as `policy` compacts them), with the update's truncated importance weights where
    `otb_rollout_is` says (auto unresolved, without an [update] to read: none)."""
    is_weights = None
    if cfg.otb_rollout_is in ("token", "sequence"):
        is_weights = rollout_is_weights(
            old_logprobs=old_logprobs, rollout_logprobs=policy(padded(table.column("rollout_logprobs"), width=width)), response_mask=mask,
            level=cfg.otb_rollout_is, threshold=cfg.otb_rollout_is_threshold,
        )
    return PathWeights(old_logprobs, sum_pi_squared, is_weights, cfg.otb_zero_tail)


def variance_proxy(advantages: torch.Tensor, mask: torch.Tensor, old_logprobs: torch.Tensor, sum_pi_squared: torch.Tensor) -> dict:
    """verl's variance proxies of the policy gradient where score wrote Σπ²: with Ā a sequence's
    mean advantage and W(τ) = Σ_t (1 − 2π_t + Σπ²_t) its summed squared log-prob gradient norms
    in the logits, E[Ā² W] over the batch's sequences approximates E‖ĝ_τ‖², the gradient's total
    power (on-policy: no importance weights), beside its factors E[Ā²] and E[W]."""
    lengths = mask.sum(-1).clamp(min=1)
    mean_advantage = torch.where(mask, advantages, 0).sum(-1) / lengths
    w = torch.where(mask, (1 - 2 * old_logprobs.exp() + sum_pi_squared).clamp(min=0), 0).sum(-1)
    if not len(w):
        return {}
    return {
        "variance_proxy/total_power": float((mean_advantage.square() * w).mean()),
        "variance_proxy/expected_a_squared": float(mean_advantage.square().mean()),
        "variance_proxy/expected_w": float(w.mean()),
    }


def filtered(table: pa.Table, rewards: np.ndarray, cfg: AdvantageConfig) -> tuple[pa.Table, dict]:
    """The batch redrawn by policy filtration (rlctl.algos.filtration), and what it kept: the
    share of the rows drawn at least once and the mean reward of the rows drawn."""
    rows = filtered_rows(table.column("id").to_pylist(), rewards, method=cfg.pf_ppo, power=cfg.pf_ppo_weight_pow, seed=cfg.pf_ppo_seed)
    kept = {"pf_ppo/distinct_rows": len(np.unique(rows)) / len(rows) if len(rows) else 0.0, "pf_ppo/reward_mean": float(rewards[rows].mean()) if len(rows) else 0.0}
    return table.take(pa.array(rows, pa.int64())), kept
