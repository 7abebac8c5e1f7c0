"""What "auto" decides: bf16 only where the hardware runs it natively, decided once per run
and kept by a resumed run; and which old log-probs that leaves the update to use."""

from __future__ import annotations

import pytest

from rlctl.config import Config, load_config
from rlctl.dtypes import (
    autocast_bf16,
    compute_dtype,
    cpu_flags,
    models_device,
    native_bf16,
    resolve_dtypes,
)

ZEN5 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
XEON = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


def test_cpu_flags_are_read_from_x86_and_arm_cpuinfo():
    assert "avx512_bf16" in cpu_flags(ZEN5) and "avx512_bf16" not in cpu_flags(XEON)
    assert "bf16" in cpu_flags(GRAVITON3)


@pytest.mark.parametrize("env,expected", [("1", "bf16"), ("0", "fp32")])
def test_the_environment_overrides_detection(monkeypatch, env, expected):
    monkeypatch.setenv("RLCTL_NATIVE_BF16", env)
    assert native_bf16("cpu") is (env == "1")
    assert compute_dtype("auto", "cpu") == expected
    assert autocast_bf16("auto", "cpu") is (env == "1")


def test_explicit_settings_are_kept_whatever_the_hardware(monkeypatch):
    monkeypatch.setenv("RLCTL_NATIVE_BF16", "1")
    assert compute_dtype("fp32", "cpu") == "fp32" and autocast_bf16("false", "cpu") is False
    monkeypatch.setenv("RLCTL_NATIVE_BF16", "0")
    assert compute_dtype("bf16", "cpu") == "bf16" and autocast_bf16("true", "cpu") is True


def test_ray_workers_compute_where_their_resources_are():
    cfg = load_config(data={"workers": {"backend": "ray", "gpus_per_worker": 1.0}})
    assert models_device("cpu", cfg.workers) == "cuda"
    assert models_device("cpu", load_config(data={"workers": {"backend": "ray"}}).workers) == "cpu"
    assert models_device("cpu") == "cpu"


def test_a_run_decides_auto_once_and_a_resumed_run_keeps_the_decision(monkeypatch):
    monkeypatch.setenv("RLCTL_NATIVE_BF16", "1")
    started = resolve_dtypes(Config())
    assert (started.rollout.dtype, started.score.dtype, started.update.bf16) == ("bf16", "bf16", "true")
    monkeypatch.setenv("RLCTL_NATIVE_BF16", "0")  # resumed on a machine without native bf16
    assert resolve_dtypes(Config(), recorded=started) == started
    assert resolve_dtypes(Config()).rollout.dtype == "fp32"  # a new run decides for this machine
    pinned = load_config(data={"rollout": {"dtype": "fp32"}})
    assert resolve_dtypes(pinned, recorded=started).rollout.dtype == "fp32"  # what the user wrote wins


def test_update_bf16_reads_booleans_as_before():
    assert load_config(data={"update": {"bf16": True}}).update.bf16 == "true"
    assert load_config(overrides=["update.bf16=false"]).update.bf16 == "false"
    assert load_config().update.bf16 == "auto"


@pytest.mark.parametrize("sets,source", [
    ({}, "rollout"),  # fp32 engine and trainer: the engine's log-probs are the trainer's
    ({"update": {"bf16": "true"}}, "update"),  # bf16 training, one step: its own forward
    ({"rollout": {"dtype": "bf16"}, "update": {"bf16": "false"}}, "update"),
    ({"rollout": {"dtype": "bf16"}, "update": {"epochs": 2}}, "recompute"),  # a second epoch needs the old policy's
    ({"rollout": {"dtype": "bf16", "n": 2}, "data": {"batch_size": 4}, "update": {"mini_batch_size": 4}}, "recompute"),
    ({"rollout": {"dtype": "bf16", "n": 2}, "data": {"batch_size": 4}, "update": {"mini_batch_size": 8}}, "update"),
    ({"rollout": {"dtype": "bf16"}, "model": {"ref": "m"}, "advantage": {"kl_coef": 0.1}}, "recompute"),  # KL in the reward
    ({"rollout": {"backend": "vllm"}}, "update"),
    ({"score": {"old_logprobs": "recompute"}}, "recompute"),
    ({"update": {"rollout_rs": "token_k1", "rollout_rs_threshold": "2"}}, "recompute"),  # its rules compare the trainer's with the engine's
    ({"rollout": {"dtype": "bf16"}, "update": {"rollout_is": "token", "rollout_is_batch_normalize": True}}, "recompute"),  # the whole batch's weights first
    ({"rollout": {"dtype": "bf16"}, "update": {"rollout_is": "token"}}, "update"),
    ({"score": {"sum_pi_squared": True}}, "recompute"),  # Σπ² comes from that forward (the optimal token baseline's)
])
def test_auto_old_logprobs_take_the_cheapest_exact_source(sets, source):
    from rlctl.pipeline import old_logprobs_source

    base = {"rollout": {"dtype": "fp32"}, "score": {"dtype": "fp32"}, "update": {"bf16": "false"}}
    merged = {name: {**base.get(name, {}), **sets.get(name, {})} for name in {*base, *sets}}
    assert old_logprobs_source(load_config(data=merged)) == source
