"""The one log-prob definition and the sampler's truncation."""

import torch

from rlctl.algos.logprobs import logprobs_and_entropy, sample_next, token_logprobs, truncate_logits


def test_greedy_picks_argmax_and_reports_temperature_one_logprob():
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    tokens, logp = sample_next(logits=logits, temperature=0.0, top_p=1.0, top_k=0, generator=None)
    assert tokens.tolist() == [1]
    assert torch.allclose(logp, torch.log_softmax(logits, -1)[:, 1])


def test_sampled_logprob_uses_temperature_and_matches_token_logprobs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 11, generator=g)
    tokens, logp = sample_next(logits=logits, temperature=0.7, top_p=0.9, top_k=5, generator=g)
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
