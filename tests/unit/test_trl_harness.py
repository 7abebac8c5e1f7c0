"""bench/trl_bench.py compares rlctl with TRL on the same work: TRL's side (bench/trl_runner.py)
trains without activation checkpointing unless asked (GRPOConfig turns it on by default, one more
forward per update that rlctl does not run), and records what its model did. TRL itself is not
installed here: a stand-in records what the runner gives GRPOConfig."""

import json
import sys
import types
from pathlib import Path

import pytest
import transformers

BENCH = Path(__file__).resolve().parents[2] / "bench"


def stand_in_trl(configs: list[dict]) -> types.ModuleType:
    """A `trl` module whose GRPOConfig keeps its keyword arguments and whose trainer runs two
    steps through the callbacks, its model checkpointing as the config says."""

    class GRPOConfig(types.SimpleNamespace):
        def __init__(self, **kwargs):
            configs.append(kwargs)
            super().__init__(**kwargs)

    class GRPOTrainer:
        def __init__(self, model, reward_funcs, args, train_dataset):
            self.args, self.callbacks = args, []
            self.model = types.SimpleNamespace(is_gradient_checkpointing=args.gradient_checkpointing)
            self.ref_model = object()
            self._get_per_token_logps_and_entropies = lambda model, *a, **kw: None

        def add_callback(self, callback):
            self.callbacks.append(callback)

        def train(self):
            for _ in range(2):
                for callback in self.callbacks:
                    callback.on_step_begin()
                self._get_per_token_logps_and_entropies(self.ref_model)
                for callback in self.callbacks:
                    callback.on_step_end()

    return types.SimpleNamespace(GRPOConfig=GRPOConfig, GRPOTrainer=GRPOTrainer, __version__="stand-in")


@pytest.mark.parametrize("asked", [None, False, True])
def test_trl_recomputes_activations_only_when_asked_and_records_what_it_did(tmp_path, monkeypatch, asked):
    from bench import trl_runner
    from bench.trl_bench import write_prompts

    configs: list[dict] = []
    monkeypatch.setitem(sys.modules, "trl", stand_in_trl(configs))
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(Dataset=types.SimpleNamespace(from_list=list)))
    monkeypatch.setattr(transformers.GenerationMixin, "generate", transformers.GenerationMixin.generate)  # the runner times it
    spec = {
        "model": "unused", "prompts": str(write_prompts(tmp_path / "p.jsonl", count=4)), "reward_file": str(BENCH / "addition_reward.py"),
        "reward_function": "addition_reward", "prompts_per_step": 2, "samples": 2, "max_new_tokens": 4, "lr": 1e-5, "kl_coef": 0.04,
        "steps": 2, "dtype": "fp32", "seed": 0, "device": "cpu",
    }
    if asked is not None:
        spec["gradient_checkpointing"] = asked
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    trl_runner.main(str(tmp_path / "spec.json"), str(tmp_path / "out.json"))
    record = json.loads((tmp_path / "out.json").read_text())
    assert configs[0]["gradient_checkpointing"] is bool(asked)
    assert record["gradient_checkpointing"] is bool(asked)
    assert len(record["steps"]) == 2 and all("reference" in step for step in record["steps"])
