"""update.rollout_rs: each rejection rule against a plain float64 loop over the valid tokens,
the rules combined, the shares reported, and the threshold specs a user writes."""

import math

import pytest
import torch

from rlctl.algos.rejection import kept_tokens, parse_rules
from rlctl.choices import REJECTION_RULES
from rlctl.errors import ConfigError


def batch(seed=0, lengths=(7, 3, 1, 5, 6, 0), width=7, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    rollout = torch.randn(len(lengths), width, generator=g, dtype=torch.float64) - 2
    old = rollout + torch.randn(len(lengths), width, generator=g, dtype=torch.float64) * scale
    return old, rollout, mask, list(lengths)


def ref_divergence(estimator, x):  # x = log π_old − log π_rollout
    return {"k1": -x, "k2": 0.5 * x * x, "k3": math.exp(x) - 1 - x}[estimator]


def ref_keeps(name, bounds, old, rollout, lengths):
    """Per row, per valid token: kept by this rule alone."""
    level, estimator = name.rsplit("_", 1)
    lower, upper = bounds
    out = []
    for i, n in enumerate(lengths):
        stats = [ref_divergence(estimator, old[i][t] - rollout[i][t]) for t in range(n)]
        inside = (lambda v: math.log(lower) <= v <= math.log(upper)) if estimator == "k1" else (lambda v: v <= upper)
        if level == "token":
            out.append([inside(v) for v in stats])
            continue
        row = {"seq_sum": sum(stats), "seq_mean": sum(stats) / max(n, 1), "seq_max": max(stats, default=0.0)}[level]
        out.append([inside(row)] * n)
    return out


BOUNDS = {"k1": (0.8, 1.25), "k2": (None, 0.02), "k3": (None, 0.02)}
SEQUENCE_BOUNDS = {
    "seq_sum_k1": (0.6, 1.5), "seq_sum_k2": (None, 0.15), "seq_sum_k3": (None, 0.15), "seq_mean_k1": (0.9, 1.1), "seq_max_k2": (None, 0.08), "seq_max_k3": (None, 0.08),
}


@pytest.mark.parametrize("name", REJECTION_RULES)
def test_each_rule_keeps_what_a_loop_over_the_tokens_keeps(name):
    old, rollout, mask, lengths = batch(seed=REJECTION_RULES.index(name))
    lower, upper = SEQUENCE_BOUNDS.get(name, BOUNDS[name[-2:]])
    spec = f"{lower}_{upper}" if lower is not None else f"{upper}"
    kept, metrics = kept_tokens(parse_rules(name, spec), old_logprobs=old, rollout_logprobs=rollout, response_mask=mask)
    expected = ref_keeps(name, (lower, upper), old.tolist(), rollout.tolist(), lengths)
    assert [kept[i, :n].tolist() for i, n in enumerate(lengths)] == expected
    assert not kept[~mask].any()
    flat = [k for row in expected for k in row]
    assert 0 < flat.count(False) < len(flat)  # the bounds cut somewhere inside this batch
    assert metrics["rollout_rs/masked_fraction"] == pytest.approx(flat.count(False) / len(flat))
    rows = [row for row in expected if row]  # the row without tokens counts in neither share
    assert metrics["rollout_rs/seq_masked_fraction"] == pytest.approx(sum(not all(row) for row in rows) / len(rows))
    assert metrics[f"rollout_rs/{name}/masked_fraction"] == metrics["rollout_rs/masked_fraction"]


def test_every_rule_must_keep_a_token_and_each_reports_its_own_share():
    old, rollout, mask, lengths = batch(seed=11)
    rules = parse_rules("token_k1, seq_max_k2", "0.8_1.25,0.05")
    kept, metrics = kept_tokens(rules, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask)
    first = ref_keeps("token_k1", (0.8, 1.25), old.tolist(), rollout.tolist(), lengths)
    second = ref_keeps("seq_max_k2", (None, 0.05), old.tolist(), rollout.tolist(), lengths)
    assert [kept[i, :n].tolist() for i, n in enumerate(lengths)] == [[a and b for a, b in zip(x, y)] for x, y in zip(first, second)]
    tokens = sum(lengths)
    assert metrics["rollout_rs/token_k1/masked_fraction"] == pytest.approx(sum(row.count(False) for row in first) / tokens)
    assert metrics["rollout_rs/seq_max_k2/masked_fraction"] == pytest.approx(sum(row.count(False) for row in second) / tokens)
    assert metrics["rollout_rs/masked_fraction"] == pytest.approx(1 - float(kept.sum()) / tokens)


def test_seq_mean_k1_is_the_geometric_mean_of_the_ratios_and_one_upper_bound_means_its_inverse_below():
    rollout = torch.full((2, 3), -1.0, dtype=torch.float64)
    old = rollout + torch.tensor([[0.3, -0.3, 0.09], [0.3, 0.3, 0.3]], dtype=torch.float64)  # row 1: mean log-ratio 0.03
    mask = torch.ones(2, 3, dtype=torch.bool)
    kept, _ = kept_tokens(parse_rules("seq_mean_k1", "1.2"), old_logprobs=old, rollout_logprobs=rollout, response_mask=mask)
    assert kept.tolist() == [[True] * 3, [False] * 3]  # row 2: π_rollout/π_old = e^−0.3 = 0.74 < 1/1.2
    kept, _ = kept_tokens(parse_rules("token_k1", "1.2"), old_logprobs=old, rollout_logprobs=rollout, response_mask=mask)
    assert kept.tolist() == [[False, False, True], [False] * 3]  # e^∓0.3 is outside [1/1.2, 1.2] both ways


def test_equal_policies_reject_nothing():
    old, _, mask, _ = batch(seed=3)
    kept, metrics = kept_tokens(parse_rules(",".join(REJECTION_RULES), "1.0001,1e-9,1e-9,1.0001,1e-9,1e-9,1.0001,1e-9,1e-9,1e-9,1e-9"),
                                old_logprobs=old, rollout_logprobs=old.clone(), response_mask=mask)
    assert torch.equal(kept, mask) and metrics["rollout_rs/masked_fraction"] == 0


@pytest.mark.parametrize("options,thresholds,message", [
    ("token_k9", "2", "unknown rule 'token_k9'; available: token_k1"),
    ("token_k1", "", "needs update.rollout_rs_threshold"),
    ("token_k1,seq_max_k2", "2,3,4", "one threshold for every rule or one for each of the 2 rules"),
    ("seq_sum_k2", "0.5_2", "k2 and k3 take one upper bound"),
    ("token_k1", "2_0.5", "0 < lower ≤ upper"),
    ("token_k1", "1_2_3", "give lower_upper or upper"),
    ("token_k3", "-1", "must be a positive number"),
    ("token_k1", "two", "is not a number"),
    (" , ", "2", "names no rule"),
])
def test_a_bad_spec_is_one_line_naming_the_key(options, thresholds, message):
    with pytest.raises(ConfigError, match=message) as caught:
        parse_rules(options, thresholds)
    assert "\n" not in str(caught.value) and "update.rollout_rs" in str(caught.value)


def test_a_k1_threshold_of_one_number_is_a_range_around_one():
    (rule,) = parse_rules("token_k1", "2.0")
    assert (rule.lower, rule.upper) == (0.5, 2.0)
    (rule,) = parse_rules("seq_max_k3", "0.01")
    assert (rule.lower, rule.upper) == (None, 0.01)
