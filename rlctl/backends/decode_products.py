"""The decode step's linear products, from weights oneDNN packed once per generation.

A decode step multiplies a few rows (one token per sequence) by every weight matrix of the
model. oneDNN (in every x86 torch build) runs such a product faster from a weight it reordered
into its own blocked layout ahead of time than from a row-major weight it re-blocks at every
call, and one product of q, k and v's weights stacked (of gate and up's) faster than two or
three small ones. Small preset, 64 rows, per layer, on a Zen 5: q/k/v 196 → 148 µs and gate/up
449 → 390 µs in fp32, 129 → 80 and 235 → 195 µs in bf16, a third to a half less at 8 rows; a
64 × 64 generation 0.90× the time (bench/RESULTS.md, "Packed decode products"). The weights
change with every optimizer step, so `generate` packs them once per call (≈10 ms for the small
preset) and holds the packed copy only while it runs: one more copy of the weights the step
multiplies by, made only where it takes at most a quarter of the memory available.

The packed product sums in the order the row-major one does for two rows or more (bit for bit,
tests/unit/test_decode_products.py); for a single row oneDNN's packed kernel sums in another
order, so one-row steps use the model's own modules. Where: fp32 where rlctl computes fp32 linear
layers in oneDNN (rlctl.cpu_linear: non-Intel x86 CPUs with AVX-512), bf16 where oneDNN
computes it (torch's CPU bf16 products run there anyway); elsewhere (MKL's fp32, GPUs) the
modules. `RLCTL_DECODE_PRODUCTS=modules` keeps the modules (to compare, or to debug).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from rlctl import cpu_linear
from rlctl.backends.llama_layers import call as _call
from rlctl.backends.llama_layers import layer_parts
from rlctl.errors import InputError

OVERRIDE_ENV = "RLCTL_DECODE_PRODUCTS"
CHOICES = ("packed", "modules")
MEMORY_SHARE = 0.25  # the most of the available memory a packed copy may take


class ModuleProducts:
    """One decoder layer's products as the model's modules compute them, for rows [B, width]."""

    def __init__(self, layer) -> None:
        self.parts = layer_parts(layer)

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        """q, k and v side by side: [B, q width + k width + v width]."""
        parts = self.parts
        return torch.cat((_call(parts.q_proj, x), _call(parts.k_proj, x), _call(parts.v_proj, x)), dim=-1)

    def o(self, x: torch.Tensor) -> torch.Tensor:
        return _call(self.parts.o_proj, x)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return _call(self.parts.mlp, x)


class PackedProduct:
    """x·[W₁; W₂; …]ᵀ + [b₁; b₂; …] for linear layers that read the same input rows [B, width],
    as one oneDNN product of their stacked, packed weights: [B, Σ out widths]."""

    def __init__(self, modules: Sequence[torch.nn.Linear], rows: int) -> None:
        with torch.no_grad():
            weight = torch.cat([m.weight for m in modules]) if len(modules) > 1 else modules[0].weight
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)
            if all(m.bias is None for m in modules):
                self.bias = None
            else:  # a layer without a bias adds zeros: x + 0 is x
                self.bias = torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in modules])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


class PackedLayerProducts(ModuleProducts):
    """One decoder layer's products from packed weights (q/k/v stacked, gate/up stacked), the
    modules' own for one row. The gated MLP is its transformers code, `down(act(gate(x)) * up(x))`."""

    def __init__(self, layer, rows: int) -> None:
        super().__init__(layer)
        parts, mlp = self.parts, self.parts.mlp
        self.packed_qkv = PackedProduct([parts.q_proj, parts.k_proj, parts.v_proj], rows)
        self.packed_o = PackedProduct([parts.o_proj], rows)
        self.packed_gate_up = PackedProduct([mlp.gate_proj, mlp.up_proj], rows)
        self.packed_down = PackedProduct([mlp.down_proj], rows)
        self.intermediate = mlp.gate_proj.out_features

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        return super().qkv(x) if _single_row(x) else self.packed_qkv(x)

    def o(self, x: torch.Tensor) -> torch.Tensor:
        return super().o(x) if _single_row(x) else self.packed_o(x)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        if _single_row(x):
            return super().mlp(x)
        gate_up = self.packed_gate_up(x)
        return self.packed_down(self.parts.mlp.act_fn(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :])


class DecodeProducts:
    """The products of a decode step through `model`: per decoder layer (`layers`) and the LM
    head (`lm_head`), packed where `packs` says, the modules' otherwise."""

    def __init__(self, model, *, packed: bool, rows: int = 64) -> None:
        layers = model.model.layers
        self.layers = [PackedLayerProducts(layer, rows) if packed else ModuleProducts(layer) for layer in layers]
        self._lm_head = model.lm_head
        self._packed_head = PackedProduct([model.lm_head], rows) if packed else None

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed_head is None or _single_row(x):
            return _call(self._lm_head, x)
        return self._packed_head(x)


def for_generation(model, device: torch.device, rows: int) -> DecodeProducts:
    """The products for decoding `rows` rows at a time (the batch: oneDNN's packing is chosen for
    it) through `model`: packed where `packs` says, the modules' otherwise."""
    return DecodeProducts(model, packed=packs(model, device, rows), rows=rows)


def packs(model, device: torch.device, rows: int) -> bool:
    """Whether decoding through `model` multiplies by packed weights: on the CPU where oneDNN
    packs them, for batches of more than one row, in fp32 where rlctl's fp32 linear layers run in
    oneDNN, in bf16 where oneDNN computes bf16, where the copy fits (`fits_in_memory`); never
    with RLCTL_DECODE_PRODUCTS=modules."""
    choice = os.environ.get(OVERRIDE_ENV, "").strip().lower() or "packed"
    if choice not in CHOICES:
        raise InputError(f"{OVERRIDE_ENV}={choice!r}: use one of {', '.join(CHOICES)}")
    if choice != "packed" or device.type != "cpu" or rows < 2 or not _available():
        return False
    dtype = model.lm_head.weight.dtype
    if dtype == torch.float32:
        fast = cpu_linear.linear_path() == "onednn"
    else:
        fast = dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return fast and fits_in_memory(sum(p.numel() * p.element_size() for p in model.parameters()))


def fits_in_memory(copy_bytes: int, available: int | None = None) -> bool:
    """Whether a packed copy of `copy_bytes` leaves most of the memory available to the process
    free (MEMORY_SHARE of it at most; /proc/meminfo's MemAvailable where `available` is None):
    a speed-up must not be what makes a large model's rollout run out of memory."""
    available = _available_memory() if available is None else available
    return available is None or copy_bytes <= MEMORY_SHARE * available


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            lines = meminfo.readlines()
    except OSError:  # not Linux: nothing to go by
        return None
    return next((int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:")), None)


def _available() -> bool:
    return torch.backends.mkldnn.is_available() and all(
        hasattr(torch.ops.mkldnn, op) for op in ("_linear_pointwise", "_reorder_linear_weight", "_is_mkldnn_bf16_supported")
    )


def _single_row(x: torch.Tensor) -> bool:
    return x.shape[0] == 1
