"""The learning rate at an optimizer step: a linear warm-up, then constant or a decay (linear
or cosine) to a floor — verl's `warmup_style` with `min_lr_ratio`, TRL's `lr_scheduler_type`.
A pure function of the step, so a resumed run takes the rate it would have taken unbroken."""

from __future__ import annotations

import math

from rlctl.choices import LR_SCHEDULES


def lr_at(step: int, *, lr: float, warmup_steps: int = 0, schedule: str = "constant", decay_steps: int = 0, min_lr_ratio: float = 0.0) -> float:
    """The rate of optimizer step `step` (0 = the first): `lr × (step + 1) / warmup_steps` during
    the warm-up; then `lr` (constant), or falling from `lr` at the warm-up's end to
    `lr × min_lr_ratio` at step `decay_steps` (linear: straight; cosine: half a cosine wave),
    and held there after."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; use {', '.join(LR_SCHEDULES)}")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    progress = min(1.0, (step - warmup_steps) / max(1, decay_steps - warmup_steps))
    remaining = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * remaining)
