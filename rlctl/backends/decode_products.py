"""The decode step's linear products, from weights packed once per generation.

A decode step multiplies a few rows (one token per sequence) by every weight matrix of the
model. Both GEMM libraries of torch's x86 build run such a product faster from a weight they
packed into their own layout ahead of time than from a row-major weight they re-pack at every
call, and one product of q, k and v's weights stacked (of gate and up's) faster than two or
three small ones. The weights change with every optimizer step, so `generate` packs them once per
call (≈10 ms for the small preset) and holds the packed copy only while it runs, made only where
it takes at most a quarter of the memory available. Which library packs follows the one that
computes the model's products here (`packing`):

- oneDNN: fp32 where rlctl computes fp32 linear layers in oneDNN (rlctl.cpu_linear: non-Intel x86
  CPUs with AVX-512 where MKL's Intel kernels could not be loaded), bf16 where oneDNN computes it.
  Small preset, 64 rows, per layer, on a Zen 5: q/k/v 196 → 148 µs and gate/up 449 → 390 µs in
  fp32, a third to a half less at 8 rows; a 64 × 64 generation 0.90× the time. For two rows or
  more it sums in the order of the row-major product (bit for bit); for one row its packed kernel
  sums in another order, so one-row steps use the modules.
- MKL (`cblas_sgemm_pack` / `cblas_sgemm_compute`): fp32 where MKL computes the products with its
  Intel kernels (Intel CPUs; AMD CPUs, where rlctl.mkl_kernels selects them). Its packed weight
  serves exactly the row count it was packed for, so a product pads a batch that lost rows up to
  that count, and repacks for the rows left when a quarter of them are gone. Intel's AVX-512
  kernels, run on a Zen 5 as on a Xeon: a 64 × 64 generation 0.81× the time (MKL re-packs a weight
  at every row-major call, and takes 600–800 µs for gate/up at 16–56 rows against 490 at 64); its
  AVX2 kernels: 8–16 rows 0.67–0.78×, 64 rows about even. Its sums leave the row-major product's
  order where the reduction is long (the MLP's down projection) and below 13 rows: the same
  tokens, log-probs within ~2e-6.

bench/RESULTS.md, "Packed decode products" and "MKL's packed products". One-row steps use the
modules with either library; GPUs always do. `RLCTL_DECODE_PRODUCTS=modules` keeps the modules,
`=onednn` or `=mkl` packs with that library wherever it exists (to compare, or to debug).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from rlctl import cpu_linear, mkl_kernels
from rlctl.backends.llama_layers import call as _call
from rlctl.backends.llama_layers import layer_parts
from rlctl.dtypes import cpuinfo_text
from rlctl.errors import InputError

OVERRIDE_ENV = "RLCTL_DECODE_PRODUCTS"
CHOICES = ("packed", "modules", "onednn", "mkl")  # packed: by the library that computes the products here
MEMORY_SHARE = 0.25  # the most of the available memory a packed copy may take
REPACK_SHARE = 0.75  # MKL: a product repacks for its batch when at most this share of its packed rows is left


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


class OneDNNPackedProduct:
    """x·[W₁; W₂; …]ᵀ + [b₁; b₂; …] for linear layers that read the same input rows [B, width],
    as one oneDNN product of their stacked, packed weights: [B, Σ out widths], for any B."""

    def __init__(self, modules: Sequence[torch.nn.Linear], rows: int) -> None:
        with torch.no_grad():
            self.weight = torch.ops.mkldnn._reorder_linear_weight(stacked_weight(modules), rows)
        self.bias = stacked_bias(modules)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


class MKLPackedProduct:
    """The same product in MKL, from their stacked weight packed for a row count: MKL's packed
    weight serves exactly the rows it was packed for, so fewer rows are padded up to it (rows of
    a buffer: each output row reads only its own input row, and the padding's are dropped), and a
    quarter fewer (`REPACK_SHARE`) or more rows than it repack."""

    def __init__(self, modules: Sequence[torch.nn.Linear], rows: int) -> None:
        self.weight = stacked_weight(modules)  # what a repack packs (a stacked copy; a module's own weight alone)
        self.bias = stacked_bias(modules)
        self.rows = 0
        self._pack(rows)

    def _pack(self, rows: int) -> None:
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, rows)
        self.padded = self.weight.new_zeros(rows, self.weight.shape[1])  # a batch that lost rows, written over its first rows
        self.rows = rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows > self.rows or rows <= REPACK_SHARE * self.rows:
            self._pack(rows)
        if rows == self.rows:
            return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, rows)
        self.padded[:rows] = x
        return torch.ops.mkl._mkl_linear(self.padded, self.packed, self.weight, self.bias, self.rows)[:rows]


PACKED_PRODUCTS = {"onednn": OneDNNPackedProduct, "mkl": MKLPackedProduct}


def stacked_weight(modules: Sequence[torch.nn.Linear]) -> torch.Tensor:
    """[W₁; W₂; …]: the modules' weights one below the other (a single module's own weight)."""
    return torch.cat([m.weight.detach() for m in modules]) if len(modules) > 1 else modules[0].weight.detach()


def stacked_bias(modules: Sequence[torch.nn.Linear]) -> torch.Tensor | None:
    """[b₁; b₂; …], zeros for a module without a bias (x + 0 is x); None if none has one."""
    if all(m.bias is None for m in modules):
        return None
    with torch.no_grad():
        return torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in modules])


class PackedLayerProducts(ModuleProducts):
    """One decoder layer's products from packed weights (q/k/v stacked, gate/up stacked; `product`:
    a class of PACKED_PRODUCTS), the modules' own for one row. The gated MLP is its transformers
    code, `down(act(gate(x)) * up(x))`."""

    def __init__(self, layer, rows: int, product=OneDNNPackedProduct) -> None:
        super().__init__(layer)
        parts, mlp = self.parts, self.parts.mlp
        self.packed_qkv = product([parts.q_proj, parts.k_proj, parts.v_proj], rows)
        self.packed_o = product([parts.o_proj], rows)
        self.packed_gate_up = product([mlp.gate_proj, mlp.up_proj], rows)
        self.packed_down = product([mlp.down_proj], rows)
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
    head (`lm_head`), packed by `packing` (a key of PACKED_PRODUCTS) for `rows` rows, the
    modules' where it is None."""

    def __init__(self, model, *, packing: str | None = None, rows: int = 64) -> None:
        product = PACKED_PRODUCTS[packing] if packing else None
        layers = model.model.layers
        self.layers = [PackedLayerProducts(layer, rows, product) if product else ModuleProducts(layer) for layer in layers]
        self._lm_head = model.lm_head
        self._packed_head = product([model.lm_head], rows) if product else None

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed_head is None or _single_row(x):
            return _call(self._lm_head, x)
        return self._packed_head(x)


def for_generation(model, device: torch.device, rows: int) -> DecodeProducts:
    """The products for decoding batches of `rows` rows (the packing is chosen for them) through
    `model`: packed as `packing` says, the modules' otherwise."""
    return DecodeProducts(model, packing=packing(model, device, rows), rows=rows)


def packing(model, device: torch.device, rows: int) -> str | None:
    """Which library packs the weights for decoding through `model` ("onednn", "mkl"), or None
    for the modules: on the CPU, for batches of more than one row, the library that computes the
    model's products here where packing was measured to pay (`pays`), where the copy fits
    (`fits_in_memory`); RLCTL_DECODE_PRODUCTS=modules never packs, =onednn / =mkl packs with that
    library wherever it exists."""
    choice = os.environ.get(OVERRIDE_ENV, "").strip().lower() or "packed"
    if choice not in CHOICES:
        raise InputError(f"{OVERRIDE_ENV}={choice!r}: use one of {', '.join(CHOICES)}")
    if choice == "modules" or device.type != "cpu" or rows < 2:
        return None
    dtype = model.lm_head.weight.dtype
    library = pays(dtype) if choice == "packed" else choice
    if library is None or not _available(library, dtype):
        return None
    # MKL keeps the stacked weights beside the packed ones, to repack them when rows leave
    copies = 2 if library == "mkl" else 1
    return library if fits_in_memory(copies * sum(p.numel() * p.element_size() for p in model.parameters())) else None


def pays(dtype: torch.dtype) -> str | None:
    """The library whose packed products were measured faster than the modules' for `dtype` on
    this CPU: oneDNN where it computes the products (fp32 where rlctl.cpu_linear runs it, bf16
    where it has native bf16), MKL where it computes fp32 with its Intel kernels; else None (MKL's
    generic kernels, weight-first products: no faster packed)."""
    if dtype == torch.bfloat16:
        return "onednn" if _available("onednn", dtype) and torch.ops.mkldnn._is_mkldnn_bf16_supported() else None
    if dtype != torch.float32:
        return None
    path = cpu_linear.linear_path()
    if path == "onednn":
        return "onednn"
    return "mkl" if path == "blas" and mkl_kernels.runs_intel_kernels(cpuinfo_text()) else None


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


def _available(library: str, dtype: torch.dtype) -> bool:
    """Whether this torch build has `library`'s packed products for `dtype` (MKL's: fp32 only)."""
    if library == "mkl":
        ops = torch.ops.mkl
        return dtype == torch.float32 and torch.backends.mkl.is_available() and all(
            hasattr(ops, op) for op in ("_mkl_linear", "_mkl_reorder_linear_weight")
        )
    return torch.backends.mkldnn.is_available() and all(
        hasattr(torch.ops.mkldnn, op) for op in ("_linear_pointwise", "_reorder_linear_weight", "_is_mkldnn_bf16_supported")
    )


def _single_row(x: torch.Tensor) -> bool:
    return x.shape[0] == 1
