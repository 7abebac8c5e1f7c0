"""A decode step that runs a Llama-family model's layers directly: one new token per row.

transformers' forward of a causal LM costs the same Python whatever the batch: module calls,
decorators, output records, the attention mask rebuilt from the 2-D mask at every step. On the
CPU that is ~10 ms per decode step on the small preset's 8 layers (measured with the widths cut
to 64, where the products cost nothing: 12.5 → 8.7 ms per step of 64 rows, 10 → 4.7 ms for one
row). `DecodeStep` runs the decoder layers that Llama, Qwen2, Qwen3 and Mistral share (RMSNorm,
rotary q/k, grouped-query attention, gated MLP) without that Python: it calls the modules'
forwards directly (the norms, the rotary cos/sin, the MLPs) and does the attention block's
operations in its code's order, with rlctl's decode attention (rlctl.backends.decode_attention),
the generation cache's layers (rlctl.backends.kv_cache) and, where a GEMM library packs them,
products from packed weights (rlctl.backends.decode_products). With the modules' products its
logits are transformers' bit for bit (tests/unit/test_decode_step.py), and with oneDNN's packed
ones too (MKL's packed products sum in another order in places: log-probs within ~2e-6). Per
step it makes ~430 tensor operations on the small preset (from ~600 before rows were kept 2-D
and q/k rotated as one tensor). Where this step decodes, `generate` runs its loop in inference mode
(the model is plain: nothing keeps a tensor the loop makes), so those operations skip autograd's
bookkeeping: 2–11% less per generation. Generation, small preset, 64 × 64 tokens: bench/RESULTS.md.

It runs where the HF engine decodes with rlctl's CPU decode attention, for those model classes
only, and for plain linear layers without hooks (a LoRA adapter's layers, or anything else,
keep the model's forward). `RLCTL_DECODE_STEP=transformers` keeps transformers' forward (to
compare, or to debug).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from rlctl.backends import decode_attention
from rlctl.backends.decode_products import DecodeProducts
from rlctl.backends.llama_layers import call as _call
from rlctl.backends.llama_layers import plain_layers
from rlctl.errors import InputError

OVERRIDE_ENV = "RLCTL_DECODE_STEP"
CHOICES = ("rlctl", "transformers")


class DecodeStep:
    """`step(tokens [B], positions [B], attention_mask [B, L]) → next-token logits [B, V]`:
    one token per row through `model`, its keys and values written into `cache` (the 2-D mask
    covers the cached tokens and the new one, as for transformers' forward). The norms, the
    rotary cos/sin and the MLPs are the model's own code or its operations (`products`); the
    attention block is its code's operations in its order, q and k rotated as the Llama family's
    code rotates them (`rotated`; Qwen3's, normed first, by the model's function). Rows are 2-D ([B, width]: one token each) and what is the same for
    every layer (the additive attention mask, the rotary cos/sin) is made once per step: a step's
    fixed cost is its count of tensor operations."""

    def __init__(self, model, cache, products: DecodeProducts | None = None) -> None:
        base = model.model
        self.embed, self.rotary, self.norm = base.embed_tokens, base.rotary_emb, base.norm
        self.apply_rotary = sys.modules[type(model).__module__].apply_rotary_pos_emb
        self.cache_layers = cache.layers
        self.products = products or DecodeProducts(model)
        self.layers = [layer.parts for layer in self.products.layers]  # each decoder layer's parts, as its products found them
        # (query heads, key/value heads) per layer
        self.heads = [(layer.q_proj.out_features // layer.head_dim, layer.k_proj.out_features // layer.head_dim) for layer in self.layers]

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        rows = tokens.shape[0]
        hidden = _call(self.embed, tokens)  # [B, width]
        cos, sin = self.rotary(hidden, positions.unsqueeze(-1))  # [B, 1, head_dim]
        cos_heads, sin_heads = cos.unsqueeze(1), sin.unsqueeze(1)  # over [B, heads, 1, head_dim]
        mask = None
        for layer, (heads, kv_heads), products, cache_layer in zip(self.layers, self.heads, self.products.layers, self.cache_layers):
            qkv = products.qkv(_call(layer.input_norm, hidden)).view(rows, -1, 1, layer.head_dim)  # [B, heads + 2·kv_heads, 1, head_dim]
            if layer.q_norm is None:  # q and k rotated as one tensor: the same operations on each element
                qk = rotated(qkv[:, : heads + kv_heads], cos_heads, sin_heads)
                q, k = qk[:, :heads], qk[:, heads:]
            else:
                q, k = _call(layer.q_norm, qkv[:, :heads]), _call(layer.k_norm, qkv[:, heads : heads + kv_heads])
                q, k = self.apply_rotary(q, k, cos, sin)
            keys, values = cache_layer.update(k, qkv[:, heads + kv_heads :])
            if mask is None:  # the cache's length (a block's multiple): its unwritten positions masked
                mask = additive_mask(attention_mask, keys.shape[-2])
            attended = decode_attention.decode_step_attention(q, keys, values, mask, layer.scaling)
            hidden = hidden + products.o(attended.view(rows, -1))
            hidden = hidden + products.mlp(_call(layer.post_norm, hidden))
        return self.products.lm_head(_call(self.norm, hidden))


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of `x` [..., head_dim] as the Llama-family code computes it:
    x·cos + rotate_half(x)·sin, rotate_half(x) = (−x₂, x₁) of its halves."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def additive_mask(attention_mask: torch.Tensor, length: int) -> torch.Tensor:
    """The 2-D mask [B, L ≤ length] (1 attends) as 0 / −inf [B, 1, 1, length] (positions past L
    masked), added to the attention scores: what masking them with −inf gives, bit for bit."""
    rows = attention_mask.shape[0]
    attends = F.pad(attention_mask, (0, length - attention_mask.shape[1])).bool().view(rows, 1, 1, length)
    return torch.zeros((), dtype=torch.float32, device=attention_mask.device).masked_fill(~attends, float("-inf"))


def for_model(model, cache, products: DecodeProducts | None = None) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """The direct decode step for `model` decoding into `cache` (its products: `products`, the
    modules' own if None), or None where the model's own forward must run: another model class
    or layer kind, linear layers that are not plain (LoRA) or have hooks, attention other than
    rlctl's CPU decode attention, or RLCTL_DECODE_STEP."""
    if not enabled() or not supports(model) or not _plain_cache(cache, model):
        return None
    return DecodeStep(model, cache, products)


def enabled() -> bool:
    """Whether RLCTL_DECODE_STEP lets the direct step run (the default)."""
    choice = os.environ.get(OVERRIDE_ENV, "").strip().lower() or "rlctl"
    if choice not in CHOICES:
        raise InputError(f"{OVERRIDE_ENV}={choice!r}: use one of {', '.join(CHOICES)}")
    return choice == "rlctl"


def supports(model) -> bool:
    """Whether `model`'s decode steps can run here: plain layers of the Llama layout
    (`llama_layers.plain_layers`) in eval mode, decoding under rlctl's CPU attention."""
    return not model.training and getattr(model.config, "_attn_implementation", None) == decode_attention.NAME and plain_layers(model)


def _plain_cache(cache, model) -> bool:
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    return bool(layers) and len(layers) == len(model.model.layers) and all(isinstance(layer, DynamicLayer) for layer in layers)
