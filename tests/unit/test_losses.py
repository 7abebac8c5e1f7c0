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
    "k3": lambda lp, ref: math.exp(ref - lp) - (ref - lp) - 1,
}


@pytest.mark.parametrize("name", sorted(REF_KL))
def test_kl_estimators_match_formula(name):
    _, _, r = tensors()
    lp, ref = r(0.5) - 1, r(0.5) - 1
    out = KL_ESTIMATORS.get(name)(logprobs=lp, ref_logprobs=ref)
    expected = [[REF_KL[name](a, b) for a, b in zip(ra, rb)] for ra, rb in zip(lp.tolist(), ref.tolist())]
    np.testing.assert_allclose(out.numpy(), expected, atol=TOL, rtol=0)


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
