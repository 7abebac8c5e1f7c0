"""fp32 linear layers on the CPU, computed the way this CPU runs them fastest.

torch's x86 CPU build does fp32 matmuls in MKL, and MKL picks its kernels by CPU vendor: on
an AMD EPYC with full-width AVX-512 (Zen 5) its own choice is its AVX2 path, about 210 GFLOP/s
on two cores, while oneDNN (also in every x86 torch build) runs the same fp32 GEMMs with
AVX-512 at about 460 (bench/RESULTS.md). rlctl.mkl_kernels makes MKL run its Intel kernels
there (its AVX-512 ones, ~430 GFLOP/s, and an fp32 update 37% faster than with oneDNN's
products); only where that library could not be loaded (no C compiler) do the `nn.Linear`
layers of the models rlctl holds on a non-Intel x86 CPU with AVX-512 compute their fp32
forward and both backward GEMMs with oneDNN ("onednn").
On a non-Intel x86 CPU with AVX2 only (Zen 3) oneDNN is no faster end to end, but MKL's own
x·Wᵀ for a few rows is slower: as W·xᵀ (the weight first) the small preset's shapes ran 40–50%
faster at 64 rows. Outside the MLP the result's layout costs what that saves, so only the gated
MLP's projections (gate, up, down) go weight-first, for inference calls of few rows:
generation's decode steps and prompt passes ("weight-first": 4–10% less per generation, the
same tokens) — unless MKL runs its Intel kernels there (the default where a C compiler is
found): those run x·Wᵀ for few rows as fast, and weight-first was then 8% slower ("blas").
On Intel CPUs (where MKL runs its own kernels), under autocast, in bf16, for training and on
GPUs nothing changes ("blas"). The results are fp32 either way (other summation orders: within ~1e-6).
`RLCTL_CPU_LINEAR=onednn|weight-first|blas` overrides the choice; it is made once per process.
"""

from __future__ import annotations

import functools
import os

import torch

from rlctl import mkl_kernels
from rlctl.dtypes import cpu_flags, cpuinfo_text

OVERRIDE_ENV = "RLCTL_CPU_LINEAR"
CHOICES = ("onednn", "weight-first", "blas")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # gated MLPs: Llama, Qwen2, Mistral, Gemma
WEIGHT_FIRST_MAX_ROWS = 256  # up to here W·xᵀ measured faster than x·Wᵀ for every shape (Zen 3)


def prefers_onednn(cpuinfo: str, *, mkl_intel_kernels: bool = False) -> bool:
    """Does this CPU (the text of /proc/cpuinfo) run fp32 GEMMs faster in oneDNN than in MKL?
    Yes for x86 CPUs of another vendor than Intel that have AVX-512, where MKL runs its own
    choice of kernels (AVX2 at most); not where it runs its Intel ones (`mkl_intel_kernels`:
    rlctl.mkl_kernels), its AVX-512 kernels there."""
    return mkl_kernels.is_non_intel_x86(cpuinfo) and "avx512f" in cpu_flags(cpuinfo) and not mkl_intel_kernels


def prefers_weight_first(cpuinfo: str, *, mkl_intel_kernels: bool = False) -> bool:
    """Does MKL run few-row products faster with the weight first here? Measured so on x86 CPUs
    of another vendor than Intel with AVX2 and no AVX-512 (Zen 3), with MKL's own kernels for
    that CPU; not with its Intel kernels (`mkl_intel_kernels`: rlctl.mkl_kernels)."""
    return mkl_kernels.is_avx2_only(cpuinfo) and not mkl_intel_kernels


@functools.cache
def linear_path() -> str:
    """How fp32 CPU linear layers compute in this process: one of CHOICES."""
    override = os.environ.get(OVERRIDE_ENV, "").strip().lower()
    if override in CHOICES:
        return "blas" if override == "onednn" and not _available() else override
    cpuinfo = cpuinfo_text()
    intel_kernels = mkl_kernels.active()
    if _available() and prefers_onednn(cpuinfo, mkl_intel_kernels=intel_kernels):
        return "onednn"
    return "weight-first" if prefers_weight_first(cpuinfo, mkl_intel_kernels=intel_kernels) else "blas"


def _available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, K] @ b [N, K]ᵀ (+ bias) in oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(a.contiguous(), b.contiguous(), bias, "none", [], "")


class _OneDNNLinearFunction(torch.autograd.Function):
    """y = x Wᵀ + b with all three GEMMs (forward, input and weight gradients) in oneDNN."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _gemm(x.reshape(-1, x.shape[-1]), weight, bias).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _gemm(grad, weight.t()).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = _gemm(grad.t(), x.reshape(-1, x.shape[-1]).t())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.sum(0)
        return grad_x, grad_w, grad_b


class OneDNNLinear(torch.nn.Linear):
    """An `nn.Linear` whose fp32 CPU GEMMs run in oneDNN; anything else as `nn.Linear` does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.device.type != "cpu" or x.dtype != torch.float32 or self.weight.dtype != torch.float32
            or x.numel() == 0 or torch.is_autocast_enabled("cpu")
        ):
            return super().forward(x)
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return _OneDNNLinearFunction.apply(x, self.weight, self.bias)
        return _gemm(x.reshape(-1, x.shape[-1]), self.weight, self.bias).reshape(*x.shape[:-1], self.out_features)


class WeightFirstLinear(torch.nn.Linear):
    """An `nn.Linear` of a gated MLP whose fp32 CPU inference for few rows computes W·xᵀ and
    returns its transpose as a view (column-major): the elementwise product after gate and up
    keeps that layout, and down's W·xᵀ then reads it without a copy. Anything else (training,
    many rows, bf16, autocast, GPUs) as `nn.Linear` does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        if (
            torch.is_grad_enabled() or not 0 < rows <= WEIGHT_FIRST_MAX_ROWS or x.device.type != "cpu"
            or x.dtype != torch.float32 or self.weight.dtype != torch.float32 or torch.is_autocast_enabled("cpu")
        ):
            return super().forward(x)
        xt = x.reshape(rows, x.shape[-1]).t()
        out = torch.mm(self.weight, xt) if self.bias is None else torch.addmm(self.bias.unsqueeze(1), self.weight, xt)
        return out.t().reshape(*x.shape[:-1], self.out_features)


def install(model: torch.nn.Module) -> torch.nn.Module:
    """Give the plain `nn.Linear` layers of `model` the class this CPU's `linear_path` asks
    for: all of them OneDNNLinear, or the gated MLPs' projections WeightFirstLinear (a class
    swap: weights, state dict and hooks stay as they are). Returns `model`."""
    path = linear_path()
    if path == "blas":
        return model
    for name, module in model.named_modules():
        if type(module) is not torch.nn.Linear:
            continue
        if path == "onednn":
            module.__class__ = OneDNNLinear
        elif name.rpartition(".")[2] in MLP_PROJECTIONS:
            module.__class__ = WeightFirstLinear
    return model
