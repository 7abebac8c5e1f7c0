"""The one log-prob definition and the sampler's truncation."""

import torch

from rlctl.algos.logprobs import logprobs_and_entropy, sample_next, token_logprobs, truncate_logits


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


def test_logprobs_and_entropy_share_one_definition():
    g = torch.Generator().manual_seed(1)
    logits, tokens = torch.randn(3, 5, 9, generator=g), torch.randint(0, 9, (3, 5), generator=g)
    logp, entropy = logprobs_and_entropy(logits=logits, tokens=tokens, temperature=0.5)
    assert torch.allclose(logp, token_logprobs(logits=logits, tokens=tokens, temperature=0.5))
    probs = torch.softmax(logits / 0.5, -1)
    assert torch.allclose(entropy, -(probs * probs.log()).sum(-1), atol=1e-6)


def test_inverse_cdf_sampling_follows_the_distribution_and_never_picks_a_truncated_token():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).expand(20000, 4)
    uniform = torch.rand(20000, generator=torch.Generator().manual_seed(0))
    tokens, _ = sample_next(logits=logits, temperature=1.0, top_p=1.0, top_k=0, uniform=uniform)
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.015)
    edge = torch.tensor([0.0, 0.999999, 1.0 - 2**-24])
    tokens, _ = sample_next(logits=logits[:3], temperature=1.0, top_p=0.7, top_k=0, uniform=edge)
    assert set(tokens.tolist()) <= {0, 1}  # top_p=0.7 keeps two tokens, even at the edges of [0, 1)


def test_a_rows_token_does_not_depend_on_the_other_rows():
    from rlctl.algos.logprobs import row_generator

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    draws = torch.stack([torch.rand((), generator=row_generator(9, row)) for row in range(6)])
    together, _ = sample_next(logits=logits, temperature=1.0, top_p=1.0, top_k=0, uniform=draws)
    alone = [sample_next(logits=logits[i : i + 1], temperature=1.0, top_p=1.0, top_k=0, uniform=draws[i : i + 1])[0].item() for i in range(6)]
    assert together.tolist() == alone
