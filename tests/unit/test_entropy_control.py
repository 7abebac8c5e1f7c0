"""update.entropy_target: Skywork-OR1's adaptive entropy control. The bonus applies only after
a step that measured the entropy at or below the target; its coefficient moves one step per
optimizer step within its bounds, is what the loss takes, and survives a checkpoint."""

import numpy as np
import pytest
import torch

from rlctl import trainer_state
from rlctl.algos.entropy_control import EntropyControl
from rlctl.backends.hf import HFPolicy
from rlctl.checkpoint import save_trainer_state
from rlctl.config import UpdateConfig
from rlctl.errors import InputError
from rlctl.trainer import Trainer, flat_gradients
from tests.unit.test_trainer import make_batch

STEP = {"delta": 0.005, "low": 0.0, "high": 0.02}


def test_the_bonus_waits_for_a_measurement_at_or_below_the_target():
    fresh = EntropyControl(0.01)
    assert fresh.applied(target=0.5) == 0.0  # nothing measured yet
    assert EntropyControl(0.01, last_entropy=0.5).applied(target=0.5) == 0.01
    assert EntropyControl(0.01, last_entropy=0.6).applied(target=0.5) == 0.0


def test_the_coefficient_steps_up_at_or_below_the_target_and_down_above_within_its_bounds():
    control, coefs = EntropyControl(0.01), []
    for entropy in (0.4, 0.5, 0.3, 0.2, 0.9, 0.9, 0.9, 0.9):
        control = control.after_step(entropy, target=0.5, **STEP)
        coefs.append(control.coef)
    assert coefs == pytest.approx([0.015, 0.02, 0.02, 0.02, 0.015, 0.01, 0.005, 0.0])
    assert control.last_entropy == 0.9


@pytest.mark.parametrize("saved", [{"coef": 0.01}, {"coef": "x", "last_entropy": None}, {"coef": None, "last_entropy": 0.1}, [0.01, None], {"coef": 0.1, "last_entropy": True}])
def test_a_malformed_saved_state_is_refused(saved):
    with pytest.raises(InputError, match="entropy_control must be"):
        EntropyControl.from_json(saved, where="state.json")
    assert EntropyControl.from_json({"coef": 0.1, "last_entropy": None}, where="state.json") == EntropyControl(0.1)


@pytest.fixture
def policy(tiny_model):
    return HFPolicy.load(tiny_model, "cpu")


@pytest.mark.parametrize("last_entropy,fixed", [(0.1, 0.05), (50.0, 0.0)])
def test_a_step_under_control_is_the_step_of_the_fixed_coefficient_it_applies(policy, last_entropy, fixed):
    batch = make_batch(seed=3)
    n = batch.size
    trainer = Trainer(policy, UpdateConfig(micro_batch_size=n, entropy_target=1.0))
    trainer.entropy_control = EntropyControl(0.05, last_entropy=last_entropy)
    controlled = trainer.accumulate_gradients(batch, torch.arange(n))
    got = flat_gradients(policy.model)
    Trainer(policy, UpdateConfig(micro_batch_size=n, entropy_coef=fixed)).accumulate_gradients(batch, torch.arange(n))
    np.testing.assert_allclose(got, flat_gradients(policy.model), atol=1e-7, rtol=0)
    assert controlled["entropy_coef_applied"] == fixed


@pytest.mark.parametrize("target,applied,after", [(100.0, [0.0, 0.015, 0.02, 0.02], 0.02), (1e-6, [0.0, 0.0, 0.0, 0.0], 0.0)])
def test_an_update_moves_the_coefficient_once_per_optimizer_step_and_reports_it(tiny_model, monkeypatch, target, applied, after):
    """Four optimizer steps (mini-batches of 2): the tiny model's entropy (~6 nats) is below a
    target of 100 at every step and above one of 1e-6."""
    import rlctl.trainer as trainer_module

    seen = []
    bonus = trainer_module.Trainer.entropy_bonus
    monkeypatch.setattr(trainer_module.Trainer, "entropy_bonus", lambda self: seen.append(bonus(self)) or seen[-1])
    cfg = UpdateConfig(lr=1e-3, mini_batch_size=2, entropy_coef=0.01, entropy_target=target, entropy_coef_delta=0.005, entropy_coef_max=0.02)
    metrics = Trainer(HFPolicy.load(tiny_model, "cpu"), cfg).train(make_batch(seed=4))
    assert seen == pytest.approx(applied)
    assert metrics["entropy_coef"] == pytest.approx(after) and metrics["entropy_coef_applied"] == pytest.approx(sum(applied) / 4)


def test_a_resumed_update_goes_on_with_the_saved_coefficient(tiny_model, tmp_path):
    cfg = UpdateConfig(lr=1e-3, mini_batch_size=4, entropy_coef=0.01, entropy_target=100.0)
    continuous = Trainer(HFPolicy.load(tiny_model, "cpu"), cfg)
    continuous.train(make_batch(0))
    unbroken = continuous.train(make_batch(1))

    first = Trainer(HFPolicy.load(tiny_model, "cpu"), cfg)
    first.train(make_batch(0))
    save_trainer_state(tmp_path / "state", first.state_dict())
    saved = trainer_state.load(tmp_path / "state")
    assert saved["entropy_control"] == {"coef": pytest.approx(0.02), "last_entropy": first.entropy_control.last_entropy}
    resumed = Trainer(HFPolicy(first.policy.model, first.policy.tokenizer, first.policy.device), cfg)
    resumed.load_state_dict(saved)
    assert resumed.train(make_batch(1)) | {"seconds": 0, "tokens_per_s": 0} == unbroken | {"seconds": 0, "tokens_per_s": 0}
    assert all(torch.equal(a, b) for a, b in zip(continuous.policy.model.state_dict().values(), resumed.policy.model.state_dict().values()))
    save_trainer_state(tmp_path / "plain", Trainer(HFPolicy.load(tiny_model, "cpu"), UpdateConfig()).state_dict())
    assert "entropy_control" not in (tmp_path / "plain" / "state.json").read_text()  # off: the state is as before


def test_bounds_the_wrong_way_round_are_refused():
    from rlctl.trainer import check_update_config

    with pytest.raises(InputError, match=r"update.entropy_coef_min \(0.5\) is above update.entropy_coef_max \(0.1\)"):
        check_update_config(UpdateConfig(entropy_target=0.3, entropy_coef_min=0.5, entropy_coef_max=0.1))
