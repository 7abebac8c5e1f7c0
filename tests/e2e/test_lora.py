"""update.lora: only the adapters train, the reference is the base with its adapters off (one
copy in memory), checkpoints hold the adapter, and `reshard --merge-lora` writes the merged
model that transformers loads, equal to base + B·A·alpha/r."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from rlctl import shards
from rlctl.backends.hf import HFPolicy
from rlctl.config import LoraConfig, UpdateConfig, load_config
from rlctl.lora import AdapterDisabledReference, merged_state_dict, prepare_for_training
from rlctl.trainer import TrainBatch, Trainer
from tests.conftest import one_line_error
from tests.e2e.test_examples import learning_margin, run_example

LORA = "update.lora={r=4, alpha=8, target_modules=[\"q_proj\", \"v_proj\", \"down_proj\", \"lm_head\"]}"


@pytest.fixture(scope="module")
def batch(tmp_path_factory, tiny_model):
    from typer.testing import CliRunner

    from rlctl.cli import app

    tmp = tmp_path_factory.mktemp("lora")
    prompts = tmp / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"count to {i}"}) + "\n" for i in range(4)))
    runner = CliRunner()
    for args in (
        ["rollout", "--prompts", prompts, "--model", tiny_model, "--out", tmp / "r", "--n", "2", "--max-new-tokens", "6", "--seed", "1"],
        ["score", "--rollouts", tmp / "r", "--out", tmp / "s", "--reward", "builtin:length", "--policy", tiny_model],
        ["advantage", "--scores", tmp / "s", "--out", tmp / "b", "--estimator", "grpo"],
    ):
        result = runner.invoke(app, [str(a) for a in args])
        assert result.exit_code == 0, result.output
    return tmp / "b"


def lora_policy(tiny_model, cfg=LoraConfig(r=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj", "lm_head"))):
    policy = HFPolicy.load(tiny_model, "cpu")
    prepare_for_training(policy, cfg, tiny_model)
    return policy


def test_only_the_adapters_train(tiny_model, batch):
    policy = lora_policy(tiny_model)
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    trainer = Trainer(policy, UpdateConfig(lr=1e-2, lora=LoraConfig(r=4)))
    adapters = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    assert sum(len(g["params"]) for g in trainer.optimizer.param_groups) == len(adapters)
    trainer.train(TrainBatch.from_table(shards.read(str(batch), "batch").table))
    after = policy.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".lora_" in k for k in changed)  # no base weight moved
    assert any(".lora_B." in k for k in changed)


def trained_looking(policy) -> None:
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if ".lora_B." in name:
                p.normal_(std=0.05)  # B starts at 0: give the adapter something to merge


def test_merged_weights_are_base_plus_scaled_ba_as_peft_merges_them(tiny_model):
    policy = lora_policy(tiny_model, LoraConfig(r=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj")))
    trained_looking(policy)
    ours = merged_state_dict(policy.model)
    theirs = copy.deepcopy(policy.model).merge_and_unload().state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.allclose(ours[name], theirs[name], atol=1e-6), name
    layer = policy.model.get_base_model().model.layers[0].self_attn.q_proj
    expected = layer.base_layer.weight + layer.lora_B["default"].weight @ layer.lora_A["default"].weight * (8.0 / 4)
    assert torch.equal(ours["model.layers.0.self_attn.q_proj.weight"], expected)


def test_an_adapted_tied_lm_head_merges_into_the_output_side_only(tiny_model):
    base = HFPolicy.load(tiny_model, "cpu").model.state_dict()
    policy = lora_policy(tiny_model)  # lm_head among the targets; the tiny model ties it to the embedding
    trained_looking(policy)
    merged = merged_state_dict(policy.model)
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])  # the input side is the base's
    head = policy.model.get_base_model().lm_head
    assert torch.equal(merged["lm_head.weight"], head.base_layer.weight + head.lora_B["default"].weight @ head.lora_A["default"].weight * 2.0)


def test_the_reference_is_the_base_with_adapters_off_and_loaded_once(tmp_path, tiny_model):
    from rlctl.workers.local import LocalWorkers

    cfg = load_config(None, [f"model.ref={tiny_model}", LORA])
    workers = LocalWorkers(cfg, policy_source=tiny_model, critic_source=None)
    assert isinstance(workers.ref, AdapterDisabledReference)
    assert workers.loads == [f"policy:{tiny_model}"]
    trained_looking(workers.policy)
    prompt, response = [[3, 4, 5]], [[6, 7, 8, 9]]
    base = HFPolicy.load(tiny_model, "cpu")
    ref = workers.ref.logprobs(prompt, response, temperature=1.0)
    assert torch.allclose(torch.tensor(ref), torch.tensor(base.logprobs(prompt, response, temperature=1.0)), atol=1e-6)
    assert not torch.allclose(torch.tensor(workers.policy.logprobs(prompt, response, temperature=1.0)), torch.tensor(ref), atol=1e-3)


def test_update_writes_an_adapter_checkpoint_that_merges_into_a_loadable_model(cli, tmp_path, tiny_model, batch):
    from transformers import AutoModelForCausalLM

    result = cli("update", "--batch", batch, "--model", tiny_model, "--out", tmp_path / "ckpt", "--lr", "1e-2", "--set", LORA)
    assert result.exit_code == 0, result.stderr
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "adapter_config.json").exists() and not (ckpt / "model.safetensors").exists()
    saved = load_file(str(ckpt / "adapter_model.safetensors"))
    base = [k for k in saved if ".lora_" not in k]  # peft keeps a tied target's base weight beside the adapter
    assert base == ["base_model.model.lm_head.base_layer.weight"]
    assert torch.equal(saved[base[0]], load_file(f"{tiny_model}/model.safetensors")["model.embed_tokens.weight"])
    again = cli("update", "--batch", batch, "--model", ckpt, "--out", tmp_path / "ckpt2", "--lr", "1e-2", "--set", LORA)  # trains on the saved adapter
    assert again.exit_code == 0, again.stderr
    refused = cli("reshard", "--checkpoint", tmp_path / "ckpt2", "--out", tmp_path / "merged")
    assert refused.exit_code == 2 and "pass --merge-lora" in one_line_error(refused)
    merged = cli("reshard", "--checkpoint", tmp_path / "ckpt2", "--out", tmp_path / "merged", "--merge-lora", "--check")
    assert merged.exit_code == 0, merged.stderr
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False  # lm_head was adapted: no longer the input embedding
    trained = HFPolicy.load(str(tmp_path / "ckpt2"), "cpu").model
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        assert torch.allclose(trained(input_ids=ids).logits, loaded(input_ids=ids).logits, atol=1e-4)


def test_lora_mistakes_are_exit_2(cli, tmp_path, tiny_model, batch):
    wrong_module = cli("update", "--batch", batch, "--model", tiny_model, "--out", tmp_path / "c", "--set", 'update.lora={r=4, target_modules=["qkv"]}')
    assert wrong_module.exit_code == 2 and "has no module named 'qkv'" in one_line_error(wrong_module)
    plain = cli("reshard", "--checkpoint", tiny_model, "--out", tmp_path / "m", "--merge-lora")
    assert plain.exit_code == 2 and "holds no LoRA adapter" in one_line_error(plain)


@pytest.mark.slow
def test_the_grpo_lora_example_learns_by_the_stated_margin(tmp_path):
    rows = run_example("grpo_lora.toml", tmp_path)
    assert len(rows) == 30
    assert learning_margin(rows) >= 0.5  # the margin stated in examples/grpo_lora.toml


def test_the_adapters_own_dropout_stays_when_the_update_turns_the_models_off(tmp_path, tiny_model):
    from tests.unit.test_trainer import attention_dropouts, model_with_dropout

    policy = lora_policy(model_with_dropout(tmp_path, tiny_model), LoraConfig(r=4, alpha=8.0, dropout=0.1, target_modules=("q_proj", "v_proj")))
    Trainer(policy, UpdateConfig(lora=LoraConfig(r=4, dropout=0.1, target_modules=("q_proj", "v_proj"))))
    assert attention_dropouts(policy.model) == {0.0}
    adapters = [m.p for name, m in policy.model.named_modules() if isinstance(m, torch.nn.Dropout) and "lora_dropout" in name]
    assert adapters and set(adapters) == {0.1}
