"""Advantage estimators, registered by name, all with one signature.

Every estimator takes per-token rewards (the scalar reward on the last response token, minus
any KL penalty), the response mask, critic values (only `gae` uses them) and the group index
of each sequence (samples of one prompt share it), and returns advantages and returns.
Positions where `response_mask` is 0 never influence any output and come out as 0.

Groups of one (one sample of a prompt) give advantage 0 for `grpo`, `gdpo`, `rloo`, `opo`,
`grpo_passk`, `gpg`, `optimal_token_baseline`, `reinforce_pp_baseline` and `online_dpo`: with nothing to compare against, the sample carries no signal, so it
contributes no policy gradient (verl differs: a singleton's baseline is 0 there, and for grpo
its std is 1, so its raw score becomes its advantage).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from rlctl.algos.preference import dpo_losses, ranked_pairs
from rlctl.algos.registry import Registry
from rlctl.choices import SUM_PI_SQUARED_ESTIMATORS

EPS = 1e-6


class AdvantageOutput(NamedTuple):
    advantages: torch.Tensor  # [B, T]
    returns: torch.Tensor  # [B, T]


class PathWeights(NamedTuple):
    """What the optimal token baseline weighs each sample's path by: the old policy's log-prob of
    each token and its distribution's Σπ² (score's), optionally the truncated importance weights
    the update will apply (the baseline of least variance under them), and whether a group's one
    longest sample takes no baseline where it is alone."""

    old_logprobs: torch.Tensor  # [B, T]
    sum_pi_squared: torch.Tensor  # [B, T]
    is_weights: torch.Tensor | None = None  # [B, T]: W scaled by their squares (verl's, with rollout correction)
    zero_tail: bool = False


class PreferencePairs(NamedTuple):
    """What online DPO reads beside the rewards: each token's log-prob under the policy that
    sampled it (the update's starting weights) and under the reference, the preference loss,
    and each row's divisor in the update's loss aggregation (`aggregation_divisors`), so that the
    advantages give the loss's exact gradient at the update's first step."""

    logprobs: torch.Tensor  # [B, T]
    ref_logprobs: torch.Tensor  # [B, T]
    divisors: torch.Tensor  # [B]
    beta: float
    loss: str = "sigmoid"
    which: str = "best_worst"  # the pairs of a group: its best and worst sample, or every two samples whose rewards differ ("all")


class RewardComponents(NamedTuple):
    """What GDPO reads instead of the total: each of several rewards' own score of each sample
    (NaN where that reward does not apply to it) and its weight in the total."""

    scores: torch.Tensor  # [B, K] float64
    weights: torch.Tensor  # [K]


class AdvantageEstimator(Protocol):
    def __call__(
        self,
        *,
        token_rewards: torch.Tensor,  # [B, T]
        response_mask: torch.Tensor,  # [B, T] bool
        values: torch.Tensor | None,  # [B, T] or None
        group_index: torch.Tensor,  # [B] long
        gamma: float,
        lam: float,
        norm_by_std: bool,
        std_scope: str = "group",  # grpo's divisor with norm_by_std: its group's std, or the batch's
        baselines: torch.Tensor | None = None,  # [B]: each sequence's own baseline (remax: its prompt's greedy reward)
        paths: PathWeights | None = None,  # optimal_token_baseline: what weighs each sample's path
        pairs: PreferencePairs | None = None,  # online_dpo: the pairs' log-probs and loss
        components: RewardComponents | None = None,  # gdpo: each reward's own scores and weight
    ) -> AdvantageOutput: ...


ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")
NEEDS_VALUES = {"gae"}
NEEDS_BASELINES = {"remax"}
NEEDS_SUM_PI_SQUARED = set(SUM_PI_SQUARED_ESTIMATORS)  # and the policy's old log-probs, from the same forward
NEEDS_PAIRS = {"online_dpo"}  # the policy's and the reference's log-probs
NEEDS_COMPONENTS = {"gdpo"}  # each reward's own scores (several rewards)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, 0).sum() / mask.sum().clamp(min=1)


def sequence_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over sequences of each sequence's token mean (verl's measure of the KL fed to the
    adaptive controller); sequences without tokens are left out. [B, T] → scalar"""
    lengths = mask.sum(-1)
    has_tokens = lengths > 0
    per_sequence = torch.where(mask, x, 0).sum(-1) / lengths.clamp(min=1)
    return per_sequence[has_tokens].sum() / has_tokens.sum().clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the masked entries (unbiased variance); 0 elsewhere."""
    count = mask.sum()
    mean = masked_mean(x, mask)
    centered = torch.where(mask, x - mean, 0)
    var = centered.square().sum() / (count - 1).clamp(min=1)
    return torch.where(mask, centered * torch.rsqrt(var + 1e-8), 0)


def sequence_scores(token_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] → [B]: the sum of each sequence's per-token rewards."""
    return torch.where(response_mask, token_rewards, 0).sum(-1)


def group_stats(scores: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence (group mean, group std (unbiased; 0 for singletons), group size), each [B]."""
    _, inverse = torch.unique(group_index, return_inverse=True)
    groups = int(inverse.max()) + 1 if inverse.numel() else 0
    size = torch.zeros(groups, dtype=scores.dtype).index_add_(0, inverse, torch.ones_like(scores))
    total = torch.zeros(groups, dtype=scores.dtype).index_add_(0, inverse, scores)
    mean = total / size
    sq = torch.zeros(groups, dtype=scores.dtype).index_add_(0, inverse, (scores - mean[inverse]).square())
    std = torch.sqrt(sq / (size - 1).clamp(min=1))
    return mean[inverse], std[inverse], size[inverse]


@ESTIMATORS.register("gae")
def gae(*, token_rewards, response_mask, values, group_index, gamma, lam, norm_by_std, std_scope="group", baselines=None, paths=None, pairs=None, components=None) -> AdvantageOutput:
    """Generalised advantage estimation with a critic; advantages whitened over the batch.

    Masked positions are skipped, as if absent: the recursion carries over them unchanged.
    """
    if values is None:
        raise ValueError("gae needs critic values")
    B, T = token_rewards.shape
    raw = torch.zeros_like(token_rewards)
    last_gae = torch.zeros(B, dtype=token_rewards.dtype)
    next_value = torch.zeros(B, dtype=token_rewards.dtype)
    for t in reversed(range(T)):
        m = response_mask[:, t]
        v = torch.where(m, values[:, t], 0)
        r = torch.where(m, token_rewards[:, t], 0)
        delta = r + gamma * next_value - v
        last_gae = torch.where(m, delta + gamma * lam * last_gae, last_gae)
        next_value = torch.where(m, v, next_value)
        raw[:, t] = last_gae
    returns = torch.where(response_mask, raw + torch.where(response_mask, values, 0), 0)
    return AdvantageOutput(masked_whiten(raw, response_mask), returns)


def length_adaptive_lams(lengths: torch.Tensor, alpha: float) -> torch.Tensor:
    """[B] VAPO's length-adaptive λ of each sequence, 1 − 1/(α·l) (0 where that is below 0): the
    GAE of a long response looks further ahead, so the bias a short λ puts on its early tokens
    (the value's error, compounded over hundreds of steps) does not swamp its reward."""
    return (1.0 - 1.0 / (alpha * lengths.to(torch.float64).clamp(min=1))).clamp(min=0.0)


def decoupled_gae(
    *, token_rewards: torch.Tensor, response_mask: torch.Tensor, values: torch.Tensor, gamma: float, policy_lam: float | torch.Tensor, critic_lam: float,
) -> AdvantageOutput:
    """VAPO's decoupled GAE: the policy's advantages from `policy_lam` (a number, or one per
    sequence: `length_adaptive_lams`), whitened as `gae`'s; the critic's targets (returns) from
    `critic_lam` (1.0: the discounted reward-to-go, no bias from the critic's own values)."""
    group_index = torch.zeros(token_rewards.shape[0], dtype=torch.long)
    policy = gae(token_rewards=token_rewards, response_mask=response_mask, values=values, group_index=group_index, gamma=gamma, lam=policy_lam, norm_by_std=False)
    critic = gae(token_rewards=token_rewards, response_mask=response_mask, values=values, group_index=group_index, gamma=gamma, lam=critic_lam, norm_by_std=False)
    return AdvantageOutput(policy.advantages, critic.returns)


@ESTIMATORS.register("grpo")
def grpo(*, token_rewards, response_mask, values, group_index, gamma, lam, norm_by_std, std_scope="group", baselines=None, paths=None, pairs=None, components=None) -> AdvantageOutput:
    """Group-relative outcome advantage: (score - group mean) [/ std], on every token. The std
    is the group's, or with `std_scope="batch"` every sequence's of the batch (TRL's
    `scale_rewards="batch"`, Lite PPO's group mean with batch std). `norm_by_std=False` (with the
    seq-mean-token-sum-norm loss) is Dr.GRPO."""
    scores = sequence_scores(token_rewards, response_mask)
    mean, std, size = group_stats(scores, group_index)
    adv = scores - mean
    if norm_by_std:
        if std_scope == "batch":
            std = scores.std() if scores.numel() > 1 else torch.zeros((), dtype=scores.dtype)
        adv = adv / (std + EPS)
    adv = torch.where(size > 1, adv, 0)
    advantages = torch.where(response_mask, adv.unsqueeze(-1), 0)
    return AdvantageOutput(advantages, advantages.clone())


@ESTIMATORS.register("gdpo")
def gdpo(*, token_rewards, response_mask, values, group_index, gamma, lam, norm_by_std, std_scope="group", baselines=None, paths=None, pairs=None, components=None) -> AdvantageOutput:
    """GDPO (Group reward-Decoupled normalization Policy Optimization; TRL's
    `multi_objective_aggregation = "normalize_then_sum"`): each reward normalized within its
    group on its own, (r_k − group mean_k) / (group std_k + ε) over the samples it applies to,
    then their weighted sum, whitened over the batch. GRPO normalizes the weighted sum, so a
    reward of wide spread drowns the others whatever the weights; here each reward's ranking
    within the group counts in its weight. The KL penalty and `norm_by_std` play no part (the
    estimator reads the rewards' columns, not the total)."""
    if components is None:
        raise ValueError("gdpo needs each reward's own scores")
    scores, weights = components.scores, components.weights
    normalized = torch.zeros_like(scores)
    for k in range(scores.shape[1]):
        column = scores[:, k]
        applies = ~torch.isnan(column)
        if not applies.any():
            continue
        mean, std, _ = group_stats(column[applies], group_index[applies])
        normalized[applies, k] = (column[applies] - mean) / (std + EPS)  # a group where it applies once: 0
    summed = normalized @ weights.to(normalized.dtype)
    _, _, size = group_stats(summed, group_index)
    grouped = summed[size > 1]  # groups of one carry no signal, and stay out of the batch's statistics
    if grouped.numel() < 2:
        return AdvantageOutput(torch.zeros_like(token_rewards), torch.zeros_like(token_rewards))
    adv = torch.where(size > 1, (summed - grouped.mean()) / (grouped.std() + EPS), 0)
    advantages = torch.where(response_mask, adv.unsqueeze(-1), 0)
    return AdvantageOutput(advantages, advantages.clone())


@ESTIMATORS.register("rloo")
def rloo(*, token_rewards, response_mask, values, group_index, gamma, lam, norm_by_std, std_scope="group", baselines=None, paths=None, pairs=None, components=None) -> AdvantageOutput:
    """Leave-one-out baseline: score - mean of the other samples of the same prompt."""
    scores = sequence_scores(token_rewards, response_mask)
    mean, _, size = group_stats(scores, group_index)
    others_mean = (mean * size - scores) / (size - 1).clamp(min=1)
    adv = torch.where(size > 1, scores - others_mean, 0)
    advantages = torch.where(response_mask, adv.unsqueeze(-1), 0)
    return AdvantageOutput(advantages, advantages.clone())


def discounted_returns(token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """[B, T] → [B, T]: G_t = r_t + γ G_{t+1} over the valid tokens (masked ones skipped)."""
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros(token_rewards.shape[0], dtype=token_rewards.dtype)
    for t in reversed(range(token_rewards.shape[1])):
        m = response_mask[:, t]
        running = torch.where(m, torch.where(m, token_rewards[:, t], 0) + gamma * running, running)
        returns[:, t] = torch.where(m, running, 0)
    return returns


@ESTIMATORS.register("reinforce_pp")
def reinforce_pp(*, token_rewards, response_mask, values, group_index, gamma, lam, norm_by_std, std_scope="group", baselines=None, paths=None, pairs=None, components=None) -> AdvantageOutput:
    """REINFORCE++: discounted per-token returns, whitened over the whole batch."""
    returns = discounted_returns(token_rewards, response_mask, gamma)
    return AdvantageOutput(masked_whiten(returns, response_mask), returns)


@ESTIMATORS.register("reinforce_pp_baseline")
def reinforce_pp_baseline(*, token_rewards, response_mask, values, group_index, gamma, lam, norm_by_std, std_scope="group", baselines=None, paths=None, pairs=None, components=None) -> AdvantageOutput:
    """REINFORCE++ with a group-mean baseline: (score - group mean) on every token, whitened
    over the batch. Groups of one carry no signal (advantage 0) and stay out of the whitening
    statistics, as for grpo and rloo; verl instead uses a baseline of 0 for them, so their
    raw score is their signal."""
    scores = sequence_scores(token_rewards, response_mask)
    mean, _, size = group_stats(scores, group_index)
    compared = response_mask & (size > 1).unsqueeze(-1)
    per_token = torch.where(compared, (scores - mean).unsqueeze(-1), 0)
    advantages = masked_whiten(per_token, compared)
    return AdvantageOutput(advantages, advantages.clone())


@ESTIMATORS.register("opo")
def opo(*, token_rewards, response_mask, values, group_index, gamma, lam, norm_by_std, std_scope="group", baselines=None, paths=None, pairs=None, components=None) -> AdvantageOutput:
    """OPO's optimal baseline (Hao et al. 2025): score - the group's length-weighted mean
    score Σ|o|·s / Σ|o|, on every token; no std. With exactly on-policy training the variance
    of the gradient is smallest for this baseline."""
    scores = sequence_scores(token_rewards, response_mask)
    lengths = response_mask.sum(-1).to(scores.dtype)
    _, inverse = torch.unique(group_index, return_inverse=True)
    groups = int(inverse.max()) + 1 if inverse.numel() else 0
    weighted = torch.zeros(groups, dtype=scores.dtype).index_add_(0, inverse, lengths * scores)
    total = torch.zeros(groups, dtype=scores.dtype).index_add_(0, inverse, lengths)
    _, _, size = group_stats(scores, group_index)
    adv = torch.where(size > 1, scores - weighted[inverse] / total[inverse].clamp(min=1), 0)
    advantages = torch.where(response_mask, adv.unsqueeze(-1), 0)
    return AdvantageOutput(advantages, advantages.clone())


@ESTIMATORS.register("grpo_passk")
def grpo_passk(*, token_rewards, response_mask, values, group_index, gamma, lam, norm_by_std, std_scope="group", baselines=None, paths=None, pairs=None, components=None) -> AdvantageOutput:
    """Pass@k training (verl's grpo_passk, after Chen et al. 2025): only each group's best sample
    gets an advantage, its margin over the runner-up (best - second best) [/ the group's std],
    on every token; the others 0. It pushes the best of k up, not the average."""
    scores = sequence_scores(token_rewards, response_mask)
    _, std, size = group_stats(scores, group_index)
    adv = torch.zeros_like(scores)
    for group in torch.unique(group_index):
        members = (group_index == group).nonzero().squeeze(-1)
        if members.numel() < 2:
            continue
        ranked = torch.sort(scores[members], descending=True, stable=True)
        margin = ranked.values[0] - ranked.values[1]
        best = members[ranked.indices[0]]
        adv[best] = margin / (std[best] + EPS) if norm_by_std else margin
    advantages = torch.where(response_mask, adv.unsqueeze(-1), 0)
    return AdvantageOutput(advantages, advantages.clone())


@ESTIMATORS.register("remax")
def remax(*, token_rewards, response_mask, values, group_index, gamma, lam, norm_by_std, std_scope="group", baselines=None, paths=None, pairs=None, components=None) -> AdvantageOutput:
    """ReMax (Li et al. 2023): the reward-to-go of each token (undiscounted, as verl's) less
    the reward of the prompt's greedy response, decoded beside the samples and not trained on;
    no critic, no group needed (one sample a prompt is enough), no whitening."""
    if baselines is None:
        raise ValueError("remax needs each sequence's baseline (its prompt's greedy reward)")
    returns = discounted_returns(token_rewards, response_mask, 1.0)
    advantages = torch.where(response_mask, returns - baselines.to(returns.dtype).unsqueeze(-1), 0)
    return AdvantageOutput(advantages, returns)


@ESTIMATORS.register("gpg")
def gpg(*, token_rewards, response_mask, values, group_index, gamma, lam, norm_by_std, std_scope="group", baselines=None, paths=None, pairs=None, components=None) -> AdvantageOutput:
    """GPG (Chu et al. 2025, Group Policy Gradient): α·(score − group mean) on every token, no
    std (the paper's F_norm = 1, as verl's), where α = B / (B − M) for the batch's B samples of
    which M are in groups whose samples all scored alike (or alone): the batch-mean gradient
    counts those as zeros, α scales it back to the mean over the samples that carry signal. The
    GPG authors' α (verl's counts the nonzero scores instead); α = 1 when no group compares."""
    scores = sequence_scores(token_rewards, response_mask)
    mean, _, size = group_stats(scores, group_index)
    _, inverse = torch.unique(group_index, return_inverse=True)
    groups = int(inverse.max()) + 1 if inverse.numel() else 0
    highest = torch.full((groups,), -torch.inf, dtype=scores.dtype).scatter_reduce(0, inverse, scores, "amax")
    lowest = torch.full((groups,), torch.inf, dtype=scores.dtype).scatter_reduce(0, inverse, scores, "amin")
    signal = (size > 1) & (highest[inverse] > lowest[inverse])  # exactly equal scores, not a std's rounding
    alpha = scores.numel() / int(signal.sum()) if signal.any() else 1.0
    adv = torch.where(signal, alpha * (scores - mean), 0)
    advantages = torch.where(response_mask, adv.unsqueeze(-1), 0)
    return AdvantageOutput(advantages, advantages.clone())


@ESTIMATORS.register("optimal_token_baseline")
def optimal_token_baseline(*, token_rewards, response_mask, values, group_index, gamma, lam, norm_by_std, std_scope="group", baselines=None, paths=None, pairs=None, components=None) -> AdvantageOutput:
    """The optimal token baseline (verl's optimal_token_baseline): each token's reward-to-go G_t
    (undiscounted) less a baseline of its prompt's group at its position t,
    B_t = Σ_i G_t·W_t / Σ_i W_t over the group's samples that reach t, each weighted by its
    path's W_t = Σ_{j≤t} (1 − 2π_j + Σπ²_j): the accumulated squared norm of the log-prob
    gradients in the logits (‖onehot − π‖², never below 0; rounding's negatives count as 0),
    the weights under which a baseline leaves the policy gradient the least variance. Positions
    count the policy's tokens in order (a tool's tokens are not positions: verl's
    tir_optimal_token_baseline). With importance weights ρ̄ on the update's loss, each token's
    term is ρ̄²·(1 − 2π + Σπ²), the variance it carries then. Groups of one: 0. `zero_tail`:
    where the group's one longest sample is alone (past the second longest), it takes no
    baseline — alone, its baseline is its own return and its advantage 0 — so those tokens
    carry their return."""
    if paths is None:
        raise ValueError("optimal_token_baseline needs each token's old log-prob and Σπ²")
    dtype = token_rewards.dtype
    returns = discounted_returns(token_rewards, response_mask, 1.0)
    weight = (1 - 2 * paths.old_logprobs.to(dtype).exp() + paths.sum_pi_squared.to(dtype)).clamp(min=0)
    if paths.is_weights is not None:
        weight = weight * paths.is_weights.to(dtype).square()
    path = torch.where(response_mask, torch.where(response_mask, weight, 0).cumsum(-1), 0)
    _, inverse = torch.unique(group_index, return_inverse=True)
    groups, width = (int(inverse.max()) + 1 if inverse.numel() else 0), token_rewards.shape[1]
    numerator = torch.zeros((groups, width), dtype=dtype).index_add_(0, inverse, returns * path)
    denominator = torch.zeros((groups, width), dtype=dtype).index_add_(0, inverse, path)
    baseline = (numerator / (denominator + 1e-8))[inverse]  # verl's epsilon: a path without weight takes baseline 0
    size = torch.zeros(groups, dtype=torch.long).index_add_(0, inverse, torch.ones_like(inverse))[inverse]
    if paths.zero_tail:
        lengths = response_mask.sum(-1)
        longest = torch.zeros(groups, dtype=lengths.dtype).scatter_reduce(0, inverse, lengths, "amax")[inverse]
        at_longest = lengths == longest
        count_longest = torch.zeros(groups, dtype=torch.long).index_add_(0, inverse, at_longest.long())[inverse]
        second = torch.zeros(groups, dtype=lengths.dtype).scatter_reduce(0, inverse, torch.where(at_longest, 0, lengths), "amax")[inverse]
        alone = at_longest & (count_longest == 1) & (size > 1)
        tail = alone.unsqueeze(-1) & (torch.arange(width) >= second.unsqueeze(-1))
        baseline = torch.where(tail, 0, baseline)
    advantages = torch.where(response_mask & (size > 1).unsqueeze(-1), returns - baseline, 0)
    return AdvantageOutput(advantages, returns)


@ESTIMATORS.register("online_dpo")
def online_dpo(*, token_rewards, response_mask, values, group_index, gamma, lam, norm_by_std, std_scope="group", baselines=None, paths=None, pairs=None, components=None) -> AdvantageOutput:
    """Online DPO (Guo et al., 2024, "Direct Language Model Alignment from Online AI Feedback";
    TRL's OnlineDPOTrainer) as advantages: each prompt's group makes preference pairs
    (`preference_rows`: its best-rewarded sample chosen and its worst rejected, or every two
    samples whose rewards differ), and every row gets, on each of its tokens, −∂L/∂(its summed
    log-prob) × its divisor / the pairs, L the sum of the pairs' preference losses
    (rlctl.algos.preference.dpo_losses with `pairs.loss`, β) at the sampling policy's log-probs.
    The update's surrogate −A·ratio, aggregated as its loss_agg_mode does, then has the gradient
    of the pairs' mean preference loss at its first optimizer step (ratio 1); rows in no pair
    get 0. Returns are the advantages."""
    if pairs is None:
        raise ValueError("online_dpo needs the policy's and the reference's log-probs")
    chosen, rejected = preference_rows(sequence_scores(token_rewards, response_mask), group_index, pairs.which)
    advantages = torch.zeros(response_mask.shape, dtype=torch.float64)
    if not len(chosen):
        return AdvantageOutput(advantages, advantages.clone())
    mask = response_mask.bool()
    logps, ref_logps, tokens = pair_sums(pairs, mask)
    sums = logps.clone().requires_grad_(True)
    losses, _, _ = dpo_losses(
        sums[chosen], sums[rejected], ref_logps[chosen], ref_logps[rejected], beta=pairs.beta, loss=pairs.loss, chosen_tokens=tokens[chosen], rejected_tokens=tokens[rejected],
    )
    (grad,) = torch.autograd.grad(losses.sum(), sums)
    per_row = -grad * pairs.divisors.double() / len(chosen)
    advantages = torch.where(mask, per_row.unsqueeze(-1), 0.0)
    return AdvantageOutput(advantages, advantages.clone())


def preference_rows(scores: torch.Tensor, group_index: torch.Tensor, which: str = "best_worst") -> tuple[torch.Tensor, torch.Tensor]:
    """Online DPO's pairs as (chosen rows, rejected rows): of each group whose scores differ, its
    best and its worst sample (the first of equals), or with `which = "all"` every two of its
    samples whose scores differ, the better one chosen."""
    values = scores.tolist()
    pairs = [pair for group in torch.unique(group_index) for pair in ranked_pairs(torch.nonzero(group_index == group).flatten().tolist(), values, which)]
    return torch.tensor([a for a, _ in pairs], dtype=torch.long), torch.tensor([b for _, b in pairs], dtype=torch.long)


def pair_sums(pairs: PreferencePairs, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's summed log-prob under the sampling policy and under the reference, and its token count."""
    return torch.where(mask, pairs.logprobs.double(), 0).sum(-1), torch.where(mask, pairs.ref_logprobs.double(), 0).sum(-1), mask.sum(-1)


def online_dpo_stats(token_rewards: torch.Tensor, response_mask: torch.Tensor, group_index: torch.Tensor, pairs: PreferencePairs) -> dict[str, float]:
    """Online DPO's pairs as TRL's OnlineDPOTrainer reports them, at the sampling policy: how
    many, their mean loss, the share whose chosen sample has the larger implicit reward
    β·(log π − log π_ref) (`accuracy`), and the mean difference of the two (`margin`)."""
    chosen, rejected = preference_rows(sequence_scores(token_rewards, response_mask), group_index, pairs.which)
    if not len(chosen):
        return {"dpo/pairs": 0.0}
    logps, ref_logps, tokens = pair_sums(pairs, response_mask.bool())
    losses, chosen_reward, rejected_reward = dpo_losses(
        logps[chosen], logps[rejected], ref_logps[chosen], ref_logps[rejected], beta=pairs.beta, loss=pairs.loss, chosen_tokens=tokens[chosen], rejected_tokens=tokens[rejected],
    )
    return {
        "dpo/pairs": float(len(chosen)), "dpo/loss": float(losses.mean()), "dpo/accuracy": float((chosen_reward > rejected_reward).double().mean()),
        "dpo/margin": float((chosen_reward - rejected_reward).mean()),
    }


def aggregation_divisors(response_mask: torch.Tensor, mode: str, horizon: int) -> torch.Tensor:
    """Each row's divisor of a token's loss in the update's aggregation over this batch as one
    mini-batch (rlctl.algos.losses.aggregate): ∂loss/∂(a token's loss) = 1 / the divisor."""
    mask = response_mask.bool()
    rows = mask.shape[0]
    if mode == "token-mean":
        return torch.full((rows,), float(max(int(mask.sum()), 1)), dtype=torch.float64)
    if mode == "seq-mean-token-sum":
        return torch.full((rows,), float(max(rows, 1)), dtype=torch.float64)
    if mode == "seq-mean-token-mean":
        return mask.sum(-1).clamp(min=1).double() * max(rows, 1)
    if mode == "seq-mean-token-sum-norm":
        return torch.full((rows,), float(max(rows, 1) * max(horizon, 1)), dtype=torch.float64)
    raise ValueError(f"unknown loss_agg_mode {mode!r}")
