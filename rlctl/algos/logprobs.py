"""The one definition of a log-prob in rlctl, and sampling.

A token's log-prob is `log_softmax(logits / temperature)[token]` (temperature 1 for greedy
decoding). top-p / top-k truncation changes which tokens can be sampled but not this number,
so the rollout engine, `score` and `update` all compute the same quantity from logits alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def effective_temperature(temperature: float) -> float:
    return temperature if temperature > 0 else 1.0


def scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature in float32, without the division where temperature is 1 (x / 1 is
    x exactly): over a [positions, V] tensor it is a pass of its own, and one more in backward."""
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


# float32 elements of one chunk's [rows, V] work tensors (64 MiB): a 151,936-token vocabulary
# is taken ~110 positions at a time, a small one all at once
CHUNK_ELEMENTS = 1 << 24


def token_logprobs(*, logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits [..., V], tokens [...] → log-probs [...] (float32 math)."""
    return logprobs_and_statistic(logits=logits, tokens=tokens, temperature=temperature, statistic=None)[0]


def entropy_of(logp: torch.Tensor) -> torch.Tensor:
    """H = −Σ p log p of log-softmax rows [..., V]."""
    return -(logp.exp() * logp).sum(-1)


def sum_pi_squared_of(logp: torch.Tensor) -> torch.Tensor:
    """Σ p² of log-softmax rows [..., V]: with a token's own p, 1 − 2p + Σ p² is the squared norm
    of its log-prob's gradient in the logits, ‖onehot − p‖² (the optimal token baseline's weight)."""
    return (2 * logp).exp().sum(-1)


# the per-position statistics of the distribution a forward can return beside the log-probs
POSITION_STATISTICS = {"entropy": entropy_of, "sum_pi_squared": sum_pi_squared_of}


def logprobs_and_statistic(
    *, logits: torch.Tensor, tokens: torch.Tensor, temperature: float, statistic: str | None = "entropy",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [..., V], tokens [...] → (log-probs [...], the `statistic` of each position's
    distribution [...] (POSITION_STATISTICS: its entropy, or Σ p²) or None) from one log_softmax
    per position, in float32. Past one chunk's size a chunk of positions at a time
    (`ChunkedLogSoftmax`): the [..., V] float32 tensors live one chunk at a time, forward and
    backward (the same values bit for bit; below it autograd's fused kernels are ~3% faster).
    Only the entropy has a chunked backward (the update's); Σ p² is score's, without gradient."""
    shape = tokens.shape
    temperature = effective_temperature(temperature)
    measure = POSITION_STATISTICS[statistic] if statistic is not None else None
    if logits.numel() <= CHUNK_ELEMENTS:
        logp = torch.log_softmax(scaled(logits, temperature), dim=-1)
        return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), (measure(logp) if measure is not None else None)
    flat_logits, flat_tokens = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1)
    if torch.is_grad_enabled() and flat_logits.requires_grad:
        if statistic not in (None, "entropy"):
            raise ValueError(f"{statistic} has no chunked backward: compute it without gradient")
        logp, value = ChunkedLogSoftmax.apply(flat_logits, flat_tokens, temperature)
    else:
        logp, value = _chunked_forward(flat_logits, flat_tokens, temperature, measure)
    return logp.reshape(shape), (value.reshape(shape) if measure is not None else None)


def _chunk_rows(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(vocab, 1))


def _chunked_forward(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, measure) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] → (log-prob of each token [N], `measure` of each row's log-softmax [N]:
    zeros when it is None)."""
    logp = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    value = torch.zeros_like(logp)
    step = _chunk_rows(logits.shape[-1])
    for start in range(0, logits.shape[0], step):
        rows = slice(start, start + step)
        chunk = torch.log_softmax(scaled(logits[rows], temperature), dim=-1)
        logp[rows] = chunk.gather(-1, tokens[rows].unsqueeze(-1)).squeeze(-1)
        if measure is not None:
            value[rows] = measure(chunk)
    return logp, value


class ChunkedLogSoftmax(torch.autograd.Function):
    """(log-prob of each token, entropy) of logits [N, V] with their gradients, keeping only the
    logits (in their own dtype: bf16 under autocast) for backward, which recomputes each chunk's
    softmax. Autograd through log_softmax would keep two float32 [N, V] tensors per micro-batch
    (the log-softmax and its exp) and make several more at once: for a 151,936-token vocabulary
    1.2 GB per 1,000 response tokens.

    With p = softmax(x), x = logits / temperature, H = −Σ p log p:
    ∂ log p[t] / ∂x = onehot(t) − p,  ∂H / ∂x = −p (log p + H)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor, temperature: float):
        logp, entropy = _chunked_forward(logits, tokens, temperature, entropy_of)
        ctx.save_for_backward(logits, tokens, entropy)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)  # an unused output's gradient comes as None, not zeros
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        logits, tokens, entropy = ctx.saved_tensors
        return _chunked_backward(logits, tokens, entropy, ctx.temperature, grad_logp, grad_entropy), None, None


def _chunked_backward(
    logits: torch.Tensor, tokens: torch.Tensor, entropy: torch.Tensor, temperature: float,
    grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None,
) -> torch.Tensor:
    """∂loss/∂logits [N, V] a chunk of rows at a time (ChunkedLogSoftmax's formulas). Each
    chunk's [rows, V] work is few passes: the softmax's exp in place, −p·g written straight into
    the gradient where it is float32 and needs no division by a temperature."""
    grad = torch.empty_like(logits)
    direct = grad.dtype == torch.float32 and temperature == 1.0  # −p·g can be the gradient's own rows
    step = _chunk_rows(logits.shape[-1])
    for start in range(0, logits.shape[0], step):
        rows = slice(start, start + step)
        logp = torch.log_softmax(scaled(logits[rows], temperature), dim=-1)
        p = logp.exp() if grad_entropy is not None else logp.exp_()
        if grad_logp is not None:
            g = torch.mul(p, -grad_logp[rows].unsqueeze(-1), out=grad[rows] if direct else None)
            g.scatter_add_(-1, tokens[rows].unsqueeze(-1), grad_logp[rows].unsqueeze(-1).float())
            if grad_entropy is not None:
                g -= p * (logp + entropy[rows].unsqueeze(-1)) * grad_entropy[rows].unsqueeze(-1)
        else:
            g = torch.mul(p * (logp + entropy[rows].unsqueeze(-1)), -grad_entropy[rows].unsqueeze(-1), out=grad[rows] if direct else None)
        if not direct:
            grad[rows] = g if temperature == 1.0 else g / temperature
    return grad


def sample_next(
    *, logits: torch.Tensor, temperature: float, top_p: float, top_k: int, uniform: torch.Tensor, min_p: float = 0.0,
    seen: torch.Tensor | None = None, repetition_penalty: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V], uniform [B] in [0, 1) → (tokens [B], log-probs [B]). temperature 0 is greedy.

    Sampling is by inverse CDF from one uniform number per row, so a row's token depends only
    on its own logits and its own random stream, not on which other rows share the batch. With
    `seen` ([B, V]: the tokens each row's prompt and response hold so far) the draw is from the
    logits with `repetition_penalty` applied (`penalized`); the log-probs stay the policy's."""
    x = scaled(logits, effective_temperature(temperature))
    logp = torch.log_softmax(x, dim=-1)
    if seen is not None and repetition_penalty != 1.0:
        x = scaled(penalized(logits, seen, repetition_penalty), effective_temperature(temperature))
    if temperature <= 0:
        tokens = x.argmax(-1)
    else:
        filtered = truncate_logits(logits=x, top_p=top_p, top_k=top_k, min_p=min_p)
        cdf = torch.softmax(filtered, dim=-1).cumsum(-1)
        # the threshold is < the total mass, so a token always wins, and > 0, so a draw of exactly
        # 0 takes the first token with any mass, not token 0 whatever its probability
        threshold = (uniform.to(cdf.device, cdf.dtype).unsqueeze(-1) * cdf[:, -1:]).clamp(min=torch.finfo(cdf.dtype).tiny)
        # the token: the number of cdf entries below the threshold, found by bisection (the cdf
        # never decreases); counting them over [B, V] booleans cost a pass and an int64 copy
        tokens = torch.searchsorted(cdf, threshold).squeeze(-1).clamp(max=cdf.shape[-1] - 1)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def penalized(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """The logits of the `seen` tokens made less likely (penalty > 1): divided by it where
    positive, multiplied where negative — transformers' RepetitionPenaltyLogitsProcessor and
    vLLM's repetition_penalty, over the prompt's and the response's tokens."""
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def row_seed(seed: int, row: int) -> int:
    """The seed of sample row `row` (0-based across the whole output): every engine seeds
    each row's sampling with it, so rows do not depend on batching or workers."""
    return (seed * 1_000_003 + row) % (1 << 63)


def row_generator(seed: int, row: int) -> torch.Generator:
    """The random stream of sample row `row` for `seed` (the HF engine's sampler)."""
    return torch.Generator().manual_seed(row_seed(seed, row))


def row_uniforms(seed: int, rows: Sequence[int], steps: int) -> torch.Tensor:
    """[len(rows), steps]: the uniform numbers in [0, 1) that each sample row draws, one per
    decode step, from its own stream; drawn once per batch so that the decode loop does no
    Python work per row."""
    if not rows:
        return torch.zeros((0, steps))
    return torch.stack([torch.rand(steps, generator=row_generator(seed, row)) for row in rows])


def truncate_logits(*, logits: torch.Tensor, top_p: float, top_k: int, min_p: float = 0.0) -> torch.Tensor:
    """Mask logits [B, V] outside the top-k, the smallest set with probability ≥ top_p, and the
    tokens less likely than min_p × the likeliest's probability (min-p sampling, applied last
    as transformers' and vLLM's: a ratio of probabilities, so no renormalization changes it)."""
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
    if min_p > 0.0:
        logits = logits.masked_fill(logits < logits.max(dim=-1, keepdim=True).values + math.log(min_p), float("-inf"))
    return logits
