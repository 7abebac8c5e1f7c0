"""fp32 linear layers through oneDNN on CPUs where torch's BLAS leaves half the machine idle.

torch's x86 CPU build does fp32 matmuls in MKL, and MKL picks its kernels by CPU vendor: on
an AMD EPYC with full-width AVX-512 (Zen 5) it runs its AVX2 path at about 210 GFLOP/s on two
cores, while oneDNN (also in every x86 torch build) runs the same fp32 GEMMs with AVX-512 at
about 460 (bench/RESULTS.md). So on a non-Intel x86 CPU with AVX-512 the `nn.Linear` layers of
the models rlctl holds compute their fp32 forward and both backward GEMMs with oneDNN; on Intel
CPUs (where MKL is already at its peak), under autocast, in bf16 and on GPUs nothing changes;
nor on AMD CPUs with AVX2 only (Zen 3: faster for some shapes, slower for others; generation
and training no faster, measured).
The results are fp32 either way (other summation orders: within ~1e-6 relative).
`RLCTL_CPU_LINEAR=onednn|blas` overrides the choice; it is made once per process.
"""

from __future__ import annotations

import functools
import os

import torch

from rlctl.dtypes import cpu_flags, cpuinfo_text

OVERRIDE_ENV = "RLCTL_CPU_LINEAR"
CHOICES = ("onednn", "blas")


def prefers_onednn(cpuinfo: str) -> bool:
    """Does this CPU (the text of /proc/cpuinfo) run fp32 GEMMs faster in oneDNN than in MKL?
    Yes for x86 CPUs of another vendor than Intel that have AVX-512."""
    vendors = {value.strip() for name, _, value in (line.partition(":") for line in cpuinfo.splitlines()) if name.strip() == "vendor_id"}
    return bool(vendors) and "GenuineIntel" not in vendors and "avx512f" in cpu_flags(cpuinfo)


@functools.cache
def uses_onednn() -> bool:
    """Whether fp32 CPU linear layers go through oneDNN in this process."""
    override = os.environ.get(OVERRIDE_ENV, "").strip().lower()
    if override in CHOICES:
        return override == "onednn" and _available()
    return _available() and prefers_onednn(cpuinfo_text())


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


def install(model: torch.nn.Module) -> torch.nn.Module:
    """Make the plain `nn.Linear` layers of `model` OneDNNLinear where this CPU rewards it (a
    class swap: weights, state dict and hooks stay as they are). Returns `model`."""
    if uses_onednn():
        for module in model.modules():
            if type(module) is torch.nn.Linear:
                module.__class__ = OneDNNLinear
    return model
