"""The learning rate by optimizer step: warm-up, then constant, or a linear or cosine decay to
a floor that holds after decay_steps."""

import math

import pytest

from rlctl.algos.lr_schedule import lr_at


def rates(steps, **schedule):
    return [lr_at(s, lr=1.0, **schedule) for s in steps]


def test_constant_after_a_linear_warm_up():
    assert rates(range(6), warmup_steps=4) == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert rates(range(3)) == [1.0, 1.0, 1.0]


def test_linear_decay_reaches_the_floor_at_decay_steps_and_holds_it():
    assert rates(range(0, 14, 2), schedule="linear", decay_steps=10, min_lr_ratio=0.1) == pytest.approx([1.0, 0.82, 0.64, 0.46, 0.28, 0.1, 0.1])


def test_cosine_decay_is_half_a_wave_from_the_warm_up_end():
    values = rates([0, 1, 2, 7, 12, 20], warmup_steps=2, schedule="cosine", decay_steps=12)
    assert values == pytest.approx([0.5, 1.0, 1.0, 0.5, 0.0, 0.0])  # halfway between step 2 and 12 is step 7
    assert lr_at(4, lr=2.0, warmup_steps=2, schedule="cosine", decay_steps=12, min_lr_ratio=0.5) == pytest.approx(
        2.0 * (0.5 + 0.5 * 0.5 * (1 + math.cos(math.pi * 0.2))))


def test_an_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="unknown lr schedule 'exponential'; use constant, linear, cosine"):
        lr_at(0, lr=1.0, schedule="exponential")
