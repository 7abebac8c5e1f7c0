"""The packed forwards' attention on the CPU for short sequences: transformers' eager attention
with each key/value head's query heads stacked instead of its keys and values repeated.

Transformers' eager attention and its SDPA path on the CPU (with a mask) copy every key and value
head once per query head it serves (`repeat_kv`: 2× at the small preset, 7× at Qwen2.5-0.5B's)
and sum those copies' gradients back in the backward. Stacking a key/value head's query heads
into one [group × T, d] block makes the same products without the copies; the scores, softmax
(fp32) and mask are eager attention's, so its values are eager attention's (fp32: to float
rounding, ~4e-7, the taller blocks sum in another order; bf16: the same) and SDPA's (~1e-6).
Per layer, 54 rows × 63 queries × 75 keys, forward and backward (bench/RESULTS.md "Grouped
attention and compiled decoder layers"): 8 query / 4 key-value heads fp32 20.4 ms (SDPA's flash
kernel) → 9.6, bf16 11.7 (eager) → 7.4; 14 / 2 heads fp32 37.8 → 17.4, bf16 18.3 → 12.2.

It holds the [rows, heads, T, keys] probabilities for the backward where SDPA's flash kernel
holds none, so in fp32 it runs only while they stay small (MAX_FP32_SCORES: 16 MB a layer);
where transformers' eager attention runs (bf16 on the CPU for short sequences,
rlctl.backends.hf.training_forward) it always replaces it, holding less. Longer sequences keep
SDPA, called with its own grouped-query support (`sdpa`: the CPU flash kernel reads each
key/value head for its query heads, no copies; the same values as with repeated keys and
values, and at 4 rows × 500 tokens, 14 / 2 heads, forward + backward 57.4 → 49.7 ms a layer),
which transformers' SDPA path uses only without a mask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MAX_FP32_SCORES = 1 << 22  # score elements of one layer in place of SDPA's flash kernel (fp32: 16 MB)


def for_forward(implementation: str, device: torch.device, scores: int) -> tuple[Callable, bool] | None:
    """The attention function the packed attention of a forward whose model attends with
    `implementation` runs instead of the model's own, and whether its mask is additive (else
    bool); None: the model's own. On the CPU: `attend` in place of transformers' eager
    attention, or of SDPA (and rlctl's decode attention, which hands several query tokens to
    SDPA) while one layer's `scores` (rows × heads × queries × keys) are at most
    MAX_FP32_SCORES; beyond that `sdpa`."""
    if device.type != "cpu":
        return None
    if implementation == "eager" or scores <= MAX_FP32_SCORES:
        return attend, True
    return sdpa, False


def attend(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
    dropout: float = 0.0, scaling: float | None = None, **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, H, T, d], key/value [B, H_kv, S, d],
    an additive mask [B, 1, T, S] → [B, T, H, d]."""
    rows, heads, length, width = query.shape
    kv_heads, positions = key.shape[1], key.shape[2]
    group = heads // kv_heads  # query heads h = i × group + j share key/value head i, as repeat_kv has it
    scale = scaling if scaling is not None else width**-0.5
    scores = torch.matmul(query.reshape(rows, kv_heads, group * length, width), key.transpose(2, 3)) * scale
    scores = (scores.view(rows, kv_heads, group, length, positions) + attention_mask.unsqueeze(2)).view(rows, kv_heads, group * length, positions)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if dropout and module.training:
        weights = torch.nn.functional.dropout(weights, p=dropout, training=True)
    attended = torch.matmul(weights, value).view(rows, heads, length, width)
    return attended.transpose(1, 2).contiguous(), None


def sdpa(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
    dropout: float = 0.0, scaling: float | None = None, **kwargs,
) -> tuple[torch.Tensor, None]:
    """SDPA with its grouped-query support, a bool mask [B, 1, T, S]: → [B, T, H, d]."""
    attended = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=query.shape[1] != key.shape[1],
    )
    return attended.transpose(1, 2).contiguous(), None
