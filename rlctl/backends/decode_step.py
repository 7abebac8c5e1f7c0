"""A decode step that runs a Llama-family model's layers directly: one new token per row.

transformers' forward of a causal LM costs the same Python whatever the batch: module calls,
decorators, output records, the attention mask rebuilt from the 2-D mask at every step. On the
CPU that is ~10 ms per decode step on the small preset's 8 layers (measured with the widths cut
to 64, where the products cost nothing: 12.5 → 8.7 ms per step of 64 rows, 10 → 4.7 ms for one
row). `DecodeStep` runs the decoder layers that Llama, Qwen2, Qwen3 and Mistral share (RMSNorm,
rotary q/k, grouped-query attention, gated MLP) without that Python: it calls the modules'
forwards directly (the norms, MLPs and rotary embedding are the model's own code) and does the
attention block's operations in its code's order, with rlctl's decode attention
(rlctl.backends.decode_attention) and the generation cache's layers (rlctl.backends.kv_cache),
so its logits are transformers' bit for bit (tests/unit/test_decode_step.py). Generation, small
preset, 64 × 64 tokens, fp32: bench/RESULTS.md.

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
from rlctl.backends.llama_layers import layer_parts, plain_layers
from rlctl.errors import InputError

OVERRIDE_ENV = "RLCTL_DECODE_STEP"
CHOICES = ("rlctl", "transformers")


class DecodeStep:
    """`step(tokens [B], positions [B], attention_mask [B, L]) → next-token logits [B, V]`:
    one token per row through `model`, its keys and values written into `cache` (the 2-D mask
    covers the cached tokens and the new one, as for transformers' forward). The norms, the MLPs
    and the rotary embedding are the model's own code; the attention block is its code's
    operations in its order."""

    def __init__(self, model, cache, products: DecodeProducts | None = None) -> None:
        base = model.model
        self.embed, self.rotary, self.norm = base.embed_tokens, base.rotary_emb, base.norm
        self.apply_rotary = sys.modules[type(model).__module__].apply_rotary_pos_emb
        self.cache_layers = cache.layers
        self.products = products or DecodeProducts(model, packed=False)
        self.layers = [layer_parts(layer) for layer in base.layers]

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        rows = tokens.shape[0]
        hidden = _call(self.embed, tokens.unsqueeze(-1))
        cos, sin = self.rotary(hidden, positions.unsqueeze(-1))
        mask = None
        for layer, products, cache_layer in zip(self.layers, self.products.layers, self.cache_layers):
            x = _call(layer.input_norm, hidden)
            shape = (rows, 1, -1, layer.head_dim)
            q, k, v = (p.view(shape) for p in products.qkv(x))
            if layer.q_norm is not None:
                q, k = _call(layer.q_norm, q), _call(layer.k_norm, k)
            v = v.transpose(1, 2)
            q, k = self.apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            keys, values = cache_layer.update(k, v)
            if mask is None:  # the cache's length (a block's multiple): its unwritten positions masked
                length = keys.shape[-2]
                mask = F.pad(attention_mask, (0, length - attention_mask.shape[1])).bool().view(rows, 1, 1, length)
            attended = decode_attention.decode_step_attention(q, keys, values, mask, layer.scaling)
            hidden = hidden + products.o(attended.reshape(rows, 1, -1).contiguous())
            hidden = hidden + products.mlp(_call(layer.post_norm, hidden))
        return self.products.lm_head(_call(self.norm, hidden))[:, -1, :]


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
