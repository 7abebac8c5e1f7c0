"""update.compile: the compiled decoder layers train as the eager ones do (to float rounding),
only under autograd and only where the layers are plain modules; on the CPU it needs a C++
compiler, and says so before any work."""

import pytest
import torch

from rlctl.backends import compiled_layers
from rlctl.backends.hf import HFPolicy
from rlctl.config import Config, load_config
from rlctl.errors import ConfigError, InputError
from tests.conftest import model_folder
from tests.unit.test_unpadded import assert_same_gradient, forward_and_gradients


@pytest.mark.parametrize("kind", ["qwen2", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_compiled_layers_give_the_eager_layers_log_probs_entropies_and_gradients(monkeypatch, tmp_path_factory, tiny_model, kind):
    folder = tiny_model if kind == "qwen2" else model_folder(tmp_path_factory, tiny_model, kind)  # qwen3: q/k norms
    policy = HFPolicy.load(folder, "cpu")
    eager = {shared: forward_and_gradients(monkeypatch, policy, "rlctl", shared=shared) for shared in (False, True)}
    assert compiled_layers.enable(policy.model)
    for shared in (False, True):  # one forward per row; each prompt once, its keys and values copied to its rows
        logp, entropy, mask, grads = forward_and_gradients(monkeypatch, policy, "rlctl", shared=shared)
        want_logp, want_entropy, _, want_grads = eager[shared]
        assert torch.allclose(logp[mask], want_logp[mask], atol=1e-5) and torch.allclose(entropy[mask], want_entropy[mask], atol=1e-5)
        assert grads.keys() == want_grads.keys()
        for name, grad in grads.items():
            assert_same_gradient(grad, want_grads[name], name)


def test_only_forwards_under_autograd_run_compiled(tiny_model):
    policy = HFPolicy.load(tiny_model, "cpu")
    assert compiled_layers.compiled_forward(policy.model) is None  # not enabled
    compiled_layers.enable(policy.model)
    assert compiled_layers.compiled_forward(policy.model) is not None
    with torch.no_grad():  # the score stage's forwards: eager
        assert compiled_layers.compiled_forward(policy.model) is None


def test_layers_with_lora_adapters_are_not_compiled(tiny_model):
    from rlctl.config import LoraConfig
    from rlctl.lora import add_adapter, transformers_model

    policy = HFPolicy.load(tiny_model, "cpu")
    model = add_adapter(policy.model, LoraConfig(r=4), tiny_model)
    assert not compiled_layers.enable(transformers_model(model))
    assert compiled_layers.compiled_forward(transformers_model(model)) is None


def test_compile_on_the_cpu_needs_a_cxx_compiler(monkeypatch):
    monkeypatch.setattr(compiled_layers, "cxx_compiler", lambda: None)
    with pytest.raises(InputError, match="C\\+\\+ compiler"):
        compiled_layers.check_compile(True, "cpu")
    compiled_layers.check_compile(False, "cpu")
    compiled_layers.check_compile(True, "cuda")  # inductor's GPU kernels need no C++ compiler


def test_the_compiler_is_the_one_inductor_would_run_where_it_is_found(monkeypatch, tmp_path):
    from torch._inductor import config

    compiler = tmp_path / "my-g++"
    compiler.write_text("#!/bin/sh\n")
    compiler.chmod(0o755)
    monkeypatch.setattr(config.cpp, "cxx", (None, str(compiler)))  # as $CXX=<that file> sets it
    assert compiled_layers.cxx_compiler() == str(compiler)
    monkeypatch.setattr(config.cpp, "cxx", (None, "g++"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++ there
    assert compiled_layers.cxx_compiler() is None
    (tmp_path / "g++").write_text("#!/bin/sh\n")
    (tmp_path / "g++").chmod(0o755)
    assert compiled_layers.cxx_compiler() == str(tmp_path / "g++")


def test_a_pipeline_asking_to_compile_without_a_compiler_fails_before_any_work(monkeypatch):
    from rlctl.pipeline import validate

    monkeypatch.setattr(compiled_layers, "cxx_compiler", lambda: None)
    cfg = load_config(data={"model": {"device": "cpu", "init_preset": "tiny"}, "data": {"prompts": "p.jsonl"}, "update": {"compile": True}})
    with pytest.raises(InputError, match="update.compile"):
        validate(cfg)
    validate(load_config(data={"model": {"device": "cpu", "init_preset": "tiny"}, "data": {"prompts": "p.jsonl"}}))


def test_compile_is_off_by_default_and_may_change_on_resume():
    from rlctl.pipeline import training_config

    assert Config().update.compile is False
    assert "update.compile" not in training_config(load_config(data={"update": {"compile": True}}))  # the same training to float rounding
    with pytest.raises(ConfigError, match="compile"):
        load_config(overrides=["update.compile=sometimes"])


def test_a_replay_says_when_it_compiles_otherwise_than_the_update_ran():
    from dataclasses import replace

    from rlctl.lineage import make_manifest
    from rlctl.replay import _compile_note

    compiled_run = make_manifest("update", {"update": {"lr": 1e-3, "compile": True}}, [])
    eager = Config()
    assert "recorded with compiled decoder layers, replayed with eager ones" in _compile_note(compiled_run, eager)
    assert _compile_note(compiled_run, replace(eager, update=replace(eager.update, compile=True))) == ""
    assert _compile_note(make_manifest("update", {"update": {"lr": 1e-3}}, []), eager) == ""  # recorded before the key: eager, as now
    compiling = replace(eager, update=replace(eager.update, compile=True))
    assert "recorded with eager decoder layers, replayed with compiled ones" in _compile_note(make_manifest("update", {"update": {"lr": 1e-3}}, []), compiling)
    assert _compile_note(make_manifest("score", {"score": {}}, []), compiling) == ""  # no layers trained there
