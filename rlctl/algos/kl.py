"""KL estimators between the policy and the reference, per token, and the KL coefficient
controllers (fixed; adaptive as in Ziegler et al. 2019) whose state is carried across
iterations."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from rlctl.algos.registry import Registry


class KLEstimator(Protocol):
    def __call__(self, *, logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor: ...


KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def kl_k1(*, logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """log p - log q: unbiased, high variance, can be negative. [B, T] → [B, T]"""
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("abs")
def kl_abs(*, logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """|log p - log q|. [B, T] → [B, T]"""
    return (logprobs - ref_logprobs).abs()


@KL_ESTIMATORS.register("k2")
def kl_k2(*, logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """½ (log p - log q)²: biased, low variance, non-negative. [B, T] → [B, T]"""
    return 0.5 * (logprobs - ref_logprobs).square()


@KL_ESTIMATORS.register("k3")
def kl_k3(*, logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """exp(log q - log p) - (log q - log p) - 1: unbiased, low variance, non-negative
    (Schulman's k3). [B, T] → [B, T]"""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0


@dataclass(frozen=True)
class KLControllerState:
    kl_coef: float
    steps: int = 0


def next_kl_state(
    state: KLControllerState, *, controller: str, observed_kl: float, batch_sequences: int, target: float, horizon: int
) -> KLControllerState:
    """The coefficient for the next iteration. Fixed keeps it; adaptive moves it by a clipped
    proportional error: β ← β · (1 + clip(KL/target - 1, ±0.2) · n / horizon)."""
    if controller == "fixed":
        return KLControllerState(state.kl_coef, state.steps + 1)
    if controller == "adaptive":
        error = min(max(observed_kl / target - 1.0, -0.2), 0.2)
        return KLControllerState(state.kl_coef * (1.0 + error * batch_sequences / horizon), state.steps + 1)
    raise ValueError(f"unknown KL controller {controller!r}; use fixed or adaptive")
