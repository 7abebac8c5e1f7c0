"""Policy and value losses and their aggregation over tokens.

Aggregation takes the normalisers of the whole *mini-batch* (`batch_tokens`, `batch_seqs`)
rather than computing them from the tensors it is given, so summing the losses of any split
into micro-batches gives exactly the gradient of the whole mini-batch at once.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from rlctl.algos.kl import LOG_RATIO_BOUND
from rlctl.choices import LOSS_AGG_MODES  # noqa: F401 (listed once, in rlctl.choices)


class PolicyLoss(NamedTuple):
    loss: torch.Tensor  # [B, T] per-token loss (0 where masked)
    clipped: torch.Tensor  # [B, T] bool: the clipped branch was taken (verl's pg_clipfrac)
    approx_kl: torch.Tensor  # [B, T] old - new log-prob (k1 of the PPO step)
    dual_clipped: torch.Tensor | None = None  # [B, T] bool: the dual clip capped the loss (verl's pg_clipfrac_lower)
    weight: torch.Tensor | None = None  # [B, 1] the weight each sequence's gradient carries, where a loss has one (VESPO's φ)


def aggregate(
    *,
    loss: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T] bool
    mode: str,
    batch_tokens: int,
    batch_seqs: int,
    horizon: int,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar that is this micro-batch's share of the mini-batch.

    token-mean:              Σ loss / batch_tokens
    seq-mean-token-sum:      Σ_seq Σ_tok loss / batch_seqs
    seq-mean-token-mean:     Σ_seq (Σ_tok loss / len_seq) / batch_seqs
    seq-mean-token-sum-norm: Σ loss / (batch_seqs · horizon)   (Dr. GRPO: a constant divisor)

    seq-mean-token-sum-norm is Dr. GRPO's definition (the 1/G over sequences kept, the 1/|o|
    per sequence replaced by the constant generation budget); verl's mode of that name divides
    by the horizon alone, so its loss is batch_seqs times rlctl's.
    """
    masked = torch.where(response_mask, loss, 0)
    if mode == "token-mean":
        return masked.sum() / max(batch_tokens, 1)
    if mode == "seq-mean-token-sum":
        return masked.sum() / max(batch_seqs, 1)
    if mode == "seq-mean-token-mean":
        lengths = response_mask.sum(-1).clamp(min=1)
        return (masked.sum(-1) / lengths).sum() / max(batch_seqs, 1)
    if mode == "seq-mean-token-sum-norm":
        return masked.sum() / (max(batch_seqs, 1) * max(horizon, 1))
    raise ValueError(f"unknown loss_agg_mode {mode!r}; available: {', '.join(LOSS_AGG_MODES)}")


def importance_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """[B, T] π/π_old per token, with its gradient through `logprobs` (the log-ratio bounded as
    the PPO loss's, so it stays finite)."""
    return torch.exp(torch.clamp(logprobs - old_logprobs, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def clipped_surrogate(advantages: torch.Tensor, ratio: torch.Tensor, low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """max(-A·r, -A·clip(r, 1 - low, 1 + high)) per token, and where the clipped branch won."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def ppo_policy_loss(
    *,
    logprobs: torch.Tensor,  # [B, T] current policy
    old_logprobs: torch.Tensor,  # [B, T] behaviour policy
    advantages: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T] bool
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
) -> PolicyLoss:
    """Clipped surrogate with asymmetric clip (clip-higher, as DAPO) and dual clip.

    loss = max(-A·r, -A·clip(r, 1-low, 1+high)); for A < 0 it is further capped at -A·c
    (dual clip, Ye et al. 2020) when c > 1.
    """
    log_ratio = torch.clamp(logprobs - old_logprobs, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # as verl: exp stays finite
    loss, clipped = clipped_surrogate(advantages, torch.exp(log_ratio), clip_ratio_low, clip_ratio_high)
    dual = torch.zeros_like(clipped)
    if clip_ratio_c > 1.0:
        cap = -advantages * clip_ratio_c
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(advantages < 0, torch.minimum(loss, cap), loss)
    mask = response_mask
    return PolicyLoss(torch.where(mask, loss, 0), clipped & mask, torch.where(mask, -log_ratio, 0), dual & mask)


def gspo_policy_loss(
    *,
    logprobs: torch.Tensor,  # [B, T] current policy
    old_logprobs: torch.Tensor,  # [B, T] behaviour policy
    advantages: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T] bool
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 0.0,  # unused: GSPO clips whole sequences, no dual clip
) -> PolicyLoss:
    """GSPO (Zheng et al. 2025), its token form as verl implements it: one importance ratio per
    sequence, s = exp(mean over its tokens of (log p - log p_old)), clipped to [1 - low, 1 + high]
    like PPO's; each token carries s with the gradient of its own log-prob,
    s_t = sg(s) · p_t / sg(p_t). Ratios are ~1 ± 1e-3, so the clip ranges are small (the paper
    and verl use low = 3e-4, high = 4e-4) and the aggregation is seq-mean-token-mean."""
    log_ratio = torch.where(response_mask, logprobs - old_logprobs, 0)
    lengths = response_mask.sum(-1, keepdim=True).clamp(min=1)
    sequence_log_ratio = log_ratio.sum(-1, keepdim=True) / lengths
    token_log_ratio = logprobs - logprobs.detach() + sequence_log_ratio.detach()
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))  # as verl: exp stays finite
    loss, clipped = clipped_surrogate(advantages, ratio, clip_ratio_low, clip_ratio_high)
    clipped = clipped & response_mask
    approx_kl = torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return PolicyLoss(torch.where(response_mask, loss, 0), clipped, torch.where(response_mask, -approx_kl, 0), torch.zeros_like(clipped))


def cispo_policy_loss(
    *,
    logprobs: torch.Tensor,  # [B, T] current policy
    old_logprobs: torch.Tensor,  # [B, T] behaviour policy
    advantages: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T] bool
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 0.0,  # unused: the weight's clip bounds every token already
) -> PolicyLoss:
    """CISPO (MiniMax-M1, 2025): clip the importance weight, not the update. Each token's loss
    is -A · sg(clip(r, 1 - low, 1 + high)) · p/sg(p): its value is -A times the clipped weight
    (PPO's scale, so pg_loss compares), its gradient -A · clipped weight · ∇log p — a token far
    off-policy still gets a gradient (PPO's clip zeroes it), only a bounded one. The paper sets
    no lower bound (`clip_ratio_low = 1`: the weight only stays ≥ 0) and tunes the upper one."""
    log_ratio = torch.clamp(logprobs - old_logprobs, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # as ppo: exp stays finite
    ratio = torch.exp(log_ratio.detach())
    weight = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = -advantages * weight * torch.exp(logprobs - logprobs.detach())
    clipped = ((ratio < 1.0 - clip_ratio_low) | (ratio > 1.0 + clip_ratio_high)) & response_mask
    return PolicyLoss(torch.where(response_mask, loss, 0), clipped, torch.where(response_mask, -log_ratio, 0), torch.zeros_like(clipped))


def kl_cov_policy_loss(
    *,
    logprobs: torch.Tensor,  # [B, T] current policy
    old_logprobs: torch.Tensor,  # [B, T] behaviour policy
    advantages: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T] bool
    clip_ratio_low: float = 0.0,  # unused: KL-Cov does not clip
    clip_ratio_high: float = 0.0,
    clip_ratio_c: float = 0.0,
    kl_cov_ratio: float = 2e-4,
    kl_cov_coef: float = 1.0,
) -> PolicyLoss:
    """KL-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs"; verl's
    `kl_cov`): the unclipped policy gradient -A·r on every token, plus kl_cov_coef·|log r| on
    the tokens whose covariance (A - mean A)·(log p - mean log p) over the pass's tokens is
    among the largest `kl_cov_ratio` of them (one at least): the tokens whose update would cut
    the entropy most are held near the old policy instead of clipped. `clipped` marks them."""
    log_ratio = torch.clamp(logprobs - old_logprobs, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    loss = -advantages * torch.exp(log_ratio)
    held = torch.zeros_like(response_mask)
    count = int(response_mask.sum())
    if count:
        values = advantages[response_mask].detach().double()
        logp = logprobs[response_mask].detach().double()
        covariance = (values - values.mean()) * (logp - logp.mean())
        top = torch.topk(covariance, max(1, int(count * kl_cov_ratio))).indices
        rows, columns = response_mask.nonzero(as_tuple=True)
        held[rows[top], columns[top]] = True
        loss = torch.where(held, loss + kl_cov_coef * log_ratio.abs(), loss)
    return PolicyLoss(torch.where(response_mask, loss, 0), held, torch.where(response_mask, -log_ratio, 0), torch.zeros_like(held))


def clip_cov_policy_loss(
    *,
    logprobs: torch.Tensor,  # [B, T] current policy
    old_logprobs: torch.Tensor,  # [B, T] behaviour policy
    advantages: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T] bool
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 0.0,  # unused, as in verl's clip_cov
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
) -> PolicyLoss:
    """Clip-Cov (Cui et al. 2025, KL-Cov's sibling; verl's `clip_cov`): PPO's clipped surrogate,
    and of the tokens PPO's clip leaves alone whose covariance (A − mean A)·(log p − mean log p)
    over the pass's tokens lies in (`clip_cov_lb`, `clip_cov_ub`), `clip_cov_ratio` of the pass's
    tokens (one at least) drawn at random get no gradient: the updates that cut the entropy most
    are held back. The draw is seeded by the pass's old log-probs, so a replay draws alike.
    `clipped` marks PPO's clipped tokens and the drawn ones."""
    import zlib

    log_ratio = torch.clamp(logprobs - old_logprobs, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    loss, clipped = clipped_surrogate(advantages, torch.exp(log_ratio), clip_ratio_low, clip_ratio_high)
    drawn = torch.zeros_like(response_mask)
    count = int(response_mask.sum())
    if count:
        values = advantages.detach().double()
        logp = logprobs.detach().double()
        mean_a, mean_p = values[response_mask].mean(), logp[response_mask].mean()
        covariance = (values - mean_a) * (logp - mean_p)
        band = (covariance > clip_cov_lb) & (covariance < clip_cov_ub) & response_mask & ~clipped
        rows, columns = band.nonzero(as_tuple=True)
        if rows.numel():
            seed = zlib.crc32(old_logprobs.detach()[response_mask].float().cpu().numpy().tobytes())
            order = torch.randperm(rows.numel(), generator=torch.Generator().manual_seed(seed))[: max(1, int(count * clip_cov_ratio))]
            drawn[rows[order], columns[order]] = True
    loss = torch.where(drawn, loss.detach() * 0, loss)
    return PolicyLoss(torch.where(response_mask, loss, 0), (clipped | drawn) & response_mask, torch.where(response_mask, -log_ratio, 0), torch.zeros_like(drawn))


def gmpo_policy_loss(
    *,
    logprobs: torch.Tensor,  # [B, T] current policy
    old_logprobs: torch.Tensor,  # [B, T] behaviour policy
    advantages: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T] bool
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 0.0,  # unused: the clip bounds each token's log-ratio already
) -> PolicyLoss:
    """GMPO (Zhao et al. 2025, Geometric-Mean Policy Optimization; verl's `geo_mean`): one
    ratio per sequence, the geometric mean of its tokens' ratios, each token's log-ratio first
    clipped the pessimistic way in log space (to at most `clip_ratio_high` where the sequence's
    advantage is positive, at least −`clip_ratio_low` where negative: the paper's 0.4 both is a
    far wider range than PPO's); a sequence's loss −Ā·exp(mean of the clipped log-ratios), Ā
    its mean advantage. Every token carries its sequence's loss, so `seq-mean-token-mean` makes
    the loss verl's mean over sequences. `clipped` marks clipped tokens of positive advantage,
    `dual_clipped` those of negative (verl's pg_clipfrac and pg_clipfrac_lower)."""
    log_ratio = torch.where(response_mask, torch.clamp(logprobs - old_logprobs, -LOG_RATIO_BOUND, LOG_RATIO_BOUND), 0)
    lengths = response_mask.sum(-1).clamp(min=1)
    advantage = torch.where(response_mask, advantages, 0).sum(-1) / lengths  # [B]
    sign = torch.sign(advantages)
    bounded = torch.clamp(log_ratio, -clip_ratio_low, clip_ratio_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * bounded)
    ratio = torch.exp(torch.where(response_mask, pessimistic, 0).sum(-1) / lengths)  # [B]
    loss = (-advantage * ratio).unsqueeze(-1).expand_as(log_ratio)
    clipped = (log_ratio != bounded) & response_mask
    return PolicyLoss(
        torch.where(response_mask, loss, 0), clipped & (advantages > 0), torch.where(response_mask, -log_ratio, 0), clipped & (advantages < 0),
    )


def gpg_policy_loss(
    *,
    logprobs: torch.Tensor,  # [B, T] current policy
    old_logprobs: torch.Tensor,  # [B, T] behaviour policy
    advantages: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T] bool
    clip_ratio_low: float = 0.0,  # unused: GPG has no ratio and no clip
    clip_ratio_high: float = 0.0,
    clip_ratio_c: float = 0.0,
) -> PolicyLoss:
    """GPG (Chu et al. 2025; verl's `gpg`): the plain policy gradient, −A·log p per token, no
    importance ratio and no clip. On the data's own policy (one optimizer step a batch) its
    gradient is PPO's; every later step of a batch follows the same gradient off-policy,
    uncorrected, as in verl. `approx_kl` is still the step's old − new log-prob (ppo_kl)."""
    log_ratio = torch.clamp(logprobs - old_logprobs, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    loss = -advantages * logprobs
    none = torch.zeros_like(response_mask)
    return PolicyLoss(torch.where(response_mask, loss, 0), none, torch.where(response_mask, -log_ratio, 0), none)


def sapo_policy_loss(
    *,
    logprobs: torch.Tensor,  # [B, T] current policy
    old_logprobs: torch.Tensor,  # [B, T] behaviour policy
    advantages: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T] bool
    clip_ratio_low: float = 0.0,  # unused: SAPO's gate replaces the clip
    clip_ratio_high: float = 0.0,
    clip_ratio_c: float = 0.0,
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
) -> PolicyLoss:
    """SAPO (Gao et al. 2025, Soft Adaptive Policy Optimization; verl's `sapo`): PPO's hard clip
    replaced by a smooth gate, −A · f(r) with f(r) = σ(τ(r − 1)) · 4/τ per token, τ = `sapo_tau_pos`
    where A > 0 and `sapo_tau_neg` elsewhere (larger: negative updates fade sooner). Its gradient
    −A · 4σ(1 − σ) · r · ∇log p is PPO's at r = 1 and fades smoothly as r leaves 1, instead of
    stopping at a bound; nothing is clipped (`clipped` is all False, as verl reports 0)."""
    log_ratio = torch.clamp(logprobs - old_logprobs, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    tau = torch.where(advantages > 0, sapo_tau_pos, sapo_tau_neg).to(log_ratio.dtype)
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    none = torch.zeros_like(response_mask)
    return PolicyLoss(torch.where(response_mask, -advantages * gate, 0), none, torch.where(response_mask, -log_ratio, 0), none)


VESPO_LOG_WEIGHT_BOUNDS = (math.log(1e-8), 20.0)  # the sequence's log-weight is held here (the paper's code), so φ stays finite


def vespo_policy_loss(
    *,
    logprobs: torch.Tensor,  # [B, T] current policy
    old_logprobs: torch.Tensor,  # [B, T] behaviour policy
    advantages: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T] bool
    clip_ratio_low: float = 0.0,  # unused: VESPO's weight replaces the clip
    clip_ratio_high: float = 0.0,
    clip_ratio_c: float = 0.0,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    behaviour_log_weight: torch.Tensor | None = None,  # [B, 1] log of the engine → trainer weight of each sequence (update.rollout_is)
) -> PolicyLoss:
    """VESPO (TRL's `vespo`): each sequence's policy gradient weighed by a gamma-shaped function
    of its whole importance weight w = Π_t π/π_old (times the rollout's correction, where
    update.rollout_is is on), φ(w) = w^k · e^(λ(1 − w)): 1 at w = 1, falling smoothly towards 0
    as w leaves 1 either way, k and λ by the sign of the advantage. φ carries no gradient: each
    token's loss is −A · φ(w) · p/sg(p), valued −A·φ (PPO's scale) with the gradient
    −A · φ · ∇log p. Nothing is clipped."""
    log_ratio = torch.where(response_mask, torch.clamp(logprobs - old_logprobs, -LOG_RATIO_BOUND, LOG_RATIO_BOUND), 0)
    log_w = log_ratio.detach().sum(-1, keepdim=True)
    if behaviour_log_weight is not None:
        log_w = log_w + behaviour_log_weight
    log_w = torch.clamp(log_w, *VESPO_LOG_WEIGHT_BOUNDS)
    non_negative = advantages.detach() >= 0
    k = torch.where(non_negative, vespo_k_pos, vespo_k_neg).to(log_w.dtype)
    lam = torch.where(non_negative, vespo_lambda_pos, vespo_lambda_neg).to(log_w.dtype)
    phi = torch.exp(k * log_w + lam * (1.0 - torch.exp(log_w)))  # [B, T]: one value per sequence where its advantage has one sign
    loss = -advantages * phi * torch.exp(logprobs - logprobs.detach())
    none = torch.zeros_like(response_mask)
    lengths = response_mask.sum(-1, keepdim=True).clamp(min=1)
    sequence_phi = torch.where(response_mask, phi, 0).sum(-1, keepdim=True) / lengths
    return PolicyLoss(torch.where(response_mask, loss, 0), none, torch.where(response_mask, -log_ratio, 0), none, sequence_phi)


POLICY_LOSSES = {
    "ppo": ppo_policy_loss, "gspo": gspo_policy_loss, "cispo": cispo_policy_loss, "kl_cov": kl_cov_policy_loss, "gmpo": gmpo_policy_loss,
    "clip_cov": clip_cov_policy_loss, "gpg": gpg_policy_loss, "sapo": sapo_policy_loss, "vespo": vespo_policy_loss,
}


def off_policy_sequences(
    *, logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, threshold: float,
) -> torch.Tensor:
    """[B, T] bool: the tokens DeepSeek-V3.2's off-policy sequence mask keeps (TRL's
    off_policy_mask_threshold): a token of negative advantage leaves the policy gradient where
    its sequence's mean log(π_behaviour/π) — the KL from the policy that sampled it, measured
    on that sample — is above `threshold`; every other token stays. Learning from its own
    mistakes that the policy has since moved away from is what destabilises training; the
    positive ones are kept whatever their distance. No gradient flows through the choice."""
    log_ratio = torch.where(response_mask, behaviour_logprobs - logprobs.detach(), 0)
    mean_kl = log_ratio.sum(-1, keepdim=True) / response_mask.sum(-1, keepdim=True).clamp(min=1)
    return response_mask & ((advantages >= 0) | (mean_kl <= threshold))


def sequence_log_weights(weights: torch.Tensor, response_mask: torch.Tensor, level: str) -> torch.Tensor:
    """[B, 1] the log of each sequence's engine → trainer weight from `rollout_is_weights`: the
    sum of its tokens' log-weights, or its one weight at sequence level (VESPO folds it into w)."""
    logs = torch.log(weights.clamp(min=torch.finfo(weights.dtype).tiny))
    if level == "sequence":  # every token of a sequence holds its one weight
        one = torch.where(response_mask, logs, float("-inf")).amax(-1, keepdim=True)
        return torch.where(response_mask.any(-1, keepdim=True), one, 0)
    return torch.where(response_mask, logs, 0).sum(-1, keepdim=True)


def entropy_shaped_advantages(advantages: torch.Tensor, entropy: torch.Tensor, *, alpha: float, kappa: float) -> torch.Tensor:
    """[B, T] A + min(α·H, |A|/κ) per token (Cheng et al. 2025, "Reasoning with Exploration: An
    Entropy Perspective"): each token's advantage raised by its entropy under the policy being
    trained (no gradient through it), so the uncertain, exploratory tokens of a sample count
    more; the clip at |A|/κ (κ > 1) never flips an advantage's sign and leaves a zero one 0."""
    return advantages + torch.minimum(alpha * entropy.detach().to(advantages.dtype), advantages.abs() / kappa)


def high_entropy_tokens(entropy: torch.Tensor, response_mask: torch.Tensor, top_quantile: float) -> torch.Tensor:
    """[B, T] bool: the tokens whose entropy is at or above the (1 − top_quantile) quantile of the
    masked tokens' entropies (Wang et al. 2025, "Beyond the 80/20 rule": the policy gradient
    of the ~20% "forking" tokens alone; TRL's top_entropy_quantile). 1 keeps every token."""
    if top_quantile >= 1.0 or not response_mask.any():
        return response_mask.clone()
    threshold = torch.quantile(entropy.detach()[response_mask].double(), 1.0 - top_quantile)
    return (entropy.detach().double() >= threshold) & response_mask


def rollout_is_weights(
    *, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor, level: str, threshold: float,
) -> torch.Tensor:
    """Truncated importance weights for the engine/trainer mismatch (verl's rollout_is): the
    rollout engine sampled, the trainer's recomputed `old_logprobs` define the policy the loss
    is about, so each token's loss is weighted by min(exp(old - rollout), threshold); at
    sequence level one weight per sequence from the summed log-ratio. No gradient. [B, T]"""
    log_ratio = torch.where(response_mask, old_logprobs - rollout_logprobs, 0).detach()
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    elif level != "token":
        raise ValueError(f"unknown rollout_is level {level!r}; use token or sequence")
    weights = torch.exp(torch.clamp(log_ratio, max=math.log(threshold)))
    return torch.where(response_mask, weights, 0)


def clipped_value_loss(
    *,
    values: torch.Tensor,  # [B, T] current critic
    old_values: torch.Tensor,  # [B, T] critic at rollout time
    returns: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T] bool
    cliprange_value: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """½·max((v - R)², (clip(v, v_old ± ε) - R)²) per token, and whether the clip bound."""
    clipped_values = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    loss_unclipped = (values - returns).square()
    loss_clipped = (clipped_values - returns).square()
    loss = 0.5 * torch.maximum(loss_unclipped, loss_clipped)
    return torch.where(response_mask, loss, 0), (loss_clipped > loss_unclipped) & response_mask
