"""The KV cache `generate` decodes with: buffers grown a block of positions at a time.

transformers' DynamicCache appends each new token's keys and values with `torch.cat`, which
copies the whole cache of every layer at every decode step: for long responses that copy costs
as much as the attention that reads the cache (small preset, 64 rows × 512 new tokens, bf16:
~1.5 s of a 9 s generation). Writing into a preallocated buffer and attending over a slice of
it does not help on the CPU: a slice of the position axis is a strided batch, and torch's bf16
batched matmul copies it (or takes a slow path) at every call. So each layer here keeps its keys
and values in a contiguous buffer whose length is a multiple of BLOCK positions, writes new
tokens in place, and returns the whole buffer; the positions not yet written are masked (the
caller's 2-D attention mask is padded with zeros to `get_mask_sizes`, and they lie after the
query in the causal mask too), so attention sees exactly the tokens it did before, plus fewer
than BLOCK masked ones. A buffer is copied once per BLOCK steps instead of once per step.
Figures: bench/RESULTS.md "A KV cache grown in blocks". `RLCTL_KV_CACHE=dynamic` keeps
transformers' cache (to compare, or to debug).

Only plain full-attention layers are replaced (sliding-window and other layer kinds keep their
own cache classes), and only for generation: the trainer's prompt-sharing forward needs
autograd through the cache, which in-place writes would complicate for nothing.
"""

from __future__ import annotations

import os

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from rlctl.errors import InputError

BLOCK = 16
OVERRIDE_ENV = "RLCTL_KV_CACHE"
CHOICES = ("blocks", "dynamic")


def padded_length(positions: int) -> int:
    """The buffer length that holds `positions`: the next multiple of BLOCK."""
    return -(-positions // BLOCK) * BLOCK


def decoding_cache(config) -> DynamicCache:
    """A transformers cache for generation: a `BlockLayer` for each plain full-attention layer,
    transformers' own for other kinds; transformers' DynamicCache where RLCTL_KV_CACHE=dynamic."""
    choice = os.environ.get(OVERRIDE_ENV, "").strip().lower() or "blocks"
    if choice not in CHOICES:
        raise InputError(f"{OVERRIDE_ENV}={choice!r}: use one of {', '.join(CHOICES)}")
    cache = DynamicCache(config=config)
    if choice == "blocks":
        if not cache.layers:  # the config names no layer types: layers are made as they are first used
            cache.layer_class_to_replicate = BlockLayer
        cache.layers = [BlockLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


class BlockLayer(DynamicLayer):
    """One layer's keys and values [B, H, capacity, D], capacity a multiple of BLOCK: the first
    `length` positions hold tokens, the rest zeros that the attention mask hides (zeros, not
    garbage: a masked probability of 0 times a NaN would still be NaN)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.keys = key_states.new_zeros(key_states.shape[:2] + (0,) + key_states.shape[3:])
        self.values = value_states.new_zeros(value_states.shape[:2] + (0,) + value_states.shape[3:])
        self.length = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.keys.shape[-2]:
            self.keys, self.values = _grown(self.keys, start, end), _grown(self.values, start, end)
        self.keys[:, :, start:end] = key_states
        self.values[:, :, start:end] = value_states
        self.length = end
        if start == 0:  # the prompt attends over exactly its own tokens (as get_mask_sizes said)
            return key_states, value_states
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The length `update` will return for `query_length` new tokens: theirs into an empty
        layer, else the whole buffer once it holds them."""
        length = self.get_seq_length()
        if length == 0:
            return query_length, 0
        return max(self.keys.shape[-2], padded_length(length + query_length)), 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` tokens (transformers' convention: a negative count);
        their positions become masked zeros again."""
        if tokens_to_remove > 0 or not self.is_initialized:
            return super().crop(tokens_to_remove)  # transformers' error for a positive count; nothing to do empty
        kept = max(self.length + tokens_to_remove, 0)
        self.keys[:, :, kept : self.length] = 0
        self.values[:, :, kept : self.length] = 0
        self.length = kept


def _grown(buffer: torch.Tensor, length: int, positions: int) -> torch.Tensor:
    """A buffer for `positions` (rounded up to BLOCK) holding `buffer`'s first `length`, zeros
    after them. Only the positions past `length` are zeroed: zeroing all of it first cost ~4×
    as much (64 rows, 80 positions: 680 → 180 µs per buffer)."""
    grown = buffer.new_empty(buffer.shape[:2] + (padded_length(positions),) + buffer.shape[3:])
    grown[:, :, :length] = buffer[:, :, :length]
    grown[:, :, length:] = 0
    return grown
