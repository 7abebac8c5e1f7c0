"""Attention for decoding on the CPU: one new token per row against its KV cache.

torch's CPU SDPA kernels are built for long queries; for one query token they cost several
times two batched matmuls (small preset, 64 rows, ~60 cached tokens, bf16: ~570 µs against
~160 µs per layer call). So the HF engine registers this function with transformers
(`AttentionInterface`, with SDPA's masks) and generates under it: a decode step computes q·Kᵀ
per key/value head for all the query heads that share it (no `repeat_kv` copy), the softmax in
fp32, then ·V, as transformers' eager attention does, which is also what the trainer's bf16
forward uses (`training_forward`). Prompts (more than one query token), GPUs and training
forwards go to SDPA unchanged. Generation, 64 × 64 tokens: 1.17 → 1.06 s in bf16, 1.74–1.91 →
1.64–1.91 s in fp32 (bench/RESULTS.md). `RLCTL_DECODE_ATTENTION=sdpa` turns it off.
"""

from __future__ import annotations

import torch

NAME = "rlctl_cpu_decode"


def cpu_decode_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
    dropout: float = 0.0, scaling: float | None = None, **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, H, q, D], key/value [B, Hkv, L, D];
    returns [B, q, H, D]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    single_token = query.shape[2] == 1 and query.device.type == "cpu" and not module.training
    if not single_token or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return decode_step_attention(query, key, value, attention_mask, scaling), None


def decode_step_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scaling: float | None) -> torch.Tensor:
    """softmax(q·Kᵀ·scaling + mask)·V for one query token, the query heads grouped onto the
    key/value heads they share (GQA). `mask`: bool (True attends) or additive, [B, 1 or H, 1, L]."""
    rows, heads, _, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    q = query.reshape(rows * kv_heads, groups, dim)
    keys, values = key.reshape(rows * kv_heads, length, dim), value.reshape(rows * kv_heads, length, dim)
    scores = torch.bmm(q, keys.transpose(1, 2))
    scores = (scores if scores.dtype == torch.float32 else scores.float()).mul_(dim**-0.5 if scaling is None else scaling)
    if mask is not None:
        scores = scores.view(rows, kv_heads, groups, length)
        if mask.shape != (rows, 1, 1, length):  # else one mask over every head, as the decode step makes it
            mask = mask[..., -length:].reshape(rows, kv_heads if mask.shape[1] > 1 else 1, -1, length)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = scores.softmax(dim=-1)
    probs = (probs if probs.dtype == value.dtype else probs.to(value.dtype)).view(rows * kv_heads, groups, length)
    return torch.bmm(probs, values).view(rows, 1, heads, dim)


def register() -> str:
    """Make NAME a transformers attention implementation (idempotent); returns it."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS.register(NAME, cpu_decode_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    return NAME
