"""Each advantage estimator against a straightforward loop implementation (float64, 1e-6),
plus the masked-GAE invariance property and the defined result for groups of one."""

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlctl.algos.advantages import ESTIMATORS, PathWeights

TOL = 1e-6


def random_batch(seed=0, B=7, T=6, groups=(0, 0, 0, 1, 1, 2, 3)):
    g = torch.Generator().manual_seed(seed)
    lengths = [6, 3, 1, 5, 4, 2, 6][:B]
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    return rewards, mask, values, torch.tensor(groups[:B]), lengths


def call(name, rewards, mask, values, groups, gamma=0.9, lam=0.8, norm_by_std=True, std_scope="group", baselines=None, paths=None, pairs=None):
    return ESTIMATORS.get(name)(
        token_rewards=rewards, response_mask=mask, values=values, group_index=groups, gamma=gamma, lam=lam, norm_by_std=norm_by_std, std_scope=std_scope,
        baselines=baselines, paths=paths, pairs=pairs,
    )


def policy_statistics(seed, mask, vocab=5, **settings):
    """What score's policy forward gives the optimal token baseline: each token's log-prob and
    its distribution's Σπ², from random logits (junk at masked positions)."""
    g = torch.Generator().manual_seed(seed + 100)
    probs = torch.softmax(torch.randn(*mask.shape, vocab, generator=g, dtype=torch.float64) * 2, dim=-1)
    tokens = torch.randint(0, vocab, mask.shape, generator=g)
    logp = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).log()
    junk = torch.randn(mask.shape, generator=g, dtype=torch.float64) * 50
    return PathWeights(torch.where(mask, logp, junk), torch.where(mask, probs.square().sum(-1), junk), **settings)


# -- reference implementations: plain Python over valid tokens only --------------------------


def ref_whiten(rows):
    flat = [x for row in rows for x in row]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    return [[(x - mean) / math.sqrt(var + 1e-8) for x in row] for row in rows]


def ref_gae(rewards, values, lengths, gamma, lam):
    advs, rets = [], []
    for i, n in enumerate(lengths):
        adv = [0.0] * n
        last = 0.0
        for t in reversed(range(n)):
            next_v = values[i][t + 1] if t + 1 < n else 0.0
            delta = rewards[i][t] + gamma * next_v - values[i][t]
            last = delta + gamma * lam * last
            adv[t] = last
        advs.append(adv)
        rets.append([a + values[i][t] for t, a in enumerate(adv)])
    return ref_whiten(advs), rets


def ref_scores(rewards, lengths):
    return [sum(rewards[i][:n]) for i, n in enumerate(lengths)]


def ref_grpo(rewards, lengths, groups, norm_by_std, std_scope="group"):
    scores = ref_scores(rewards, lengths)
    batch_mean = sum(scores) / len(scores)
    batch_std = math.sqrt(sum((s - batch_mean) ** 2 for s in scores) / (len(scores) - 1))
    out = []
    for i, n in enumerate(lengths):
        members = [scores[j] for j in range(len(scores)) if groups[j] == groups[i]]
        if len(members) == 1:
            out.append([0.0] * n)
            continue
        mean = sum(members) / len(members)
        std = math.sqrt(sum((s - mean) ** 2 for s in members) / (len(members) - 1)) if std_scope == "group" else batch_std
        a = (scores[i] - mean) / (std + 1e-6) if norm_by_std else scores[i] - mean
        out.append([a] * n)
    return out


def ref_rloo(rewards, lengths, groups):
    scores = ref_scores(rewards, lengths)
    out = []
    for i, n in enumerate(lengths):
        others = [scores[j] for j in range(len(scores)) if groups[j] == groups[i] and j != i]
        out.append([scores[i] - sum(others) / len(others)] * n if others else [0.0] * n)
    return out


def ref_discounted(rewards, lengths, gamma):
    out = []
    for i, n in enumerate(lengths):
        row, running = [0.0] * n, 0.0
        for t in reversed(range(n)):
            running = rewards[i][t] + gamma * running
            row[t] = running
        out.append(row)
    return out


def ref_reinforce_pp_baseline(rewards, lengths, groups):
    """Singletons: 0 and out of the whitening; the rest whitened together."""
    scores = ref_scores(rewards, lengths)
    rows, compared = [], []
    for i, n in enumerate(lengths):
        members = [scores[j] for j in range(len(scores)) if groups[j] == groups[i]]
        rows.append([scores[i] - sum(members) / len(members)] * n)
        compared.append(len(members) > 1)
    whitened = iter(ref_whiten([row for row, c in zip(rows, compared) if c]))
    return [next(whitened) if c else [0.0] * len(row) for row, c in zip(rows, compared)]


def assert_rows(tensor, rows, lengths, mask):
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(tensor[i, :n].numpy(), rows[i], atol=TOL, rtol=0)
    assert (tensor[~mask] == 0).all()


def test_gae_matches_loop():
    rewards, mask, values, groups, lengths = random_batch()
    out = call("gae", rewards, mask, values, groups)
    adv, ret = ref_gae(rewards.tolist(), values.tolist(), lengths, 0.9, 0.8)
    assert_rows(out.advantages, adv, lengths, mask)
    assert_rows(out.returns, ret, lengths, mask)


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_loop(norm_by_std):
    rewards, mask, values, groups, lengths = random_batch(1)
    out = call("grpo", rewards, mask, None, groups, norm_by_std=norm_by_std)
    assert_rows(out.advantages, ref_grpo(rewards.tolist(), lengths, groups.tolist(), norm_by_std), lengths, mask)


def test_grpo_with_the_batch_std_divides_each_group_relative_score_by_every_sequences_std():
    rewards, mask, values, groups, lengths = random_batch(1)
    out = call("grpo", rewards, mask, None, groups, std_scope="batch")
    assert_rows(out.advantages, ref_grpo(rewards.tolist(), lengths, groups.tolist(), True, "batch"), lengths, mask)
    grouped = call("grpo", rewards, mask, None, groups)
    assert not torch.allclose(out.advantages, grouped.advantages)  # the two scopes differ on this batch
    unscaled = call("grpo", rewards, mask, None, groups, norm_by_std=False, std_scope="batch")
    assert torch.equal(unscaled.advantages, call("grpo", rewards, mask, None, groups, norm_by_std=False).advantages)  # no std: no scope


def test_rloo_matches_loop():
    rewards, mask, values, groups, lengths = random_batch(2)
    out = call("rloo", rewards, mask, None, groups)
    assert_rows(out.advantages, ref_rloo(rewards.tolist(), lengths, groups.tolist()), lengths, mask)


def test_reinforce_pp_matches_loop():
    rewards, mask, values, groups, lengths = random_batch(3)
    out = call("reinforce_pp", rewards, mask, None, groups)
    returns = ref_discounted(rewards.tolist(), lengths, 0.9)
    assert_rows(out.returns, returns, lengths, mask)
    assert_rows(out.advantages, ref_whiten(returns), lengths, mask)


def ref_opo(rewards, lengths, groups):
    scores = ref_scores(rewards, lengths)
    out = []
    for i, n in enumerate(lengths):
        members = [j for j in range(len(scores)) if groups[j] == groups[i]]
        baseline = sum(lengths[j] * scores[j] for j in members) / sum(lengths[j] for j in members)
        out.append([scores[i] - baseline] * n if len(members) > 1 else [0.0] * n)
    return out


def ref_grpo_passk(rewards, lengths, groups, norm_by_std):
    scores = ref_scores(rewards, lengths)
    out = [[0.0] * n for n in lengths]
    for g in set(groups):
        members = [j for j in range(len(scores)) if groups[j] == g]
        if len(members) < 2:
            continue
        ranked = sorted(members, key=lambda j: (-scores[j], j))  # the first of equals is the best
        mean = sum(scores[j] for j in members) / len(members)
        std = math.sqrt(sum((scores[j] - mean) ** 2 for j in members) / (len(members) - 1))
        margin = scores[ranked[0]] - scores[ranked[1]]
        out[ranked[0]] = [margin / (std + 1e-6) if norm_by_std else margin] * lengths[ranked[0]]
    return out


def test_opo_subtracts_the_groups_length_weighted_mean_score():
    rewards, mask, values, groups, lengths = random_batch(6)
    out = call("opo", rewards, mask, None, groups)
    assert_rows(out.advantages, ref_opo(rewards.tolist(), lengths, groups.tolist()), lengths, mask)


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_passk_gives_only_each_groups_best_sample_its_margin_over_the_runner_up(norm_by_std):
    rewards, mask, values, groups, lengths = random_batch(7)
    out = call("grpo_passk", rewards, mask, None, groups, norm_by_std=norm_by_std)
    assert_rows(out.advantages, ref_grpo_passk(rewards.tolist(), lengths, groups.tolist(), norm_by_std), lengths, mask)
    assert int((out.advantages.abs().sum(-1) > 0).sum()) == 2  # the two groups of two or more samples: one row each


def test_reinforce_pp_baseline_matches_loop():
    rewards, mask, values, groups, lengths = random_batch(4)
    out = call("reinforce_pp_baseline", rewards, mask, None, groups)
    assert_rows(out.advantages, ref_reinforce_pp_baseline(rewards.tolist(), lengths, groups.tolist()), lengths, mask)


def test_remax_is_each_tokens_undiscounted_reward_to_go_less_its_prompts_greedy_reward():
    rewards, mask, _, groups, lengths = random_batch(7)
    baselines = torch.tensor([0.5, 0.5, 0.5, -1.0, -1.0, 2.0, 0.0], dtype=torch.float64)  # one per prompt, on each of its rows
    out = call("remax", rewards, mask, None, groups, gamma=0.9, baselines=baselines)  # gamma is not remax's: verl sums undiscounted
    to_go = ref_discounted(rewards.tolist(), lengths, 1.0)
    assert_rows(out.returns, to_go, lengths, mask)
    assert_rows(out.advantages, [[g - float(baselines[i]) for g in row] for i, row in enumerate(to_go)], lengths, mask)


def test_remax_gives_a_sample_as_good_as_the_greedy_response_no_advantage_and_needs_a_baseline():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64)  # scores on the last tokens: 1 and 0
    out = call("remax", rewards, mask, None, torch.tensor([0, 0]), baselines=torch.tensor([1.0, 1.0]))
    assert torch.equal(out.advantages, torch.tensor([[0.0, 0.0, 0.0], [-1.0, -1.0, 0.0]], dtype=torch.float64))
    with pytest.raises(ValueError, match="baseline"):
        call("remax", rewards, mask, None, torch.tensor([0, 0]))


def ref_gpg(scores, groups):
    """α·(s − group mean), α = B / (samples in groups of two or more whose scores differ)."""
    members = {g: [s for s, h in zip(scores, groups) if h == g] for g in set(groups)}
    signal = [len(members[g]) > 1 and max(members[g]) != min(members[g]) for g in groups]
    alpha = len(scores) / sum(signal) if any(signal) else 1.0
    return [alpha * (s - sum(members[g]) / len(members[g])) if ok else 0.0 for s, g, ok in zip(scores, groups, signal)]


def test_gpg_is_the_group_centred_score_scaled_by_the_batch_over_the_samples_that_compare():
    rewards, mask, _, groups, lengths = random_batch(8)
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 3])
    rewards[5:7] = 0.0
    rewards[5, 1] = rewards[6, 5] = 1.0  # groups 2 and 3: one sample each, no signal
    rewards[3:5] = 0.0
    rewards[3, 4] = rewards[4, 3] = 0.5  # group 1: two samples scoring alike, no signal
    out = call("gpg", rewards, mask, None, groups, norm_by_std=True)  # no std, whatever norm_by_std says
    expected = ref_gpg(ref_scores(rewards.tolist(), lengths), groups.tolist())
    assert_rows(out.advantages, [[a] * n for a, n in zip(expected, lengths)], lengths, mask)
    scores = ref_scores(rewards.tolist(), lengths)
    assert out.advantages[0, 0] == pytest.approx(7 / 3 * (scores[0] - sum(scores[:3]) / 3), abs=1e-12)  # α = 7 / 3
    assert (out.advantages[3:] == 0).all()


def test_gpg_is_the_group_centred_score_when_every_group_compares():
    rewards, mask, _, _, lengths = random_batch(9)
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 2])
    out = call("gpg", rewards, mask, None, groups)
    scores = ref_scores(rewards.tolist(), lengths)
    means = {g: np.mean([s for s, h in zip(scores, groups.tolist()) if h == g]) for g in range(3)}
    assert_rows(out.advantages, [[s - means[g]] * n for s, g, n in zip(scores, groups.tolist(), lengths)], lengths, mask)
    assert torch.equal(out.returns, out.advantages)


def test_gpg_calls_rounding_equal_scores_equal_and_a_batch_without_signal_all_zero():
    mask = torch.ones(3, 1, dtype=torch.bool)
    rewards = torch.full((3, 1), 0.1, dtype=torch.float64)  # their mean is 0.1 + 1e-17: a std would not be 0
    out = call("gpg", rewards, mask, None, torch.tensor([0, 0, 0]))
    assert (out.advantages == 0).all()


def ref_optimal_token_baseline(rewards, lengths, groups, logp, sum_pi_squared, zero_tail=False, is_weights=None):
    """Per group and position t over the group's samples that reach t: the baseline
    Σ G_t·W_t / (Σ W_t + 1e-8), W_t = Σ_{j≤t} ρ_j²·‖onehot − π_j‖²; groups of one get 0."""
    B = len(lengths)
    rho = is_weights or [[1.0] * n for n in lengths]
    returns = [[sum(rewards[i][t:lengths[i]]) for t in range(lengths[i])] for i in range(B)]
    path = [list(itertools.accumulate(rho[i][j] ** 2 * (1 - 2 * math.exp(logp[i][j]) + sum_pi_squared[i][j]) for j in range(lengths[i]))) for i in range(B)]
    out = []
    for i in range(B):
        members = [k for k in range(B) if groups[k] == groups[i]]
        if len(members) == 1:
            out.append([0.0] * lengths[i])
            continue
        by_length = sorted(lengths[k] for k in members)
        alone_longest = lengths[i] == by_length[-1] > by_length[-2]
        row = []
        for t in range(lengths[i]):
            reach = [k for k in members if lengths[k] > t]
            baseline = sum(returns[k][t] * path[k][t] for k in reach) / (sum(path[k][t] for k in reach) + 1e-8)
            if zero_tail and alone_longest and t >= by_length[-2]:
                baseline = 0.0
            row.append(returns[i][t] - baseline)
        out.append(row)
    return out


@pytest.mark.parametrize("zero_tail", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_optimal_token_baseline_matches_loop(seed, zero_tail):
    rewards, mask, _, groups, lengths = random_batch(seed)
    paths = policy_statistics(seed, mask, zero_tail=zero_tail)
    out = call("optimal_token_baseline", rewards, mask, None, groups, paths=paths)
    expected = ref_optimal_token_baseline(rewards.tolist(), lengths, groups.tolist(), paths.old_logprobs.tolist(), paths.sum_pi_squared.tolist(), zero_tail)
    assert_rows(out.advantages, expected, lengths, mask)
    assert_rows(out.returns, ref_discounted(rewards.tolist(), lengths, 1.0), lengths, mask)


def test_optimal_token_baseline_under_importance_weights_weighs_each_token_by_their_square():
    """With the update's truncated IS weights ρ̄ on its loss, a token's variance term is
    ρ̄²·‖onehot − π‖² (verl's B_t = Σ G ρ̄² W / Σ ρ̄² W)."""
    rewards, mask, _, groups, lengths = random_batch(4)
    g = torch.Generator().manual_seed(9)
    rho = torch.where(mask, torch.rand(mask.shape, generator=g, dtype=torch.float64) * 2, 0)
    paths = policy_statistics(4, mask, is_weights=rho)
    out = call("optimal_token_baseline", rewards, mask, None, groups, paths=paths)
    expected = ref_optimal_token_baseline(rewards.tolist(), lengths, groups.tolist(), paths.old_logprobs.tolist(), paths.sum_pi_squared.tolist(), is_weights=rho.tolist())
    assert_rows(out.advantages, expected, lengths, mask)
    plain = call("optimal_token_baseline", rewards, mask, None, groups, paths=paths._replace(is_weights=None))
    assert not torch.allclose(out.advantages, plain.advantages)


def test_optimal_token_baseline_with_equal_paths_is_the_mean_return_of_the_samples_that_reach_each_position():
    """Where every token's gradient norm is alike, W_t is the same for every sample at t: the
    baseline is the plain mean of the returns there (a sample alone at t has advantage 0)."""
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    rewards = torch.tensor([[0.0, 0.0, 3.0], [0.0, 1.0, 0.0], [2.0, 0.0, 0.0]], dtype=torch.float64)
    uniform = PathWeights(torch.full((3, 3), math.log(0.25), dtype=torch.float64), torch.full((3, 3), 0.25, dtype=torch.float64))
    out = call("optimal_token_baseline", rewards, mask, None, torch.zeros(3, dtype=torch.long), paths=uniform)
    expected = [[3 - 2, 3 - 2, 0.0], [1 - 2, 1 - 2, 0.0], [2 - 2, 0.0, 0.0]]  # means 2, 2, 3
    torch.testing.assert_close(out.advantages, torch.tensor(expected, dtype=torch.float64), atol=1e-7, rtol=0)
    tail = call("optimal_token_baseline", rewards, mask, None, torch.zeros(3, dtype=torch.long), paths=uniform._replace(zero_tail=True))
    assert tail.advantages[0].tolist() == pytest.approx([1.0, 1.0, 3.0])  # past the second longest: its return


def test_optimal_token_baseline_weighs_each_sample_by_its_paths_gradient_norm():
    """A sample whose tokens were near-certain (π ≈ 1: a gradient norm ≈ 0) hardly moves the
    baseline: the other sample's return sets it."""
    mask = torch.ones(2, 1, dtype=torch.bool)
    rewards = torch.tensor([[1.0], [0.0]], dtype=torch.float64)
    certain, spread = (0.999, 0.999**2 + 0.001**2), (0.5, 0.5)  # (π of the token, Σπ²): w = 1e-6·2, 0.5
    paths = PathWeights(torch.tensor([[math.log(certain[0])], [math.log(spread[0])]], dtype=torch.float64),
                        torch.tensor([[certain[1]], [spread[1]]], dtype=torch.float64))
    out = call("optimal_token_baseline", rewards, mask, None, torch.zeros(2, dtype=torch.long), paths=paths)
    w = (1 - 2 * 0.999 + certain[1], 0.5)
    baseline = w[0] / (w[0] + w[1] + 1e-8)
    assert out.advantages[:, 0].tolist() == pytest.approx([1 - baseline, -baseline], abs=1e-9) and baseline < 1e-5


def test_optimal_token_baseline_needs_the_policys_statistics():
    rewards, mask, _, groups, _ = random_batch(0)
    with pytest.raises(ValueError, match="old log-prob and Σπ²"):
        call("optimal_token_baseline", rewards, mask, None, groups)


@pytest.mark.parametrize("name", ["grpo", "rloo", "opo", "grpo_passk", "gpg", "reinforce_pp_baseline", "optimal_token_baseline"])
def test_groups_of_one_get_zero_advantage(name):
    rewards, mask, _, _, lengths = random_batch(5)
    out = call(name, rewards, mask, None, torch.arange(7), paths=policy_statistics(5, mask) if name == "optimal_token_baseline" else None)
    assert (out.advantages == 0).all()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), junk=st.floats(-1e6, 1e6, allow_nan=False))
def test_values_and_rewards_at_masked_positions_never_change_gae(seed, junk):
    rewards, mask, values, groups, lengths = random_batch(seed)
    base = call("gae", rewards, mask, values, groups)
    g = torch.Generator().manual_seed(seed + 1)
    noisy_values = torch.where(mask, values, torch.randn(values.shape, generator=g, dtype=torch.float64) * junk)
    noisy_rewards = torch.where(mask, rewards, junk)
    other = call("gae", noisy_rewards, mask, noisy_values, groups)
    assert torch.equal(base.advantages, other.advantages) and torch.equal(base.returns, other.returns)


def test_a_group_of_one_does_not_shift_the_others_in_reinforce_pp_baseline():
    rewards, mask, _, groups, lengths = random_batch(6)
    with_singletons = call("reinforce_pp_baseline", rewards, mask, None, groups)
    keep = [i for i, g in enumerate(groups.tolist()) if groups.tolist().count(g) > 1]
    without = call("reinforce_pp_baseline", rewards[keep], mask[keep], None, groups[keep])
    torch.testing.assert_close(with_singletons.advantages[keep], without.advantages, atol=1e-12, rtol=0)


def test_the_kl_fed_to_the_controller_averages_tokens_then_sequences():
    from rlctl.algos.advantages import sequence_mean

    kl = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0], [5.0, 5.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)  # the third has no tokens
    assert float(sequence_mean(kl, mask)) == pytest.approx((1.0 + 3.0) / 2)  # a token mean would be 7/5


def test_unknown_estimator_lists_the_known_ones():
    from rlctl.errors import InputError

    with pytest.raises(InputError, match="available: gae, gdpo, gpg, grpo, grpo_passk, online_dpo, opo, optimal_token_baseline, reinforce_pp, reinforce_pp_baseline, remax, rloo"):
        ESTIMATORS.get("ppo2")


def test_registry_refuses_duplicates():
    with pytest.raises(ValueError, match="already registered"):
        ESTIMATORS.register("gae")(lambda **kw: None)


@pytest.mark.parametrize("estimator", ["gae", "grpo", "reinforce_pp", "optimal_token_baseline"])
def test_a_tools_tokens_are_context_the_advantage_skips(estimator):
    """Rows whose responses hold a tool's tokens (loss_mask False) get the advantages, returns
    and per-token rewards the same rows would get without those tokens, and 0 at them: the
    reward lands on the policy's last token and the KL counts the policy's tokens only."""
    import pyarrow as pa

    from rlctl.algos.kl import KLControllerState
    from rlctl.config import AdvantageConfig
    from rlctl.stages.advantage import advantage_table

    g = torch.Generator().manual_seed(5)
    masks = [[True, True, False, False, True], [True, False, True], [True, True, True], [True, True, False]]  # the last ends in a tool's text

    def rand(n):
        return torch.randn(n, generator=g).tolist()

    columns = {name: [rand(len(m)) for m in masks] for name in ("old_logprobs", "ref_logprobs", "values")}
    columns["old_logprobs"] = [[-abs(v) for v in row] for row in columns["old_logprobs"]]
    columns["sum_pi_squared"] = [[0.3 + abs(v) / 10 for v in row] for row in columns["values"]]
    full = pa.table({
        "id": ["a", "a", "b", "b"], "response_ids": [list(range(len(m))) for m in masks], "reward": pa.array([1.0, 0.0, 0.5, 2.0], pa.float32()),
        **{name: pa.array(values, pa.list_(pa.float32())) for name, values in columns.items()}, "loss_mask": pa.array(masks, pa.list_(pa.bool_())),
    })
    kept = full.drop_columns(["loss_mask"]).to_pylist()
    for row, m in zip(kept, masks):  # the same rows with the tool's tokens taken out
        for name in ("response_ids", *columns):
            row[name] = [v for v, keep in zip(row[name], m) if keep]
    without = pa.Table.from_pylist(kept, schema=full.drop_columns(["loss_mask"]).schema)
    cfg = AdvantageConfig(estimator=estimator, kl_coef=0.1, gamma=0.9, lam=0.8)
    with_tool, _, stats = advantage_table(full, cfg, KLControllerState(0.1))
    plain, _, plain_stats = advantage_table(without, cfg, KLControllerState(0.1))
    assert stats["kl"] == pytest.approx(plain_stats["kl"], abs=1e-7)
    for name in ("advantages", "returns", "token_rewards"):
        for got, expected, m in zip(with_tool.column(name).to_pylist(), plain.column(name).to_pylist(), masks):
            assert [v for v, keep in zip(got, m) if keep] == pytest.approx(expected, abs=1e-6), name
            assert all(v == 0.0 for v, keep in zip(got, m) if not keep), name


def test_where_score_wrote_sum_pi_squared_the_advantage_reports_the_gradients_variance_proxies():
    """verl's proxies: over sequences, E[Ā²·W] with Ā the sequence's mean advantage and
    W = Σ_t (1 − 2π_t + Σπ²_t), beside E[Ā²] and E[W]; without Σπ² none are reported."""
    import pyarrow as pa

    from rlctl.algos.kl import KLControllerState
    from rlctl.config import AdvantageConfig
    from rlctl.stages.advantage import advantage_table

    logprobs = [[-0.1, -2.0, -0.5], [-1.0], [-0.3, -0.7]]
    sum_pi_squared = [[0.85, 0.2, 0.5], [0.4], [0.6, 0.3]]  # each at least its token's π²: a distribution's
    table = pa.table({
        "id": ["a", "a", "b"], "response_ids": [[1, 2, 3], [4], [5, 6]], "reward": pa.array([1.0, 0.0, 0.5], pa.float32()),
        "old_logprobs": pa.array(logprobs, pa.list_(pa.float32())), "sum_pi_squared": pa.array(sum_pi_squared, pa.list_(pa.float32())),
    })
    out, _, stats = advantage_table(table, AdvantageConfig(estimator="grpo"), KLControllerState(0.0))
    means = [sum(row) / len(row) for row in out.column("advantages").to_pylist()]
    w = [sum(1 - 2 * math.exp(lp) + sq for lp, sq in zip(lps, sqs)) for lps, sqs in zip(logprobs, sum_pi_squared)]
    assert stats["variance_proxy/total_power"] == pytest.approx(np.mean([a * a * x for a, x in zip(means, w)]), rel=1e-5)
    assert stats["variance_proxy/expected_a_squared"] == pytest.approx(np.mean([a * a for a in means]), rel=1e-5)
    assert stats["variance_proxy/expected_w"] == pytest.approx(np.mean(w), rel=1e-5)
    _, _, plain = advantage_table(table.drop_columns(["sum_pi_squared"]), AdvantageConfig(estimator="grpo"), KLControllerState(0.0))
    assert not any(key.startswith("variance_proxy/") for key in plain)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_the_advantage_stage_weighs_the_optimal_token_baselines_paths_by_the_updates_truncated_importance_weights(level):
    import pyarrow as pa

    from rlctl.algos.kl import KLControllerState
    from rlctl.algos.losses import rollout_is_weights
    from rlctl.config import AdvantageConfig
    from rlctl.stages.advantage import advantage_table

    old = [[-0.2, -1.5, -0.4], [-0.9, -0.3], [-0.6], [-1.2, -0.1]]
    engine = [[-0.3, -1.0, -0.4], [-1.4, -0.3], [-0.2], [-1.2, -0.5]]
    sq = [[0.7, 0.3, 0.6], [0.4, 0.6], [0.5], [0.3, 0.85]]
    table = pa.table({
        "id": ["a", "a", "a", "b"], "response_ids": [[1, 2, 3], [4, 5], [6], [7, 8]], "reward": pa.array([1.0, 0.0, 0.5, 1.0], pa.float32()),
        "old_logprobs": pa.array(old, pa.list_(pa.float32())), "rollout_logprobs": pa.array(engine, pa.list_(pa.float32())),
        "sum_pi_squared": pa.array(sq, pa.list_(pa.float32())),
    })
    cfg = AdvantageConfig(estimator="optimal_token_baseline", otb_rollout_is=level, otb_rollout_is_threshold=1.5)
    out, _, _ = advantage_table(table, cfg, KLControllerState(0.0))
    lengths = [3, 2, 1, 2]
    mask = torch.tensor([[i < n for i in range(3)] for n in lengths])

    def pad(rows):
        return torch.tensor([row + [0.0] * (3 - len(row)) for row in rows], dtype=torch.float64)

    rho = rollout_is_weights(old_logprobs=pad(old), rollout_logprobs=pad(engine), response_mask=mask, level=level, threshold=1.5)
    rewards = torch.zeros(4, 3, dtype=torch.float64)
    for i, (n, r) in enumerate(zip(lengths, [1.0, 0.0, 0.5, 1.0])):
        rewards[i, n - 1] = r
    expected = ref_optimal_token_baseline(rewards.tolist(), lengths, [0, 0, 0, 1], pad(old).tolist(), pad(sq).tolist(), is_weights=rho.tolist())
    for got, want in zip(out.column("advantages").to_pylist(), expected):
        assert got == pytest.approx(want, abs=1e-5)
    plain, _, _ = advantage_table(table, AdvantageConfig(estimator="optimal_token_baseline", otb_rollout_is="off"), KLControllerState(0.0))
    assert plain.column("advantages").to_pylist() != out.column("advantages").to_pylist()


# -- online DPO: a DPO pair per group, as advantages ------------------------------------------


def online_dpo_pairs(mask, mode, loss="sigmoid", beta=0.3, horizon=0, seed=5, which="best_worst"):
    from rlctl.algos.advantages import PreferencePairs, aggregation_divisors

    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * 3
    ref_logprobs = logprobs + torch.randn(mask.shape, generator=g, dtype=torch.float64) * 0.3
    divisors = aggregation_divisors(mask, mode, horizon or mask.shape[1])
    return PreferencePairs(logprobs, ref_logprobs, divisors, beta, loss, which)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "apo_zero", "nca_pair"])
@pytest.mark.parametrize("which", ["best_worst", "all"])
def test_online_dpos_advantages_under_the_updates_aggregation_give_the_gradient_of_the_pairs_mean_dpo_loss(mode, loss, which):
    """At the update's first step (ratio 1) the surrogate −A·ratio, aggregated as the update
    aggregates it, has the gradient in each token's log-prob of the mean preference loss over
    the pairs of each group's best and worst sample, or of every two of its samples whose rewards
    differ (groups 2 and 3, of one sample each, make none)."""
    from rlctl.algos.losses import aggregate
    from rlctl.algos.preference import dpo_losses

    rewards, mask, values, groups, lengths = random_batch(seed=3)
    pairs = online_dpo_pairs(mask, mode, loss=loss, which=which)
    advantages, returns = call("online_dpo", rewards, mask, None, groups, paths=None, pairs=pairs)
    assert torch.equal(advantages, returns) and (advantages[~mask] == 0).all()
    logp = pairs.logprobs.clone().requires_grad_(True)
    ratio = torch.exp(logp - logp.detach())  # 1, with the log-prob's gradient
    aggregate(loss=-advantages * ratio, response_mask=mask, mode=mode, batch_tokens=int(mask.sum()), batch_seqs=len(lengths), horizon=mask.shape[1]).backward()
    surrogate_grad = logp.grad.clone()
    scores = [sum(rewards[i, :n].tolist()) for i, n in enumerate(lengths)]
    chosen, rejected = [], []
    for group in sorted(set(groups.tolist())):
        rows = [i for i in range(len(lengths)) if groups[i] == group]
        if which == "all":
            better = [(a, b) for a in rows for b in rows if scores[a] > scores[b]]
            chosen += [a for a, _ in better]
            rejected += [b for _, b in better]
            continue
        best, worst = max(rows, key=lambda i: scores[i]), min(rows, key=lambda i: scores[i])
        if scores[best] > scores[worst]:
            chosen.append(best)
            rejected.append(worst)
    assert len(chosen) == (4 if which == "all" else 2)  # groups 0 (3 samples: 3 pairs, or 1) and 1 (2 samples: 1 pair)
    logp.grad = None
    summed, ref = torch.where(mask, logp, 0).sum(-1), torch.where(mask, pairs.ref_logprobs, 0).sum(-1)
    tokens = mask.sum(-1)
    losses, _, _ = dpo_losses(summed[chosen], summed[rejected], ref[chosen], ref[rejected], beta=0.3, loss=loss, chosen_tokens=tokens[chosen], rejected_tokens=tokens[rejected])
    losses.mean().backward()
    assert torch.allclose(surrogate_grad, torch.where(mask, logp.grad, 0), atol=1e-12)
    others = [i for i in range(len(lengths)) if i not in chosen + rejected]
    assert (advantages[others] == 0).all() and len(others) == (2 if which == "all" else 3)  # the lone samples (and group 0's middle one)
    if mode == "token-mean":  # what the advantage stage reports of the pairs, at the sampling policy
        from rlctl.algos.advantages import online_dpo_stats

        with torch.no_grad():
            before, chosen_reward, rejected_reward = dpo_losses(
                summed[chosen], summed[rejected], ref[chosen], ref[rejected], beta=0.3, loss=loss, chosen_tokens=tokens[chosen], rejected_tokens=tokens[rejected],
            )
        stats = online_dpo_stats(rewards, mask, groups, pairs)
        assert stats == pytest.approx({
            "dpo/pairs": len(chosen), "dpo/loss": float(before.mean()), "dpo/accuracy": float((chosen_reward > rejected_reward).double().mean()),
            "dpo/margin": float((chosen_reward - rejected_reward).mean()),
        })


def test_online_dpo_makes_no_pair_of_a_group_whose_samples_tie():
    rewards, mask, values, groups, lengths = random_batch(seed=3)
    rewards = torch.where(torch.arange(mask.shape[1]) == 0, 1.0, 0.0).expand_as(rewards).clone().double()  # every sample's score 1
    advantages, _ = call("online_dpo", rewards, mask, None, groups, pairs=online_dpo_pairs(mask, "token-mean"))
    assert (advantages == 0).all()


# -- GDPO: several rewards, each normalized within its group on its own ---------------------------


def gdpo_call(components, weights, groups, mask):
    from rlctl.algos.advantages import RewardComponents

    B = len(groups)
    return ESTIMATORS.get("gdpo")(
        token_rewards=torch.zeros(B, mask.shape[1], dtype=torch.float64), response_mask=mask, values=None, group_index=torch.tensor(groups), gamma=1.0, lam=1.0,
        norm_by_std=True, components=RewardComponents(torch.tensor(components, dtype=torch.float64), torch.tensor(weights, dtype=torch.float64)),
    )


def ref_gdpo(components, weights, groups):
    """TRL's normalize_then_sum in plain Python (its ε 1e-4 is rlctl's 1e-6 here); a reward that
    does not apply (None) adds nothing; a group of one has advantage 0 and stays out of the
    batch's mean and std (rlctl's rule)."""
    summed = [0.0] * len(groups)
    for k, weight in enumerate(weights):
        for g in set(groups):
            rows = [i for i, h in enumerate(groups) if h == g and components[i][k] is not None]
            if not rows:
                continue
            values = [components[i][k] for i in rows]
            mean = sum(values) / len(values)
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
            for i in rows:
                summed[i] += weight * (components[i][k] - mean) / (std + 1e-6)
    grouped = [s for i, s in enumerate(summed) if groups.count(groups[i]) > 1]  # groups of one stay out of the batch's statistics
    mean = sum(grouped) / len(grouped)
    std = math.sqrt(sum((s - mean) ** 2 for s in grouped) / (len(grouped) - 1))
    return [0.0 if groups.count(groups[i]) == 1 else (s - mean) / (std + 1e-6) for i, s in enumerate(summed)]


def test_gdpo_normalizes_each_reward_within_its_group_then_whitens_the_weighted_sum_over_the_batch():
    _, mask, _, _, lengths = random_batch(3)
    groups = [0, 0, 0, 1, 1, 2, 3]
    components = [[1.0, 0.2, None], [0.0, 0.9, 5.0], [1.0, 0.4, 3.0], [0.0, 0.1, None], [1.0, 0.7, 2.0], [1.0, 0.3, 1.0], [0.0, 0.5, None]]
    weights = [1.0, 0.5, 0.25]
    nan = [[math.nan if v is None else v for v in row] for row in components]
    out = gdpo_call(nan, weights, groups, mask)
    expected = ref_gdpo(components, weights, groups)
    assert_rows(out.advantages, [[a] * n for a, n in zip(expected, lengths)], lengths, mask)
    assert torch.equal(out.returns, out.advantages) and out.advantages[5:].abs().max() == 0  # groups of one: 0


def test_gdpo_weighs_each_rewards_ranking_whatever_its_scale_where_grpo_lets_the_widest_decide():
    """Two rewards in a group of four (correct, well formatted): with the correctness reward ten
    times as wide, GRPO's sum punishes the well-formatted wrong answer almost as hard as the
    all-wrong one; GDPO ranks each reward within the group on its own, so the scale changes
    nothing and that answer sits in the middle. The weights still say which reward counts more."""
    mask = torch.ones(4, 2, dtype=torch.bool)
    rows = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]]
    gdpo = gdpo_call(rows, [1.0, 1.0], [0, 0, 0, 0], mask).advantages[:, 0]
    scaled = gdpo_call([[c * 10, f] for c, f in rows], [1.0, 1.0], [0, 0, 0, 0], mask).advantages[:, 0]
    torch.testing.assert_close(scaled, gdpo, atol=1e-5, rtol=0)  # up to ε = 1e-6 against a std ten times as large
    assert abs(float(gdpo[1])) < 1e-9 and gdpo[2] > 0 > gdpo[3]
    totals = torch.tensor([[c * 10 + f, 0.0] for c, f in rows], dtype=torch.float64)
    grpo = call("grpo", totals, torch.tensor([[True, False]] * 4), None, torch.zeros(4, dtype=torch.long)).advantages[:, 0]
    assert grpo[1] < 0.8 * grpo[3] < 0  # the wide reward decides almost alone
    weighted = gdpo_call(rows, [2.0, 1.0], [0, 0, 0, 0], mask).advantages[:, 0]
    assert weighted[0] > weighted[1]


# -- VAPO's decoupled and length-adaptive GAE ---------------------------------------------------


def test_decoupled_gae_takes_the_advantages_from_the_policys_lambda_and_the_returns_from_the_critics():
    from rlctl.algos.advantages import decoupled_gae

    rewards, mask, values, groups, lengths = random_batch(4)
    same = decoupled_gae(token_rewards=rewards, response_mask=mask, values=values, gamma=0.9, policy_lam=0.8, critic_lam=0.8)
    plain = call("gae", rewards, mask, values, groups)
    assert torch.equal(same.advantages, plain.advantages) and torch.equal(same.returns, plain.returns)
    split = decoupled_gae(token_rewards=rewards, response_mask=mask, values=values, gamma=1.0, policy_lam=0.8, critic_lam=1.0)
    assert torch.equal(split.advantages, call("gae", rewards, mask, values, groups, gamma=1.0, lam=0.8).advantages)
    for i, n in enumerate(lengths):  # λ = γ = 1: each target is the reward to go, the critic's values cancel
        expected = [sum(rewards[i, t:n].tolist()) for t in range(n)]
        np.testing.assert_allclose(split.returns[i, :n].numpy(), expected, atol=1e-9, rtol=0)


def test_length_adaptive_lambda_gives_each_response_its_own_horizon():
    from rlctl.algos.advantages import decoupled_gae, length_adaptive_lams

    lengths = [40, 80, 160]
    assert length_adaptive_lams(torch.tensor(lengths + [10]), 0.05).tolist() == pytest.approx([0.5, 0.75, 0.875, 0.0])  # 1 − 1/(αl), not below 0
    mask = torch.arange(160).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    rewards = torch.zeros(3, 160, dtype=torch.float64)
    for i, n in enumerate(lengths):
        rewards[i, n - 1] = 1.0
    out = decoupled_gae(token_rewards=rewards, response_mask=mask, values=torch.zeros_like(rewards), gamma=1.0, policy_lam=length_adaptive_lams(mask.sum(-1), 0.05), critic_lam=1.0)
    for i, n in enumerate(lengths):  # zero values: A_t = λ^(n−1−t) before whitening, so consecutive steps of the whitened ones shrink by λ
        a = out.advantages[i, n - 4 : n].tolist()
        assert (a[2] - a[1]) / (a[3] - a[2]) == pytest.approx([0.5, 0.75, 0.875][i], rel=1e-9)
