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

LOG_RATIO_BOUND = 20.0  # verl's clamp of log q - log p before exp: no overflow, no inf·0
K3_BOUND = 10.0  # verl's clamp of the k3 value: a bounded penalty, no gradient past it


def kl_k1(*, logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """log p - log q: unbiased, high variance, can be negative. [B, T] → [B, T]"""
    return logprobs - ref_logprobs


def kl_abs(*, logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """|log p - log q|. [B, T] → [B, T]"""
    return (logprobs - ref_logprobs).abs()


def kl_k2(*, logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """½ (log p - log q)²: biased, low variance, non-negative; its gradient is the KL's. [B, T] → [B, T]"""
    return 0.5 * (logprobs - ref_logprobs).square()


def kl_k3(*, logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """exp(log q - log p) - (log q - log p) - 1: unbiased, low variance, non-negative
    (Schulman's k3), bounded as verl bounds it (`low_var_kl`): the log-ratio clamped to ±20,
    the value to [-10, 10], so one extreme token cannot dominate and gets no gradient past
    the bound. [B, T] → [B, T]"""
    log_ratio = torch.clamp(ref_logprobs - logprobs, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, -K3_BOUND, K3_BOUND)


def straight_through(estimator: KLEstimator) -> KLEstimator:
    """The value of `estimator`, the gradient of k2 (an unbiased gradient of the KL; k1 and k3
    give unbiased values but not gradients): verl's `k3+`, `low_var_kl+`, ..."""

    def value_of_estimator_gradient_of_k2(*, logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
        value = estimator(logprobs=logprobs, ref_logprobs=ref_logprobs)
        surrogate = kl_k2(logprobs=logprobs, ref_logprobs=ref_logprobs)
        return surrogate - surrogate.detach() + value.detach()

    return value_of_estimator_gradient_of_k2


# rlctl's names and the names verl users type, for the same functions
for _names, _estimator in ((("k1", "kl"), kl_k1), (("abs",), kl_abs), (("k2", "mse"), kl_k2), (("k3", "low_var_kl"), kl_k3)):
    for _name in _names:
        KL_ESTIMATORS.register(_name)(_estimator)
        KL_ESTIMATORS.register(_name + "+")(kl_k2 if _estimator is kl_k2 else straight_through(_estimator))


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
