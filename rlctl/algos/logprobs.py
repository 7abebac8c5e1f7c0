"""The one definition of a log-prob in rlctl, and sampling.

A token's log-prob is `log_softmax(logits / temperature)[token]` (temperature 1 for greedy
decoding). top-p / top-k truncation changes which tokens can be sampled but not this number,
so the rollout engine, `score` and `update` all compute the same quantity from logits alone.
"""

from __future__ import annotations

import torch


def effective_temperature(temperature: float) -> float:
    return temperature if temperature > 0 else 1.0


def token_logprobs(*, logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits [..., V], tokens [...] → log-probs [...] (float32 math)."""
    scaled = logits.float() / effective_temperature(temperature)
    return torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def logprobs_and_entropy(*, logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V], tokens [...] → (log-probs [...], entropy [...]) from one log_softmax."""
    logp = torch.log_softmax(logits.float() / effective_temperature(temperature), dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def sample_next(
    *, logits: torch.Tensor, temperature: float, top_p: float, top_k: int, uniform: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V], uniform [B] in [0, 1) → (tokens [B], log-probs [B]). temperature 0 is greedy.

    Sampling is by inverse CDF from one uniform number per row, so a row's token depends only
    on its own logits and its own random stream, not on which other rows share the batch."""
    scaled = logits.float() / effective_temperature(temperature)
    logp = torch.log_softmax(scaled, dim=-1)
    if temperature <= 0:
        tokens = scaled.argmax(-1)
    else:
        filtered = truncate_logits(logits=scaled, top_p=top_p, top_k=top_k)
        cdf = torch.softmax(filtered, dim=-1).cumsum(-1)
        threshold = uniform.to(cdf.device, cdf.dtype).unsqueeze(-1) * cdf[:, -1:]  # < the total mass, so a token always wins
        tokens = (cdf < threshold).sum(-1).clamp(max=cdf.shape[-1] - 1)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def row_seed(seed: int, row: int) -> int:
    """The seed of sample row `row` (0-based across the whole output): every engine seeds
    each row's sampling with it, so rows do not depend on batching or workers."""
    return (seed * 1_000_003 + row) % (1 << 63)


def row_generator(seed: int, row: int) -> torch.Generator:
    """The random stream of sample row `row` for `seed` (the HF engine's sampler)."""
    return torch.Generator().manual_seed(row_seed(seed, row))


def truncate_logits(*, logits: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """Mask logits [B, V] outside the top-k and the smallest set with probability ≥ top_p."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits
