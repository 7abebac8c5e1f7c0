"""The one log-prob definition and the sampler's truncation."""

import math

import pytest
import torch

from rlctl.algos.logprobs import (
    logprobs_and_statistic,
    sample_next,
    token_logprobs,
    truncate_logits,
)


def test_greedy_picks_argmax_and_reports_temperature_one_logprob():
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    tokens, logp = sample_next(logits=logits, temperature=0.0, top_p=1.0, top_k=0, uniform=torch.rand(1))
    assert tokens.tolist() == [1]
    assert torch.allclose(logp, torch.log_softmax(logits, -1)[:, 1])


def test_sampled_logprob_uses_temperature_and_matches_token_logprobs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 11, generator=g)
    tokens, logp = sample_next(logits=logits, temperature=0.7, top_p=0.9, top_k=5, uniform=torch.rand(4, generator=g))
    assert torch.allclose(logp, token_logprobs(logits=logits, tokens=tokens, temperature=0.7))


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isfinite(truncate_logits(logits=logits, top_p=1.0, top_k=2)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(truncate_logits(logits=logits, top_p=0.7, top_k=0)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(truncate_logits(logits=logits, top_p=0.5, top_k=0)).tolist() == [[True, False, False, False]]


def test_logprobs_and_statistic_share_one_definition():
    g = torch.Generator().manual_seed(1)
    logits, tokens = torch.randn(3, 5, 9, generator=g), torch.randint(0, 9, (3, 5), generator=g)
    logp, entropy = logprobs_and_statistic(logits=logits, tokens=tokens, temperature=0.5)
    assert torch.allclose(logp, token_logprobs(logits=logits, tokens=tokens, temperature=0.5))
    probs = torch.softmax(logits / 0.5, -1)
    assert torch.allclose(entropy, -(probs * probs.log()).sum(-1), atol=1e-6)


@pytest.mark.parametrize("chunk_elements", [None, 2 * 9])
def test_sum_pi_squared_is_the_squared_probabilities_sum_whole_or_a_chunk_at_a_time(monkeypatch, chunk_elements):
    """Σπ² of each position's distribution at the temperature, beside the same log-probs; with
    its token's π, 1 − 2π + Σπ² is ‖onehot − π‖², the log-prob gradient's squared norm in the
    logits. Only the entropy has a chunked backward: Σπ² under gradient there is refused."""
    from rlctl.algos import logprobs

    if chunk_elements:
        monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", chunk_elements)
    g = torch.Generator().manual_seed(2)
    logits, tokens = torch.randn(3, 5, 9, generator=g) * 2, torch.randint(0, 9, (3, 5), generator=g)
    logp, sum_pi_squared = logprobs_and_statistic(logits=logits, tokens=tokens, temperature=0.7, statistic="sum_pi_squared")
    probs = torch.softmax(logits / 0.7, -1)
    torch.testing.assert_close(sum_pi_squared, probs.square().sum(-1), atol=1e-6, rtol=1e-6)
    assert torch.equal(logp, token_logprobs(logits=logits, tokens=tokens, temperature=0.7))
    norm = (torch.nn.functional.one_hot(tokens, 9) - probs).square().sum(-1)
    torch.testing.assert_close(1 - 2 * logp.exp() + sum_pi_squared, norm, atol=1e-6, rtol=1e-6)
    if chunk_elements:
        with pytest.raises(ValueError, match="no chunked backward"):
            logprobs_and_statistic(logits=logits.requires_grad_(True), tokens=tokens, temperature=0.7, statistic="sum_pi_squared")


def test_inverse_cdf_sampling_follows_the_distribution_and_never_picks_a_truncated_token():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).expand(20000, 4)
    uniform = torch.rand(20000, generator=torch.Generator().manual_seed(0))
    tokens, _ = sample_next(logits=logits, temperature=1.0, top_p=1.0, top_k=0, uniform=uniform)
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.015)
    edge = torch.tensor([0.0, 0.999999, 1.0 - 2**-24])
    tokens, _ = sample_next(logits=logits[:3], temperature=1.0, top_p=0.7, top_k=0, uniform=edge)
    assert set(tokens.tolist()) <= {0, 1}  # top_p=0.7 keeps two tokens, even at the edges of [0, 1)


def test_the_sampled_token_is_the_first_whose_cumulative_mass_reaches_the_draw():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(64, 3000, generator=g) * 4
    uniform = torch.rand(64, generator=g)
    uniform[:3] = torch.tensor([1e-7, 0.5, 1.0 - 2**-24])
    for top_p, top_k, min_p in [(1.0, 0, 0.0), (0.9, 0, 0.0), (1.0, 50, 0.0), (0.8, 20, 0.0), (1.0, 0, 0.05), (0.9, 30, 0.1)]:
        tokens, _ = sample_next(logits=logits, temperature=0.9, top_p=top_p, top_k=top_k, uniform=uniform, min_p=min_p)
        kept = truncate_logits(logits=logits / 0.9, top_p=top_p, top_k=top_k, min_p=min_p)
        cdf = torch.softmax(kept, dim=-1).cumsum(-1)
        below = (cdf < uniform.unsqueeze(-1) * cdf[:, -1:]).sum(-1)
        assert tokens.tolist() == below.tolist()
        assert torch.isfinite(kept.gather(-1, tokens.unsqueeze(-1))).all()


def test_min_p_leaves_out_the_tokens_less_likely_than_its_share_of_the_likeliest():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isfinite(truncate_logits(logits=logits, top_p=1.0, top_k=0, min_p=0.2)).tolist() == [[True, True, True, False]]  # below 0.1
    assert torch.isfinite(truncate_logits(logits=logits, top_p=1.0, top_k=0, min_p=0.5)).tolist() == [[True, True, False, False]]  # below 0.25
    assert torch.isfinite(truncate_logits(logits=logits, top_p=1.0, top_k=0, min_p=0.99)).tolist() == [[True, False, False, False]]
    assert torch.equal(truncate_logits(logits=logits, top_p=1.0, top_k=0, min_p=0.0), logits)
    g = torch.Generator().manual_seed(1)
    tokens, logp = sample_next(logits=logits.expand(2000, 4), temperature=1.0, top_p=1.0, top_k=0, uniform=torch.rand(2000, generator=g), min_p=0.5)
    assert set(tokens.tolist()) == {0, 1}  # drawn 5:3 from what is left
    assert logp.tolist()[:1] == pytest.approx([math.log(0.5) if tokens[0] == 0 else math.log(0.3)], abs=1e-6)  # the log-prob stays the full distribution's


def test_a_draw_of_exactly_zero_never_takes_a_token_without_mass():
    logits = torch.tensor([[-1.0, 3.0, 2.0, -2.0]])
    tokens, _ = sample_next(logits=logits, temperature=1.0, top_p=1.0, top_k=2, uniform=torch.zeros(1))
    assert tokens.tolist() == [1]  # token 0 is outside the top 2: probability 0
    tokens, _ = sample_next(logits=logits, temperature=1.0, top_p=1.0, top_k=0, uniform=torch.zeros(1))
    assert tokens.tolist() == [0]


def test_a_rows_token_does_not_depend_on_the_other_rows():
    from rlctl.algos.logprobs import row_uniforms

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    draws = row_uniforms(9, range(6), 1)[:, 0]
    together, _ = sample_next(logits=logits, temperature=1.0, top_p=1.0, top_k=0, uniform=draws)
    alone = [sample_next(logits=logits[i : i + 1], temperature=1.0, top_p=1.0, top_k=0, uniform=draws[i : i + 1])[0].item() for i in range(6)]
    assert together.tolist() == alone


def test_a_rows_random_numbers_do_not_depend_on_the_rows_drawn_with_it():
    from rlctl.algos.logprobs import row_uniforms

    alone = row_uniforms(7, [5], 20)
    together = row_uniforms(7, [2, 5, 9], 20)
    assert together.shape == (3, 20) and torch.equal(together[1], alone[0])
    assert not torch.equal(together[0], together[1]) and ((together >= 0) & (together < 1)).all()
    assert row_uniforms(7, [], 20).shape == (0, 20)


def reference_logprobs_and_entropy(logits, tokens, temperature):
    """The plain definition, through autograd's log_softmax."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_probs_and_entropy_a_chunk_at_a_time_have_the_values_and_gradients_of_one_log_softmax(monkeypatch, dtype, temperature):
    """Chunks of positions (here 3 of a 2 × 5 batch) give the values of one log_softmax over
    all positions bit for bit, and their hand-written backward autograd's gradients, in float32
    math from bf16 logits too; an output the loss does not use adds nothing."""
    from rlctl.algos import logprobs

    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 3 * 13)
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 5, 13, generator=g) * 3).to(dtype)
    tokens = torch.randint(0, 13, (2, 5), generator=g)
    w_logp, w_entropy = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    grads = {}
    for name, fn in (("chunked", lambda x: logprobs_and_statistic(logits=x, tokens=tokens, temperature=temperature)),
                     ("reference", lambda x: reference_logprobs_and_entropy(x, tokens, temperature))):
        for uses in ("both", "logp", "entropy"):
            x = logits.clone().requires_grad_(True)
            logp, entropy = fn(x)
            loss = ((logp * w_logp).sum() if uses != "entropy" else 0) + ((entropy * w_entropy).sum() if uses != "logp" else 0)
            loss.backward()
            grads[name, uses] = (logp.detach(), entropy.detach(), x.grad)
    for uses in ("both", "logp", "entropy"):
        (logp, entropy, grad), (want_logp, want_entropy, want_grad) = grads["chunked", uses], grads["reference", uses]
        assert torch.equal(logp, want_logp) and torch.equal(entropy, want_entropy)
        assert grad.dtype == dtype
        torch.testing.assert_close(grad.float(), want_grad.float(), atol=1e-6 if dtype == torch.float32 else 1e-2, rtol=1e-5 if dtype == torch.float32 else 1e-2)
    with torch.no_grad():
        assert torch.equal(token_logprobs(logits=logits, tokens=tokens, temperature=temperature), grads["reference", "both"][0])


@pytest.mark.parametrize("chunk_elements", [None, 3 * 13])
def test_at_temperature_one_nothing_is_divided(monkeypatch, chunk_elements):
    """x / 1 is x: no pass over the [positions, V] logits for it, forward or backward, whole or
    a chunk at a time, nor when sampling."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from rlctl.algos import logprobs

    class Divisions(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Divisions.count += func.overloadpacket in (torch.ops.aten.div, torch.ops.aten.div_)
            return func(*args, **(kwargs or {}))

    if chunk_elements:
        monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", chunk_elements)
    logits = torch.randn(2, 5, 13, requires_grad=True)
    tokens = torch.randint(0, 13, (2, 5))
    with Divisions():
        logp, entropy = logprobs_and_statistic(logits=logits, tokens=tokens, temperature=1.0)
        (logp.sum() + entropy.sum()).backward()
        sample_next(logits=logits.detach()[0], temperature=1.0, top_p=0.9, top_k=5, uniform=torch.rand(5))
    assert Divisions.count == 0
