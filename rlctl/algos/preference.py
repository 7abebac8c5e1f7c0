"""The preference losses as pure functions of the responses' summed log-probabilities: DPO's
and its variants (`dpo.loss`), the f-divergence each side's log-ratio can be scored by
(`dpo.f_divergence`), LD-DPO's token weights and WPO's sequence weights. `rlctl dpo` trains
with them, and the `online_dpo` advantage estimator takes their gradient."""

from __future__ import annotations

import math

import torch

from rlctl.choices import F_DIVERGENCE_LOSSES


def dpo_losses(
    chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, *, beta: float, loss: str = "sigmoid",
    label_smoothing: float = 0.0, chosen_tokens: torch.Tensor | None = None, rejected_tokens: torch.Tensor | None = None, simpo_gamma: float = 0.0,
    sft_weight: float = 0.0, discopop_tau: float = 0.05, f_divergence: str = "reverse_kl", f_alpha: float = 0.5,
    chosen_plain: torch.Tensor | None = None, loss_weights: tuple[float, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each pair's loss, the chosen response's implicit reward, the rejected one's) from the
    responses' summed log-probabilities under the policy and the reference [P] (SimPO and ORPO
    ignore the reference); "ipo", "sigmoid_norm", "simpo" and "orpo" also need each side's trained tokens,
    since they compare per-token values, as does `sft_weight`, the weight of the chosen side's
    NLL per token added to each pair's loss (of `chosen_plain`, the chosen side's plain summed
    log-probability, where `chosen` is weighted: LD-DPO). `loss` may name several losses,
    comma-separated: their sum, weighted by `loss_weights` (1 each by default; MPO: sigmoid and
    bco_pair at 0.8 and 0.2), the implicit rewards the first one's."""
    names = loss.split(",")
    weights = loss_weights or (1.0,) * len(names)
    if len(weights) != len(names):
        raise ValueError(f"{len(weights)} loss weights for the losses {loss!r}")
    losses = None
    for name, weight in zip(names, weights):
        each, reward_c, reward_r = _preference_losses(
            chosen, rejected, ref_chosen, ref_rejected, beta=beta, loss=name, label_smoothing=label_smoothing, chosen_tokens=chosen_tokens,
            rejected_tokens=rejected_tokens, simpo_gamma=simpo_gamma, discopop_tau=discopop_tau, f_divergence=f_divergence, f_alpha=f_alpha,
        )
        each = weight * each if loss_weights else each
        if losses is None:
            losses, chosen_reward, rejected_reward = each, reward_c, reward_r
        else:
            losses = losses + each
    if sft_weight:  # RPO (Pang et al.): DPO beside the chosen response's NLL
        if chosen_tokens is None:
            raise ValueError("an sft_weight needs the chosen side's trained tokens")
        losses = losses - sft_weight * (chosen if chosen_plain is None else chosen_plain) / chosen_tokens.clamp(min=1)
    return losses, chosen_reward, rejected_reward


def _preference_losses(
    chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, *, beta: float, loss: str,
    label_smoothing: float, chosen_tokens: torch.Tensor | None, rejected_tokens: torch.Tensor | None, simpo_gamma: float, discopop_tau: float,
    f_divergence: str, f_alpha: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from torch.nn.functional import logsigmoid, relu

    if loss in ("ipo", "simpo", "orpo", "sigmoid_norm") and (chosen_tokens is None or rejected_tokens is None):
        raise ValueError(f"the {loss} loss needs each side's trained tokens")
    eps = label_smoothing
    if loss == "simpo":  # Meng et al.: length-normalized log-probs, a target margin, no reference (TRL's CPOTrainer, loss_type "simpo")
        chosen_mean, rejected_mean = chosen / chosen_tokens.clamp(min=1), rejected / rejected_tokens.clamp(min=1)
        s = chosen_mean - rejected_mean - simpo_gamma / beta
        losses = -(1 - eps) * logsigmoid(beta * s) - eps * logsigmoid(-beta * s)
        return losses, (beta * chosen_mean).detach(), (beta * rejected_mean).detach()
    if loss == "orpo":  # Hong et al.: the chosen response's NLL per token plus beta (their lambda) times the odds ratio's loss (TRL's ORPOTrainer)
        chosen_mean, rejected_mean = chosen / chosen_tokens.clamp(min=1), rejected / rejected_tokens.clamp(min=1)
        log_odds = (chosen_mean - rejected_mean) - (log1mexp(chosen_mean) - log1mexp(rejected_mean))
        losses = -chosen_mean - beta * logsigmoid(log_odds)
        return losses, (beta * chosen_mean).detach(), (beta * rejected_mean).detach()
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    if loss in F_DIVERGENCE_LOSSES:  # f-DPO: each log-ratio r as f'(e^r) of the divergence the loss regularizes with
        chosen_score, rejected_score = (f_score(ratio, f_divergence, f_alpha) for ratio in (chosen_ratio, rejected_ratio))
    elif f_divergence != "reverse_kl":
        raise ValueError(f"the {loss} loss takes the reverse KL only, not {f_divergence!r}")
    else:
        chosen_score, rejected_score = chosen_ratio, rejected_ratio
    h = chosen_score - rejected_score
    if loss == "sigmoid":  # Rafailov et al.; with eps, conservative DPO (Mitchell)
        losses = -(1 - eps) * logsigmoid(beta * h) - eps * logsigmoid(-beta * h)
    elif loss == "robust":  # Chowdhury et al.: unbiased for labels flipped with probability eps
        losses = (-(1 - eps) * logsigmoid(beta * h) + eps * logsigmoid(-beta * h)) / (1 - 2 * eps)
    elif loss == "ipo":  # Azar et al., eq. 17, beta as their tau; log-ratios per trained token, as the IPO authors and TRL compute them
        per_token = chosen_score / chosen_tokens.clamp(min=1) - rejected_score / rejected_tokens.clamp(min=1)
        losses = (per_token - 1 / (2 * beta)) ** 2
    elif loss == "hinge":  # SLiC (Zhao et al.) on the log-ratios, as TRL's "hinge"
        losses = relu(1 - beta * h)
    elif loss == "sigmoid_norm":  # DPO on the log-ratios per trained token (TRL's "sigmoid_norm")
        per_token = chosen_score / chosen_tokens.clamp(min=1) - rejected_score / rejected_tokens.clamp(min=1)
        losses = -logsigmoid(beta * per_token)
    elif loss == "exo_pair":  # Ji et al., EXO: KL from the pair's softmax of β·ratios to the labels' (1 − eps, eps)
        q = torch.sigmoid(beta * h)
        losses = q * (logsigmoid(beta * h) - math.log1p(-eps)) + (1 - q) * (logsigmoid(-beta * h) - math.log(eps))
    elif loss == "nca_pair":  # Chen et al., NCA: each response's own likelihood against the reference's, not just their difference
        losses = -logsigmoid(beta * chosen_ratio) - 0.5 * logsigmoid(-beta * chosen_ratio) - 0.5 * logsigmoid(-beta * rejected_ratio)
    elif loss == "bco_pair":  # Jung et al., BCO on pairs, without its running reward shift (TRL DPOTrainer's "bco_pair")
        losses = -logsigmoid(beta * chosen_ratio) - logsigmoid(-beta * rejected_ratio)
    elif loss == "sppo_hard":  # Wu et al., SPPO with hard win probabilities: the chosen log-ratio towards 1/(2β), the rejected towards −1/(2β)
        losses = (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
    elif loss == "apo_zero":  # D'Oosterlinck et al., APO-zero: the chosen response up and the rejected down, each on its own
        losses = 1 - torch.sigmoid(beta * chosen_ratio) + torch.sigmoid(beta * rejected_ratio)
    elif loss == "apo_down":  # APO-down: both down, the rejected more (chosen responses worse than the policy's own)
        losses = torch.sigmoid(beta * chosen_ratio) + 1 - torch.sigmoid(beta * (chosen_ratio - rejected_ratio))
    elif loss == "discopop":  # Chris Lu et al., DiscoPOP: logistic and exponential losses mixed by σ(β·h / τ)
        mix = torch.sigmoid(beta * h / discopop_tau)
        losses = -logsigmoid(beta * h) * (1 - mix) + torch.exp(-beta * h) * mix
    elif loss in ("aot", "aot_unpaired"):  # Melnyk et al., AOT: DPO on margins paired by rank across the batch (TRL's "aot", "aot_unpaired"), sorted within each micro-batch
        if loss == "aot":  # the policy's chosen-rejected margins, sorted, against the reference's, sorted
            margin = torch.sort(chosen - rejected).values - torch.sort(ref_chosen - ref_rejected).values
        else:  # the chosen log-ratios, sorted, against the rejected ones, sorted: for chosen and rejected responses that are not pairs
            margin = torch.sort(chosen_ratio).values - torch.sort(rejected_ratio).values
        losses = -(1 - eps) * logsigmoid(beta * margin) - eps * logsigmoid(-beta * margin)
    else:
        raise ValueError(f"unknown DPO loss {loss!r}")
    return losses, (beta * chosen_ratio).detach(), (beta * rejected_ratio).detach()


def desensitized_weights(counted: torch.Tensor, alpha: float) -> torch.Tensor:
    """LD-DPO's weight of each token of a micro-batch's pairs (Liu et al., 2024, "Length
    Desensitization in Direct Preference Optimization"; TRL's ld_alpha): `counted` [2P, L] holds
    the P chosen sides' trained tokens, then the P rejected sides'; a side's first ℓ trained
    tokens weigh 1 and the rest α, ℓ the shorter side's count of its pair, so the longer side's
    excess length moves its log-probability by α of what it would."""
    pairs = counted.shape[0] // 2
    position = counted.long().cumsum(-1)  # 1-based among a side's trained tokens
    lengths = counted.sum(-1)
    shared = torch.minimum(lengths[:pairs], lengths[pairs:]).repeat(2).unsqueeze(-1)
    return torch.where(counted, torch.where(position <= shared, 1.0, alpha), 0.0)


def f_score(logratio: torch.Tensor, divergence: str, alpha: float = 0.5) -> torch.Tensor:
    """f'(u) at u = π/π_ref = e^r, for the f-divergence a preference loss regularizes with (Wang
    et al., 2023, "Beyond Reverse KL"): reverse KL log u = r (DPO's), forward KL 1 − 1/u,
    Jensen-Shannon log(2u/(1 + u)) = log 2 + log σ(r), and the α-divergence (1 − u^−α)/α, α in
    (0, 1), which runs from the reverse KL (α → 0) to the forward (α → 1). The exponent is held
    at 80 at most, so that a response far less likely than under the reference stays finite."""
    from torch.nn.functional import logsigmoid

    if divergence == "reverse_kl":
        return logratio
    if divergence == "forward_kl":
        return 1 - torch.exp((-logratio).clamp(max=80.0))
    if divergence == "js_divergence":
        return math.log(2) + logsigmoid(logratio)
    if divergence == "alpha_divergence":
        return (1 - torch.exp((-alpha * logratio).clamp(max=80.0))) / alpha
    raise ValueError(f"unknown f-divergence {divergence!r}")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x < 0, accurate at both ends (Mächler's two branches); x is kept
    just below 0, where a response's every token has probability 1."""
    x = x.clamp(max=-1e-7)
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def wpo_weights(logp: torch.Tensor, sum_pi_squared: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """WPO's weight of each sequence (Zhou et al., 2024, "WPO: Enhancing RLHF with Weighted
    Preference Optimization"; TRL's use_weighting): exp of the mean over its trained tokens of
    log π(y_t) − log Σ_v π(v)², how likely the response is under the policy's own sampling,
    relative to the distribution's own sharpness (1 for a response of argmax tokens of one-hot
    distributions), without a gradient. `logp`, `sum_pi_squared`, `counted`: [S, T]."""
    aligned = torch.where(counted, logp - torch.log(sum_pi_squared.clamp(min=1e-30)), 0).sum(-1)
    return torch.exp(aligned / counted.sum(-1).clamp(min=1)).detach()


def ranked_pairs(rows: list[int], rewards, which: str = "best_worst", min_gap: float = 0.0) -> list[tuple[int, int]]:
    """The (chosen, rejected) pairs among one prompt's samples `rows` (`rewards[row]` each): its
    best and its worst sample (the first of equals), or with `which = "all"` every two of them,
    the better one chosen, in row order; only where the rewards differ by more than `min_gap`.
    Online DPO's pairs (rlctl.algos.advantages) and scored rollouts' (rlctl.scored_pairs)."""
    if which == "all":
        return [(a, b) for a in rows for b in rows if rewards[a] - rewards[b] > min_gap]
    best, worst = max(rows, key=lambda r: rewards[r]), min(rows, key=lambda r: rewards[r])
    return [(best, worst)] if rewards[best] - rewards[worst] > min_gap else []
