"""KL estimators, the PPO policy loss, the clipped value loss and every aggregation mode
against explicit loops in float64 (1e-6); the adaptive KL controller."""

import math

import numpy as np
import pytest
import torch

from rlctl.algos.kl import KL_ESTIMATORS, KLControllerState, next_kl_state
from rlctl.algos.losses import LOSS_AGG_MODES, aggregate, clipped_value_loss, ppo_policy_loss

TOL = 1e-6


def tensors(seed=0, B=5, T=7):
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 3, 1, 5, 6][:B]
    mask = torch.arange(T).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    def r(scale=1.0):
        return torch.randn(B, T, generator=g, dtype=torch.float64) * scale
    return mask, lengths, r


REF_KL = {
    "k1": lambda lp, ref: lp - ref,
    "abs": lambda lp, ref: abs(lp - ref),
    "k2": lambda lp, ref: 0.5 * (lp - ref) ** 2,
    "k3": lambda lp, ref: math.exp(ref - lp) - (ref - lp) - 1,  # inside its bound here (see below)
}


@pytest.mark.parametrize("name", sorted(REF_KL))
def test_kl_estimators_match_formula(name):
    _, _, r = tensors()
    lp, ref = r(0.5) - 1, r(0.5) - 1
    out = KL_ESTIMATORS.get(name)(logprobs=lp, ref_logprobs=ref)
    expected = [[REF_KL[name](a, b) for a, b in zip(ra, rb)] for ra, rb in zip(lp.tolist(), ref.tolist())]
    np.testing.assert_allclose(out.numpy(), expected, atol=TOL, rtol=0)


def ref_bounded_k3(lp, ref):
    """verl's low_var_kl in float64: log-ratio clamped to ±20, value to [-10, 10]."""
    x = min(max(ref - lp, -20.0), 20.0)
    return min(max(math.exp(x) - x - 1, -10.0), 10.0)


@pytest.mark.parametrize("alias,name", [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3"), ("kl+", "k1+"), ("low_var_kl+", "k3+")])
def test_verl_names_are_the_same_estimators(alias, name):
    _, _, r = tensors(seed=3)
    lp, ref = r(2.0) - 1, r(2.0) - 1
    assert torch.equal(KL_ESTIMATORS.get(alias)(logprobs=lp, ref_logprobs=ref), KL_ESTIMATORS.get(name)(logprobs=lp, ref_logprobs=ref))


def test_k3_is_bounded_like_verls_low_var_kl_and_has_no_gradient_past_the_bound():
    # ref - lp: inside the bound, just inside and past it on both sides, past the ±20 log-ratio clamp
    gaps = [0.5, 2.0, 2.6, 2.7, 3.0, 25.0, -5.0, -12.0, -30.0]
    ref = torch.zeros(len(gaps), dtype=torch.float64)
    lp = (ref - torch.tensor(gaps, dtype=torch.float64)).requires_grad_()
    out = KL_ESTIMATORS.get("k3")(logprobs=lp, ref_logprobs=ref)
    np.testing.assert_allclose(out.detach().numpy(), [ref_bounded_k3(a, b) for a, b in zip(lp.tolist(), ref.tolist())], atol=TOL, rtol=0)
    assert float(out.detach().max()) == 10.0 and torch.isfinite(out.detach()).all()
    out.sum().backward()
    inside = [abs(ref_bounded_k3(g_lp, 0.0)) < 10.0 for g_lp in lp.tolist()]
    for grad, within, gap in zip(lp.grad.tolist(), inside, gaps):
        if within:  # d/dlp [e^(ref-lp) - (ref-lp) - 1] = 1 - e^(ref-lp)
            assert grad == pytest.approx(1 - math.exp(gap), abs=1e-9)
        else:
            assert grad == 0.0


@pytest.mark.parametrize("name", ["k1+", "k3+", "abs+"])
def test_straight_through_estimators_have_the_value_of_theirs_and_the_gradient_of_k2(name):
    _, _, r = tensors(seed=5)
    ref = r(0.5) - 1
    lp = (r(0.5) - 1).requires_grad_()
    out = KL_ESTIMATORS.get(name)(logprobs=lp, ref_logprobs=ref)
    base = KL_ESTIMATORS.get(name[:-1])(logprobs=lp.detach(), ref_logprobs=ref)
    torch.testing.assert_close(out.detach(), base, atol=1e-12, rtol=0)
    out.sum().backward()
    torch.testing.assert_close(lp.grad, (lp - ref).detach(), atol=1e-12, rtol=0)  # d/dlp ½(lp - ref)²


def test_an_extreme_log_ratio_gives_a_finite_ppo_loss():
    lp = torch.tensor([[60.0, -60.0, 0.1]], dtype=torch.float64)
    old = torch.zeros_like(lp)
    out = ppo_policy_loss(
        logprobs=lp, old_logprobs=old, advantages=torch.tensor([[-1.0, 1.0, 1.0]], dtype=torch.float64),
        response_mask=torch.ones_like(lp, dtype=torch.bool), clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=0.0,
    )
    assert torch.isfinite(out.loss).all() and torch.isfinite(out.approx_kl).all()
    assert out.approx_kl.tolist()[0][:2] == [-20.0, 20.0]  # the log-ratio clamped to ±20, as verl's ppo_kl


def ref_ppo_token(lp, old, adv, low, high, c):
    ratio = math.exp(lp - old)
    loss = max(-adv * ratio, -adv * min(max(ratio, 1 - low), 1 + high))
    if adv < 0 and c > 1:
        loss = min(loss, -adv * c)
    return loss


@pytest.mark.parametrize("c", [3.0, 0.0])
def test_ppo_policy_loss_matches_loop(c):
    mask, lengths, r = tensors(1)
    lp, old, adv = r(0.3), r(0.3), r(2.0)
    out = ppo_policy_loss(logprobs=lp, old_logprobs=old, advantages=adv, response_mask=mask, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=c)
    for i, n in enumerate(lengths):
        expected = [ref_ppo_token(lp[i, t].item(), old[i, t].item(), adv[i, t].item(), 0.2, 0.28, c) for t in range(n)]
        np.testing.assert_allclose(out.loss[i, :n].numpy(), expected, atol=TOL, rtol=0)
    assert (out.loss[~mask] == 0).all() and out.clipped.any()


def test_dual_clip_caps_the_loss_for_negative_advantages():
    lp, old = torch.tensor([[5.0]], dtype=torch.float64), torch.tensor([[0.0]], dtype=torch.float64)
    adv = torch.tensor([[-1.0]], dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    out = ppo_policy_loss(logprobs=lp, old_logprobs=old, advantages=adv, response_mask=mask, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
    assert out.loss.item() == pytest.approx(3.0)
    assert out.dual_clipped.item() and not out.clipped.item()  # verl's pg_clipfrac_lower, not its pg_clipfrac


def test_clipped_value_loss_matches_loop():
    mask, lengths, r = tensors(2)
    v, old, ret = r(), r(), r()
    loss, _ = clipped_value_loss(values=v, old_values=old, returns=ret, response_mask=mask, cliprange_value=0.2)
    for i, n in enumerate(lengths):
        for t in range(n):
            vc = old[i, t] + min(max(v[i, t] - old[i, t], -0.2), 0.2)
            expected = 0.5 * max((v[i, t] - ret[i, t]) ** 2, (vc - ret[i, t]) ** 2)
            assert loss[i, t].item() == pytest.approx(float(expected), abs=TOL)


def ref_aggregate(loss, lengths, mode, horizon):
    rows = [loss[i][:n] for i, n in enumerate(lengths)]
    if mode == "token-mean":
        return sum(map(sum, rows)) / sum(lengths)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / len(rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    return sum(sum(r) for r in rows) / (len(rows) * horizon)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregation_matches_loop_and_splits_exactly(mode):
    mask, lengths, r = tensors(3)
    loss = r()
    whole = aggregate(loss=loss, response_mask=mask, mode=mode, batch_tokens=sum(lengths), batch_seqs=5, horizon=7)
    assert whole.item() == pytest.approx(ref_aggregate(loss.tolist(), lengths, mode, 7), abs=TOL)
    parts = sum(
        aggregate(loss=loss[s], response_mask=mask[s], mode=mode, batch_tokens=sum(lengths), batch_seqs=5, horizon=7)
        for s in (slice(0, 2), slice(2, 3), slice(3, 5))
    )
    assert parts.item() == pytest.approx(whole.item(), abs=1e-12)


def test_adaptive_kl_controller_moves_toward_target():
    state = KLControllerState(0.1)
    up = next_kl_state(state, controller="adaptive", observed_kl=1.0, batch_sequences=100, target=0.1, horizon=1000)
    down = next_kl_state(state, controller="adaptive", observed_kl=0.0, batch_sequences=100, target=0.1, horizon=1000)
    assert up.kl_coef == pytest.approx(0.1 * (1 + 0.2 * 0.1)) and down.kl_coef == pytest.approx(0.1 * (1 - 0.2 * 0.1))
    assert next_kl_state(state, controller="fixed", observed_kl=9.0, batch_sequences=1, target=0.1, horizon=1).kl_coef == 0.1


def ref_gspo_token_losses(lp, old, adv, lengths, low, high):
    """Per-token GSPO losses in float64: one ratio per sequence from its mean log-ratio."""
    out = []
    for i, n in enumerate(lengths):
        s = math.exp(sum(lp[i][t] - old[i][t] for t in range(n)) / n)
        row = [max(-adv[i][t] * s, -adv[i][t] * min(max(s, 1 - low), 1 + high)) for t in range(n)]
        out.append(row + [0.0] * (len(lp[i]) - n))
    return out


def test_gspo_loss_matches_loop_and_each_token_gets_its_sequences_ratio_as_gradient():
    from rlctl.algos.losses import gspo_policy_loss

    mask, lengths, r = tensors(seed=11)
    old = r(0.3) - 2
    lp = (old + r(0.002)).requires_grad_()  # GSPO's regime: sequence ratios within ~1e-3 of 1
    adv = r(1.0)
    low, high = 3e-4, 4e-4
    out = gspo_policy_loss(logprobs=lp, old_logprobs=old, advantages=adv, response_mask=mask, clip_ratio_low=low, clip_ratio_high=high)
    expected = ref_gspo_token_losses(lp.tolist(), old.tolist(), adv.tolist(), lengths, low, high)
    np.testing.assert_allclose(out.loss.detach().numpy(), expected, atol=TOL, rtol=0)
    out.loss.sum().backward()
    for i, n in enumerate(lengths):
        s = math.exp(sum(lp[i][t].item() - old[i][t].item() for t in range(n)) / n)
        for t in range(n):
            a = adv[i][t].item()
            inside = (1 - low) <= s <= (1 + high) or (a > 0 and s < 1 - low) or (a < 0 and s > 1 + high)
            assert lp.grad[i][t].item() == pytest.approx(-a * s if inside else 0.0, abs=1e-9)
        assert (lp.grad[i][n:] == 0).all()


def test_gspo_at_the_start_of_a_step_is_minus_the_advantage_on_every_token():
    from rlctl.algos.losses import gspo_policy_loss

    mask, lengths, r = tensors(seed=12)
    lp, adv = r(0.5) - 1, r(1.0)
    out = gspo_policy_loss(logprobs=lp, old_logprobs=lp.clone(), advantages=adv, response_mask=mask, clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    torch.testing.assert_close(out.loss, torch.where(mask, -adv, 0), atol=1e-12, rtol=0)
    assert not out.clipped.any()


def test_cispo_gives_every_token_its_clipped_weight_times_the_advantage_as_gradient():
    """CISPO: value -A·clip(r), gradient -A·clip(r)·∇log p on every token — where PPO's clip
    zeroes the gradient of a token past the bound, CISPO bounds it instead."""
    from rlctl.algos.losses import cispo_policy_loss, ppo_policy_loss

    mask, lengths, r = tensors(seed=14)
    old = r(0.3) - 2
    lp = (old + r(0.6)).requires_grad_()  # ratios well past 1 ± 0.28 on many tokens
    adv = r(1.0)
    low, high = 1.0, 0.28  # the paper's: no lower bound, a tuned upper one
    out = cispo_policy_loss(logprobs=lp, old_logprobs=old, advantages=adv, response_mask=mask, clip_ratio_low=low, clip_ratio_high=high)
    out.loss.sum().backward()
    past_the_bound = 0
    for i, n in enumerate(lengths):
        for t in range(n):
            ratio, a = math.exp(lp[i][t].item() - old[i][t].item()), adv[i][t].item()
            weight = min(max(ratio, 1 - low), 1 + high)
            assert out.loss[i][t].item() == pytest.approx(-a * weight, abs=1e-6)
            assert lp.grad[i][t].item() == pytest.approx(-a * weight, abs=1e-6)
            assert out.clipped[i][t].item() == (ratio > 1 + high)
            past_the_bound += ratio > 1 + high and a > 0
        assert (lp.grad[i][n:] == 0).all() and (out.loss[i][n:] == 0).all()
    assert past_the_bound >= 2  # tokens past the bound with A > 0: PPO gives them no gradient, CISPO a bounded one
    lp_ppo = lp.detach().clone().requires_grad_()
    ppo_policy_loss(logprobs=lp_ppo, old_logprobs=old, advantages=adv, response_mask=mask, clip_ratio_low=0.2, clip_ratio_high=high, clip_ratio_c=0.0).loss.sum().backward()
    zeroed = (lp_ppo.grad == 0) & mask & (adv > 0)
    assert zeroed.any() and (lp.grad[zeroed] != 0).all()


def test_kl_cov_holds_the_tokens_of_largest_covariance_with_a_kl_term_and_clips_nothing():
    """KL-Cov: -A·r on every token (no clip), plus coef·|log r| on the top ratio of tokens by
    (A - mean A)(log p - mean log p) over the pass's tokens, computed here in plain Python."""
    from rlctl.algos.losses import kl_cov_policy_loss

    mask, lengths, r = tensors(seed=15)
    old = r(0.3) - 2
    lp = (old + r(0.5)).requires_grad_()
    adv = r(1.0)
    out = kl_cov_policy_loss(logprobs=lp, old_logprobs=old, advantages=adv, response_mask=mask, kl_cov_ratio=0.2, kl_cov_coef=0.5)
    tokens = [(i, t) for i, n in enumerate(lengths) for t in range(n)]
    mean_a = sum(adv[i][t].item() for i, t in tokens) / len(tokens)
    mean_p = sum(lp[i][t].item() for i, t in tokens) / len(tokens)
    covariance = {(i, t): (adv[i][t].item() - mean_a) * (lp[i][t].item() - mean_p) for i, t in tokens}
    held = set(sorted(tokens, key=lambda k: -covariance[k])[: int(len(tokens) * 0.2)])
    for i, t in tokens:
        log_ratio = lp[i][t].item() - old[i][t].item()
        expected = -adv[i][t].item() * math.exp(log_ratio) + (0.5 * abs(log_ratio) if (i, t) in held else 0.0)
        assert out.loss[i][t].item() == pytest.approx(expected, abs=1e-9)
        assert out.clipped[i][t].item() == ((i, t) in held)
    assert (out.loss[~mask] == 0).all() and len(held) == 4
    tiny = kl_cov_policy_loss(logprobs=lp, old_logprobs=old, advantages=adv, response_mask=mask, kl_cov_ratio=1e-9)
    assert int(tiny.clipped.sum()) == 1  # one token at least, as verl


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_is_weights_are_truncated_ratios_trainer_over_engine(level):
    from rlctl.algos.losses import rollout_is_weights

    mask, lengths, r = tensors(seed=13)
    old, rollout = r(0.5) - 2, r(0.5) - 2
    out = rollout_is_weights(old_logprobs=old, rollout_logprobs=rollout, response_mask=mask, level=level, threshold=2.0)
    for i, n in enumerate(lengths):
        if level == "token":
            expected = [min(math.exp(old[i][t].item() - rollout[i][t].item()), 2.0) for t in range(n)]
        else:
            expected = [min(math.exp(sum(old[i][t].item() - rollout[i][t].item() for t in range(n))), 2.0)] * n
        np.testing.assert_allclose(out[i, :n].numpy(), expected, atol=TOL, rtol=0)
    assert (out[~mask] == 0).all()


def ref_gmpo_sequence_losses(lp, old, adv, lengths, low, high):
    """Per-sequence GMPO losses in float64: −(mean advantage) × the geometric mean of the
    tokens' ratios, each log-ratio clipped the pessimistic way for its advantage's sign."""
    out = []
    for i, n in enumerate(lengths):
        clipped = []
        for t in range(n):
            x = lp[i][t] - old[i][t]
            clipped.append(min(x, high) if adv[i][t] > 0 else max(x, -low) if adv[i][t] < 0 else 0.0)
        out.append(-sum(adv[i][:n]) / n * math.exp(sum(clipped) / n))
    return out


def test_gmpo_is_minus_the_mean_advantage_times_the_clipped_geometric_mean_ratio_per_sequence():
    from rlctl.algos.losses import gmpo_policy_loss

    mask, lengths, r = tensors(seed=13)
    old = r(0.5) - 2
    lp = (old + r(0.6)).requires_grad_()  # log-ratios up to ~±1.5: some beyond the 0.4 clip, some inside
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0], dtype=torch.float64)
    adv = (sign.unsqueeze(-1) * (0.5 + r(0.3).abs()))  # one sign per sequence, as an outcome advantage
    low = high = 0.4
    out = gmpo_policy_loss(logprobs=lp, old_logprobs=old, advantages=adv, response_mask=mask, clip_ratio_low=low, clip_ratio_high=high)
    expected = ref_gmpo_sequence_losses(lp.tolist(), old.tolist(), adv.tolist(), lengths, low, high)
    for i, n in enumerate(lengths):  # every token carries its sequence's loss
        np.testing.assert_allclose(out.loss[i, :n].detach().numpy(), [expected[i]] * n, atol=TOL, rtol=0)
        assert (out.loss[i, n:] == 0).all()
    mean = aggregate(loss=out.loss, response_mask=mask, mode="seq-mean-token-mean", batch_tokens=sum(lengths), batch_seqs=5, horizon=7)
    assert mean.item() == pytest.approx(sum(expected) / 5, abs=TOL)  # verl's mean over sequences
    mean.backward()
    for i, n in enumerate(lengths):
        for t in range(n):
            x, a = lp[i][t].item() - old[i][t].item(), adv[i][t].item()
            kept = (x <= high) if a > 0 else (x >= -low)  # the pessimistic clip passes the gradient only where it did not bind
            assert lp.grad[i][t].item() == pytest.approx(expected[i] / n / 5 if kept else 0.0, abs=1e-9)
        x = lp[i, :n].detach() - old[i, :n]  # clipped: outside [-low, high], under clipped (A > 0) or dual_clipped (A < 0)
        assert torch.equal((out.clipped if sign[i] > 0 else out.dual_clipped)[i, :n], (x > high) | (x < -low))
    assert out.clipped.any() and out.dual_clipped.any()


def test_gmpo_at_the_start_of_a_step_is_minus_the_mean_advantage_on_every_token():
    from rlctl.algos.losses import gmpo_policy_loss

    mask, lengths, r = tensors(seed=14)
    lp, adv = r(0.5) - 1, r(1.0)
    out = gmpo_policy_loss(logprobs=lp, old_logprobs=lp.clone(), advantages=adv, response_mask=mask, clip_ratio_low=0.4, clip_ratio_high=0.4)
    for i, n in enumerate(lengths):
        torch.testing.assert_close(out.loss[i, :n], (-adv[i, :n].mean()).expand(n), atol=1e-12, rtol=0)
    assert not out.clipped.any() and not out.dual_clipped.any()


def test_the_top_entropy_quantile_keeps_the_passes_highest_entropy_tokens():
    """TRL's case: 10 tokens, a quantile of 0.2 keeps the two of highest entropy (padding never)."""
    from rlctl.algos.losses import high_entropy_tokens

    entropy = torch.tensor([[0.1, 0.9, 0.3, 0.5, 7.0, 7.0], [0.2, 0.8, 0.4, 0.6, 0.7, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)  # 7.0s are padding
    kept = high_entropy_tokens(entropy, mask, 0.2)
    assert kept.tolist() == [[False, True, False, False, False, False], [False, False, False, False, False, True]]
    assert torch.equal(high_entropy_tokens(entropy, mask, 1.0), mask)
    assert high_entropy_tokens(entropy, mask, 0.5).sum() == 5


def test_clip_cov_takes_the_gradient_of_a_few_drawn_tokens_of_high_covariance_and_is_ppo_elsewhere():
    """Clip-Cov: PPO's clipped surrogate, except on max(1, ratio × tokens) tokens drawn from those
    PPO's clip left alone whose covariance lies in (lb, ub): no loss, no gradient there; the same
    pass draws the same tokens again (a replay), and an empty band is PPO."""
    from rlctl.algos.losses import clip_cov_policy_loss, ppo_policy_loss

    mask, lengths, r = tensors(seed=16)
    old = r(0.3) - 2
    lp = (old + r(0.3)).requires_grad_()
    adv = r(2.0)
    settings = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_cov_ratio": 0.1, "clip_cov_lb": 0.05, "clip_cov_ub": 5.0}
    out = clip_cov_policy_loss(logprobs=lp, old_logprobs=old, advantages=adv, response_mask=mask, **settings)
    ppo = ppo_policy_loss(logprobs=lp, old_logprobs=old, advantages=adv, response_mask=mask, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=0.0)
    tokens = [(i, t) for i, n in enumerate(lengths) for t in range(n)]
    mean_a = sum(adv[i][t].item() for i, t in tokens) / len(tokens)
    mean_p = sum(lp[i][t].item() for i, t in tokens) / len(tokens)
    band = {(i, t) for i, t in tokens if 0.05 < (adv[i][t].item() - mean_a) * (lp[i][t].item() - mean_p) < 5.0 and not ppo.clipped[i][t]}
    drawn = {(i, t) for i, t in tokens if out.clipped[i][t] and not ppo.clipped[i][t]}
    assert len(band) > 4 and drawn <= band and len(drawn) == max(1, int(len(tokens) * 0.1))
    out.loss.sum().backward()
    with_draw = lp.grad.clone()
    lp.grad = None
    ppo.loss.sum().backward()
    for i, t in tokens:
        if (i, t) in drawn:
            assert out.loss[i][t].item() == 0.0 and with_draw[i][t].item() == 0.0
        else:
            assert out.loss[i][t].item() == pytest.approx(ppo.loss[i][t].item(), abs=1e-12)
            assert with_draw[i][t].item() == pytest.approx(lp.grad[i][t].item(), abs=1e-12)
    again = clip_cov_policy_loss(logprobs=lp, old_logprobs=old, advantages=adv, response_mask=mask, **settings)
    assert torch.equal(again.clipped, out.clipped)  # seeded by the pass's old log-probs: a replay draws alike
    empty = clip_cov_policy_loss(logprobs=lp, old_logprobs=old, advantages=adv, response_mask=mask, **{**settings, "clip_cov_lb": 5.0})
    assert torch.equal(empty.loss, ppo.loss) and torch.equal(empty.clipped, ppo.clipped)


def test_gpg_is_minus_the_advantage_times_the_log_prob_and_its_gradient_minus_the_advantage():
    from rlctl.algos.losses import gpg_policy_loss, ppo_policy_loss

    mask, lengths, r = tensors(seed=15)
    old = r(0.5) - 2
    lp = (old + r(2.0)).requires_grad_()  # far off-policy: PPO would clip, GPG has no ratio
    adv = r(1.0)
    out = gpg_policy_loss(logprobs=lp, old_logprobs=old, advantages=adv, response_mask=mask)
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(out.loss[i, :n].detach().numpy(), [-adv[i][t].item() * lp[i][t].item() for t in range(n)], atol=TOL, rtol=0)
        np.testing.assert_allclose(out.approx_kl[i, :n].detach().numpy(), (old[i, :n] - lp[i, :n].detach()).numpy(), atol=TOL, rtol=0)
    assert not out.clipped.any() and not out.dual_clipped.any() and (out.loss[~mask] == 0).all()
    out.loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.where(mask, -adv, 0), atol=1e-12, rtol=0)
    on_policy = old.clone().requires_grad_()  # on the data's own policy its gradient is PPO's
    ppo_policy_loss(logprobs=on_policy, old_logprobs=old, advantages=adv, response_mask=mask, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0).loss.sum().backward()
    torch.testing.assert_close(on_policy.grad, lp.grad, atol=1e-12, rtol=0)


def test_sapo_gates_each_tokens_advantage_smoothly_by_its_ratio_with_the_signs_temperature():
    from rlctl.algos.losses import ppo_policy_loss, sapo_policy_loss

    mask, lengths, r = tensors(seed=16)
    old = r(0.5) - 2
    lp = (old + r(0.8)).requires_grad_()
    adv = r(1.0)
    out = sapo_policy_loss(logprobs=lp, old_logprobs=old, advantages=adv, response_mask=mask, sapo_tau_pos=1.0, sapo_tau_neg=1.5)
    out.loss.sum().backward()
    for i, n in enumerate(lengths):
        for t in range(n):
            a, ratio = adv[i][t].item(), math.exp(lp[i][t].item() - old[i][t].item())
            tau = 1.0 if a > 0 else 1.5
            sig = 1 / (1 + math.exp(-tau * (ratio - 1)))
            assert out.loss[i][t].item() == pytest.approx(-a * sig * 4 / tau, abs=1e-9)
            assert lp.grad[i][t].item() == pytest.approx(-a * 4 * sig * (1 - sig) * ratio, abs=1e-9)  # d/dlog p of the gate
    assert not out.clipped.any() and (out.loss[~mask] == 0).all()
    at_one = old.clone().requires_grad_()  # at r = 1 the gradient is PPO's, whatever the temperatures
    sapo_policy_loss(logprobs=at_one, old_logprobs=old, advantages=adv, response_mask=mask, sapo_tau_pos=2.0, sapo_tau_neg=3.0).loss.sum().backward()
    ppo = old.clone().requires_grad_()
    ppo_policy_loss(logprobs=ppo, old_logprobs=old, advantages=adv, response_mask=mask, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0).loss.sum().backward()
    torch.testing.assert_close(at_one.grad, ppo.grad, atol=1e-12, rtol=0)


def vespo_weight(log_w, advantage, k_pos, lambda_pos, k_neg, lambda_neg):
    """φ(w) = e^λ · w^k · e^(−λw), written as the paper's gamma weight (normalised to φ(1) = 1)."""
    k, lam = (k_pos, lambda_pos) if advantage >= 0 else (k_neg, lambda_neg)
    log_w = min(max(log_w, math.log(1e-8)), 20.0)
    w = math.exp(log_w)
    return math.exp(lam) * w**k * math.exp(-lam * w)


def test_vespo_weighs_each_sequences_gradient_by_a_gamma_function_of_its_whole_importance_weight():
    from rlctl.algos.losses import ppo_policy_loss, vespo_policy_loss

    mask, lengths, r = tensors(seed=17)
    old = r(0.5) - 2
    lp = (old + r(0.15)).requires_grad_()  # sequences a few tenths of a nat from the old policy: w from ~0.5 to ~2
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5, 0.0], dtype=torch.float64).unsqueeze(1).expand(-1, 7).clone()  # one advantage a sequence, as GRPO's
    settings = {"vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0}
    out = vespo_policy_loss(logprobs=lp, old_logprobs=old, advantages=adv, response_mask=mask, **settings)
    out.loss.sum().backward()
    for i, n in enumerate(lengths):
        log_w = sum(lp[i][t].item() - old[i][t].item() for t in range(n))
        phi = vespo_weight(log_w, adv[i][0].item(), 2.0, 3.0, 3.0, 2.0)
        assert out.weight[i].item() == pytest.approx(phi, rel=1e-9)
        for t in range(n):  # valued −A·φ, its gradient −A·φ·∇log p: φ carries none
            assert out.loss[i][t].item() == pytest.approx(-adv[i][t].item() * phi, abs=1e-9)
            assert lp.grad[i][t].item() == pytest.approx(-adv[i][t].item() * phi, abs=1e-9)
    assert all(abs(out.weight[i].item() - 1) > 0.01 for i in range(5))  # each sequence moved off the old policy: its weight is not 1
    assert not out.clipped.any() and (out.loss[~mask] == 0).all()
    at_one = old.clone().requires_grad_()  # on the old policy w = 1, φ = 1: PPO's gradient
    vespo_policy_loss(logprobs=at_one, old_logprobs=old, advantages=adv, response_mask=mask, **settings).loss.sum().backward()
    ppo = old.clone().requires_grad_()
    ppo_policy_loss(logprobs=ppo, old_logprobs=old, advantages=adv, response_mask=mask, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0).loss.sum().backward()
    torch.testing.assert_close(at_one.grad, ppo.grad, atol=1e-12, rtol=0)
    # the rollout's correction joins w: an engine 0.3 nats below the old policy on a sequence is w·e^0.3
    shifted = torch.full((5, 1), 0.3, dtype=torch.float64)
    moved = vespo_policy_loss(logprobs=old, old_logprobs=old, advantages=adv, response_mask=mask, behaviour_log_weight=shifted, **settings)
    for i in range(4):
        assert moved.weight[i].item() == pytest.approx(vespo_weight(0.3, adv[i][0].item(), 2.0, 3.0, 3.0, 2.0), rel=1e-9)
    far = vespo_policy_loss(logprobs=old + 40, old_logprobs=old, advantages=adv, response_mask=mask, **settings)  # w held at e^20: φ is 0, never NaN
    assert torch.isfinite(far.loss).all() and (far.weight[:4] == 0).all()


def test_the_off_policy_sequence_mask_drops_only_negative_tokens_of_sequences_that_drifted_past_the_threshold():
    from rlctl.algos.losses import off_policy_sequences

    mask, lengths, r = tensors(seed=18)
    lp = r(0.3) - 3
    drift = torch.tensor([0.8, 0.8, 0.2, -1.0, 0.8], dtype=torch.float64).unsqueeze(1)  # each sequence's mean log(π_rollout/π)
    behaviour = lp + drift + r(0.01)
    adv = r(1.0)
    kept = off_policy_sequences(logprobs=lp, behaviour_logprobs=behaviour, advantages=adv, response_mask=mask, threshold=0.5)
    for i, n in enumerate(lengths):
        mean_kl = sum(behaviour[i][t].item() - lp[i][t].item() for t in range(n)) / n
        for t in range(7):
            expected = t < n and (adv[i][t].item() >= 0 or mean_kl <= 0.5)
            assert bool(kept[i][t]) == expected
    assert (~kept & mask & (adv < 0)).any() and (kept & (adv < 0)).any()  # this draw has both kinds


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_a_sequences_log_weight_is_its_tokens_summed_or_its_one_weight(level):
    from rlctl.algos.losses import rollout_is_weights, sequence_log_weights

    mask, lengths, r = tensors(seed=19)
    old, rollout = r(0.3) - 2, r(0.3) - 2
    weights = rollout_is_weights(old_logprobs=old, rollout_logprobs=rollout, response_mask=mask, level=level, threshold=1.5)
    logs = sequence_log_weights(weights, mask, level)
    for i, n in enumerate(lengths):
        terms = [min(old[i][t].item() - rollout[i][t].item(), math.log(1.5)) for t in range(n)]
        expected = sum(terms) if level == "token" else min(sum(old[i][t].item() - rollout[i][t].item() for t in range(n)), math.log(1.5))
        assert logs[i][0].item() == pytest.approx(expected, abs=1e-9)


def test_entropy_shaping_raises_each_advantage_by_its_tokens_entropy_at_most_a_share_of_its_size():
    from rlctl.algos.losses import entropy_shaped_advantages

    mask, lengths, r = tensors(seed=20)
    adv = r(1.0)
    adv[0, 0] = 0.0
    entropy = r(1.0).abs().requires_grad_()
    shaped = entropy_shaped_advantages(adv, entropy, alpha=0.4, kappa=2.0)
    for i in range(5):
        for t in range(7):
            a, h = adv[i][t].item(), entropy[i][t].item()
            assert shaped[i][t].item() == pytest.approx(a + min(0.4 * h, abs(a) / 2), abs=1e-12)
    assert (torch.sign(shaped) == torch.sign(adv)).all() and shaped[0, 0] == 0  # no sign flips; zero stays zero
    assert not shaped.requires_grad  # the entropy weighs, it is not trained through
