"""Work timed with an environment switch alternating in one process.

A benchmark of a switch (RLCTL_KV_CACHE, RLCTL_DECODE_STEP, RLCTL_UNPADDED_FORWARD) compares its settings round by round
in one process rather than in separate runs: on a small shared machine the speed drifts by ±15%
over minutes, more than many levers are worth, and a pair of rounds run back to back sees the
same drift.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence


def alternate(policy, prompts, params, *, env: str, settings: Sequence[str], rounds: int, dtype: str, batch_size: int) -> tuple[dict[str, list[float]], dict[str, list]]:
    """`policy.generate` with `env` set to each of `settings` in turn, `rounds` times after a
    warm-up round: (seconds of each timed round per setting, the last round's generations per
    setting). `env` is restored afterwards."""
    return alternate_calls(
        lambda: policy.generate(prompts, params, batch_size=batch_size, compute_dtype=dtype), env=env, settings=settings, rounds=rounds,
        cuda=policy.device.type == "cuda",
    )


def alternate_calls(call: Callable[[], object], *, env: str, settings: Sequence[str], rounds: int, cuda: bool = False) -> tuple[dict[str, list[float]], dict[str, object]]:
    """`call()` with `env` set to each of `settings` in turn, `rounds` times after a warm-up
    round: (seconds of each timed round per setting, the last round's result per setting).
    `env` is restored afterwards."""
    import torch

    before = os.environ.get(env)
    seconds: dict[str, list[float]] = {setting: [] for setting in settings}
    outputs: dict[str, object] = {}
    try:
        for round_ in range(rounds + 1):
            for setting in settings:
                os.environ[env] = setting
                began = time.perf_counter()
                outputs[setting] = call()
                if cuda:
                    torch.cuda.synchronize()
                if round_:  # the first round warms up
                    seconds[setting].append(time.perf_counter() - began)
    finally:
        if before is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = before
    return seconds, outputs


def paired_ratios(seconds: dict[str, list[float]], new: str, old: str) -> list[float]:
    """Each round's time with `new` over its time with `old`: the drift between rounds cancels."""
    return [a / b for a, b in zip(seconds[new], seconds[old])]
