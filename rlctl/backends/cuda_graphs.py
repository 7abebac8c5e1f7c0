"""Decoding on a GPU by replaying a captured CUDA graph of the decode step.

On a GPU a decode step of a model this size is bound by launching its kernels, not by running
them: on an H200, Qwen2.5-0.5B's shape, 64 rows, transformers' forward took ~22 ms a step
(2,880 tokens/s) for ~1 GB of weights that the GPU reads in a quarter of a millisecond. So the
direct decode step (rlctl.backends.decode_step: the Llama family's layers, without transformers'
Python) is captured once per batch into a CUDA graph and each step replays it: one launch for
every kernel of the step. A graph's shapes and addresses are fixed, so the batch decodes into a
static KV cache (`StaticLayer`: buffers for the prompt and every new token, written at a slot
held in a device tensor) under a 2-D mask of that full length whose columns open as tokens are
written; finished rows stay in the batch (their later tokens are not kept) instead of leaving
it, and the loop looks for the end of the batch every CHECK_EVERY steps, not at each one
(every look waits for the GPU). Sampling stays outside the graph (rlctl.algos.logprobs.sample_next,
the same code as everywhere). On that H200, 64 × 128 tokens in bf16: 14,725 tokens/s against
2,345 with one launch per kernel (bench/RESULTS.md, "The first GPU runs").

Where it runs: a CUDA device, the model's layers plain and of the Llama layout
(rlctl.backends.llama_layers), the static cache within a share of the free GPU memory.
`RLCTL_CUDA_GRAPHS=off` keeps transformers' forward, one launch per kernel (to compare, or to
debug).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicLayer

from rlctl.backends import decode_step
from rlctl.backends.decode_products import DecodeProducts
from rlctl.backends.llama_layers import plain_layers
from rlctl.errors import InputError

OVERRIDE_ENV = "RLCTL_CUDA_GRAPHS"
CHOICES = ("on", "off")
CHECK_EVERY = 8  # steps between looks for a batch whose rows have all stopped
MEMORY_SHARE = 0.5  # the most of the GPU's free memory a batch's static cache may take


def decode_mode(model, device: torch.device) -> str | None:
    """How `generate` decodes through `model`: "graph" (a captured decode step replayed, on a
    CUDA device, where the direct step can run) or None (the step-by-step loop)."""
    choice = os.environ.get(OVERRIDE_ENV, "").strip().lower() or "on"
    if choice not in CHOICES:
        raise InputError(f"{OVERRIDE_ENV}={choice!r}: use one of {', '.join(CHOICES)}")
    if choice == "off" or device.type != "cuda" or model.training or not decode_step.enabled():
        return None
    return "graph" if plain_layers(model) else None


def cache_bytes(cache, rows: int, capacity: int) -> int:
    """The bytes a static cache of `capacity` positions for `rows` rows takes, layer by layer
    as `cache` (after the prompt pass) holds them."""
    total = 0
    for layer in cache.layers:
        _, heads, _, dim = layer.keys.shape
        total += 2 * rows * heads * capacity * dim * layer.keys.element_size()
    return total


def fits(cache, rows: int, capacity: int, device: torch.device) -> bool:
    """Whether the static cache fits in MEMORY_SHARE of what is free on `device` now."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return cache_bytes(cache, rows, capacity) <= MEMORY_SHARE * free


class StaticLayer(DynamicLayer):
    """One layer's keys and values [B, H, capacity, D] in fixed buffers: `update` writes the new
    token's at the position `slot` holds (a device tensor, so that a replayed graph writes where
    the step says) and returns the whole buffers; positions not yet written are zeros, masked."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slot: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values, self.slot = keys, values, slot
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys.index_copy_(2, self.slot, key_states)
        self.values.index_copy_(2, self.slot, value_states)
        return self.keys, self.values


@dataclass
class _Layers:
    layers: list[StaticLayer]


class StaticDecoder:
    """The direct decode step over a static cache that continues `cache` (the prompt pass's,
    its first `prompt_length` positions, the width of `attention_mask` [B, prompt_length]) for
    `steps` new tokens. `__call__(tokens [B], positions [B], step)` → next-token logits [B, V]
    of the token written at step `step` (0-based). `graph=True` captures the step into a CUDA
    graph on the first call and replays it after; False runs the same operations as they are
    (the CPU's tests check those against the step-by-step loop). The logits are the decoder's
    own buffer when graphed: read them before the next call."""

    def __init__(self, model, cache, attention_mask: torch.Tensor, steps: int, *, graph: bool) -> None:
        rows, prompt_length = attention_mask.shape
        capacity = prompt_length + steps
        device = attention_mask.device
        self.prompt_length = prompt_length
        self.slot = torch.full((1,), prompt_length, dtype=torch.long, device=device)
        layers = []
        for layer in cache.layers:
            keys = _extended(layer.keys[:, :, :prompt_length], capacity)
            values = _extended(layer.values[:, :, :prompt_length], capacity)
            layers.append(StaticLayer(keys, values, self.slot))
        self.mask = attention_mask.new_zeros((rows, capacity))
        self.mask[:, :prompt_length] = attention_mask
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.step = decode_step.DecodeStep(model, _Layers(layers), DecodeProducts(model))
        self.graph = torch.cuda.CUDAGraph() if graph else None
        self.logits: torch.Tensor | None = None
        self._captured = False

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, step: int) -> torch.Tensor:
        column = self.prompt_length + step
        self.mask[:, column] = 1  # the new token attends to itself; later tokens attend to it
        self.slot.fill_(column)
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        if self.graph is None:
            return self.step(self.tokens, self.positions, self.mask)
        if not self._captured:
            self._capture()
        self.graph.replay()
        return self.logits

    def _capture(self) -> None:
        """Warm the step up on a side stream (its first run allocates and picks its kernels:
        nothing a graph may record), then record it; the warm-up's cache writes are the step's own."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.step(self.tokens, self.positions, self.mask)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph):
            self.logits = self.step(self.tokens, self.positions, self.mask)
        self._captured = True


def _extended(prompt_part: torch.Tensor, capacity: int) -> torch.Tensor:
    """[B, H, capacity, D]: `prompt_part`'s positions first, zeros after them."""
    buffer = prompt_part.new_zeros(prompt_part.shape[:2] + (capacity,) + prompt_part.shape[3:])
    buffer[:, :, : prompt_part.shape[2]] = prompt_part
    return buffer
