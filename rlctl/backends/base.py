"""The small interface a rollout engine implements, and the registry of engines.

The controller and stages talk to engines only through this: generate responses for token-id
prompts with sampling parameters. Two engines are registered: `hf` (transformers, the module
the trainer trains) and `vllm` (rlctl.backends.vllm_engine, weights pushed in place).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from rlctl.algos.registry import Registry
from rlctl.config import RolloutConfig, VLLMConfig


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()  # stop strings (rlctl.backends.stop_strings)
    min_p: float = 0.0  # min-p sampling: tokens below min_p × the likeliest's probability are not drawn; 0 = off
    repetition_penalty: float = 1.0  # the logits of tokens already in the prompt or response: / it where positive, × it where negative (before the temperature); 1 = off


@dataclass(frozen=True)
class Generation:
    response_ids: list[int]
    logprobs: list[float]  # log softmax(logits / temperature) of each sampled token
    finish_reason: str  # "stop" | "length"


class RolloutEngine(Protocol):
    tokenizer: object

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        batch_size: int = 64,
        on_tokens: Callable[[int], None] | None = None,
        compute_dtype: str = "fp32",
        first_row: int = 0,  # the global index of prompt_ids[0]: it names each row's random stream
        row_ids: Sequence[int] | None = None,  # each prompt's own global index instead (a subset of rows continuing)
    ) -> list[Generation]: ...


def stream_rows(count: int, first_row: int, row_ids: Sequence[int] | None) -> list[int]:
    """The global index of each of `count` prompts, which names its random stream."""
    return list(row_ids) if row_ids is not None else [first_row + i for i in range(count)]


def sampling_params(cfg: RolloutConfig, seed: int | None = None) -> SamplingParams:
    return SamplingParams(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k, cfg.seed if seed is None else seed, tuple(cfg.stop), cfg.min_p, cfg.repetition_penalty)


def _load_hf(model_uri: str, device: str, cfg: RolloutConfig, settings: VLLMConfig) -> RolloutEngine:
    from rlctl.backends.hf import HFPolicy

    return HFPolicy.load(model_uri, device)


def _load_vllm(model_uri: str, device: str, cfg: RolloutConfig, settings: VLLMConfig) -> RolloutEngine:
    from rlctl.backends.vllm_engine import VLLMEngine

    return VLLMEngine.load(model_uri, device, settings, compute_dtype=cfg.dtype, params=sampling_params(cfg), seed=cfg.seed)


# (model folder, device, [rollout], [vllm]) → engine
ROLLOUT_BACKENDS: Registry[Callable[[str, str, RolloutConfig, VLLMConfig], RolloutEngine]] = Registry("rollout backend")
ROLLOUT_BACKENDS.register("hf")(_load_hf)
ROLLOUT_BACKENDS.register("vllm")(_load_vllm)
