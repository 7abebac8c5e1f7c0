"""Rejection of off-policy tokens and sequences (verl's `rollout_rs`): where the engine that
sampled a response (π_rollout) and the trainer's old policy (π_old) disagree too much, the
token or the whole sequence leaves the loss instead of being reweighted.

Each rule measures a divergence of π_old from π_rollout on the sampled tokens, with
r = π_old / π_rollout per token (log r clamped to ±20):

    k1 = −log r = log π_rollout − log π_old     (bounds on exp(k1) = π_rollout / π_old: `lower_upper`)
    k2 = ½ (log r)²                              (an upper bound)
    k3 = r − 1 − log r                           (an upper bound)

at the level of each token (`token_k1`) or of each sequence: the sum (`seq_sum_k*`), the mean
(`seq_mean_k*`; `seq_mean_k1` is the geometric mean of the ratios) or the largest token's
(`seq_max_k2`, `seq_max_k3`). k2 and k3 are the low-variance estimators of KL(π_rollout ‖ π_old)
on samples of π_rollout, so their sequence sums bound the sequence's KL. Every rule must pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlctl.choices import REJECTION_RULES
from rlctl.errors import ConfigError

LOG_RATIO_BOUND = 20.0  # as verl's SAFETY_BOUND: exp stays finite


@dataclass(frozen=True)
class RejectionRule:
    """One rule: a level, an estimator and its bounds (k1: both, in ratio space; k2/k3: upper)."""

    name: str  # e.g. "seq_mean_k1"
    level: str  # token | seq_sum | seq_mean | seq_max
    estimator: str  # k1 | k2 | k3
    lower: float | None  # k1 only: exp(k1) ≥ lower
    upper: float


def parse_rules(options: str, thresholds: str) -> list[RejectionRule]:
    """`"token_k1,seq_max_k2"` with `"0.5_2.0,2.0"` (one threshold for every rule, or one each;
    a k1 threshold `lower_upper`, or `upper` alone with lower = 1/upper) → the rules, or a
    one-line ConfigError naming what is wrong."""
    names = list(dict.fromkeys(part.strip() for part in options.split(",") if part.strip()))
    if not names:
        raise ConfigError("update.rollout_rs names no rule; use off or some of " + ", ".join(REJECTION_RULES))
    unknown = [name for name in names if name not in REJECTION_RULES]
    if unknown:
        raise ConfigError(f"update.rollout_rs: unknown rule {unknown[0]!r}; available: {', '.join(REJECTION_RULES)}")
    specs = [part.strip() for part in str(thresholds).split(",") if part.strip()]
    if not specs:
        raise ConfigError("update.rollout_rs needs update.rollout_rs_threshold: k1 a ratio range lower_upper (e.g. 0.5_2.0), k2/k3 an upper bound")
    if len(specs) not in (1, len(names)):
        raise ConfigError(
            f"update.rollout_rs_threshold needs one threshold for every rule or one for each of the {len(names)} rules "
            f"({', '.join(names)}), got {len(specs)}"
        )
    specs = specs * len(names) if len(specs) == 1 else specs
    return [_rule(name, spec) for name, spec in zip(names, specs)]


def _rule(name: str, spec: str) -> RejectionRule:
    level, estimator = name.rsplit("_", 1)
    try:
        bounds = [float(part) for part in spec.split("_")]
    except ValueError:
        raise ConfigError(f"update.rollout_rs_threshold {spec!r} for {name} is not a number (k1: lower_upper, e.g. 0.5_2.0)") from None
    if estimator == "k1":
        if len(bounds) > 2:
            raise ConfigError(f"update.rollout_rs_threshold {spec!r} for {name}: give lower_upper or upper")
        lower, upper = (1.0 / bounds[0], bounds[0]) if len(bounds) == 1 else bounds
        if not (0 < lower <= upper and math.isfinite(upper)):
            raise ConfigError(f"update.rollout_rs_threshold {spec!r} for {name}: the ratio bounds must be 0 < lower ≤ upper")
        return RejectionRule(name, level, estimator, lower, upper)
    if len(bounds) != 1:
        raise ConfigError(f"update.rollout_rs_threshold {spec!r} for {name}: k2 and k3 take one upper bound, no lower_upper")
    if not (bounds[0] > 0 and math.isfinite(bounds[0])):
        raise ConfigError(f"update.rollout_rs_threshold {spec!r} for {name} must be a positive number")
    return RejectionRule(name, level, estimator, None, bounds[0])


def token_divergence(estimator: str, log_ratio: torch.Tensor) -> torch.Tensor:
    """k1, k2 or k3 of each token from log r = log π_old − log π_rollout (clamped to ±20)."""
    x = torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * x.square()
    return torch.exp(x) - 1.0 - x


def kept_tokens(
    rules: list[RejectionRule], *, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """[B, T] bool: the tokens every rule keeps (a sequence rule keeps or drops all of a row's
    tokens), and per rule and in all the share of the tokens and of the rows with tokens that
    were rejected: `rollout_rs/masked_fraction`, `rollout_rs/seq_masked_fraction`,
    `rollout_rs/RULE/masked_fraction`, .... Float64, no gradient."""
    mask = response_mask.bool()
    log_ratio = torch.where(mask, old_logprobs.detach().double() - rollout_logprobs.detach().double(), 0)
    lengths = mask.sum(-1)
    has_tokens = lengths > 0
    kept = mask.clone()
    metrics: dict[str, float] = {}
    for rule in rules:
        stat = torch.where(mask, token_divergence(rule.estimator, log_ratio), 0)
        if rule.level == "seq_sum":
            stat = stat.sum(-1, keepdim=True)
        elif rule.level == "seq_mean":
            stat = stat.sum(-1, keepdim=True) / lengths.clamp(min=1).unsqueeze(-1)
        elif rule.level == "seq_max":
            stat = torch.where(mask, stat, -torch.inf).amax(-1, keepdim=True).clamp(min=0)
        inside = stat <= rule.upper if rule.lower is None else (stat >= math.log(rule.lower)) & (stat <= math.log(rule.upper))
        passes = inside.expand_as(mask) & mask
        metrics.update(_rejected_shares(f"rollout_rs/{rule.name}/", passes, mask, has_tokens))
        kept &= passes
    metrics.update(_rejected_shares("rollout_rs/", kept, mask, has_tokens))
    return kept, metrics


def _rejected_shares(prefix: str, kept: torch.Tensor, mask: torch.Tensor, has_tokens: torch.Tensor) -> dict[str, float]:
    rejected = mask & ~kept
    return {
        f"{prefix}masked_fraction": float(rejected.sum()) / max(int(mask.sum()), 1),
        f"{prefix}seq_masked_fraction": float(rejected.any(-1).sum()) / max(int(has_tokens.sum()), 1),
    }
