"""Reward-model training: a pair's sides are read as `rm:` scoring reads a sample, the loss is
Bradley-Terry's with passes that sum to one batch's gradient, and the trained model ranks
held-out pairs and scores through `rm:` exactly as it trained."""

import json

import pyarrow as pa
import pytest
import torch

from rlctl.config import RewardModelConfig, load_config
from rlctl.errors import InputError
from rlctl.reward_model import (
    Pairs,
    RewardModelTrainer,
    encode_pairs,
    load_scorer,
    pair_losses,
    rewards_of,
    run,
    scored_ids,
    split_pairs,
)
from rlctl.rewards import RewardSamples, compute_rewards, load_reward
from rlctl.shards import read

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def scorer(tiny_model):
    return load_scorer(tiny_model, CPU, new_head_seed=0)


def table_of(tmp_path, rows) -> pa.Table:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return read(str(path)).table


def encode(tokenizer, table, cfg=RewardModelConfig(), context_length=None) -> Pairs:
    return encode_pairs(table, tokenizer, cfg, context_length=context_length, source="test")


def test_a_plain_pair_is_the_prompts_text_then_each_response(scorer, tmp_path):
    _, tok = scorer
    pairs = encode(tok, table_of(tmp_path, [{"prompt": "2+2=", "chosen": "4", "rejected": "five", "margin": 0.5}]))
    end = [tok.eos_token_id]  # the end token closes each side, as TRL's RewardTrainer reads a plain pair
    assert pairs.chosen == [tok("2+2=4")["input_ids"] + end] and pairs.rejected == [tok("2+2=five")["input_ids"] + end]
    assert pairs.ids == ["0"] and pairs.margins == [0.5] and pairs.lengths == [2 * max(len(pairs.chosen[0]), len(pairs.rejected[0]))]


def test_a_chat_pair_is_the_whole_conversation_through_the_chat_template_however_it_is_given(scorer, tmp_path):
    _, tok = scorer
    question = [{"role": "user", "content": "2+2"}]
    answer, wrong = [{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]
    given = [
        {"messages": question, "chosen": "4", "rejected": "5"},
        {"prompt": question, "chosen": answer, "rejected": wrong},  # TRL's conversational prompt column
        {"chosen": question + answer, "rejected": question + wrong},  # TRL's implicit prompt
    ]
    forms = [encode(tok, table_of(tmp_path, [row])) for row in given]  # one file holds one form: a column has one type
    expected = tok(tok.apply_chat_template(question + answer, tokenize=False), add_special_tokens=False)["input_ids"]
    assert [f.chosen for f in forms] == [[expected]] * 3
    assert forms[0].rejected == forms[1].rejected == forms[2].rejected != [expected]


@pytest.mark.parametrize(
    ("rows", "fragment"),
    [
        ([{"prompt": "a", "chosen": "b"}], "need 'chosen' and 'rejected' columns"),
        ([{"prompt": "a", "chosen": "b", "rejected": None}], "row 0 has no rejected response"),
        ([{"messages": [{"role": "user", "content": "a"}], "chosen": "b", "rejected": [{"role": "assistant", "content": "c"}]}], "both be text or both be messages"),
        ([{"prompt": "a", "chosen": [{"role": "assistant", "content": "b"}], "rejected": [{"role": "assistant", "content": "c"}]}], "needs a chat prompt"),
        ([{"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "user", "content": "b"}]}], "share no prompt turns"),
    ],
)
def test_a_malformed_pair_is_one_error_naming_its_row(tmp_path, rows, fragment):
    with pytest.raises(InputError, match=fragment):
        split_pairs(table_of(tmp_path, rows), "test")


def test_a_pair_over_max_tokens_is_an_error_or_left_out_and_counted(scorer, tmp_path):
    _, tok = scorer
    table = table_of(tmp_path, [{"prompt": "q", "chosen": "short", "rejected": "long " * 30}, {"prompt": "q", "chosen": "a", "rejected": "b"}])
    with pytest.raises(InputError, match="pair '0' has a side of .* tokens, over 12 \\(reward_model.max_tokens\\)"):
        encode(tok, table, RewardModelConfig(max_tokens=12))
    kept = encode(tok, table, RewardModelConfig(max_tokens=12, too_long="drop"))
    assert kept.ids == ["1"] and kept.dropped == 1


def test_the_loss_is_bradley_terrys_with_a_margin_and_an_optional_centring_term():
    chosen, rejected, margins = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.5]), torch.tensor([0.0, 0.25])
    plain = pair_losses(chosen, rejected, margins, 0.0)
    assert plain.tolist() == pytest.approx([-torch.log(torch.sigmoid(torch.tensor(1.0))).item(), -torch.log(torch.sigmoid(torch.tensor(-0.75))).item()])
    centred = pair_losses(chosen, rejected, margins, 0.1)
    assert (centred - plain).tolist() == pytest.approx([0.1 * 9.0, 0.1 * 0.25])


def test_passes_of_any_size_give_the_gradient_of_the_batchs_mean_loss(tiny_model, tmp_path):
    rows = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": "no" * (a % 3 + 1), "margin": a / 10} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (9, 0)]]
    gradients = []
    for micro in (1, 2, 5):
        model, tok = load_scorer(tiny_model, CPU, new_head_seed=3)
        pairs = encode(tok, table_of(tmp_path, rows))
        cfg = RewardModelConfig(batch_size=5, micro_batch_size=micro, bf16="false", lr=1e-9, max_grad_norm=0.0, center_coef=0.05)
        RewardModelTrainer(model, tok.pad_token_id, cfg, device=CPU, total_steps=1).train_epoch(pairs, 1)
        gradients.append(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]))
    assert torch.allclose(gradients[0], gradients[1], atol=1e-6) and torch.allclose(gradients[0], gradients[2], atol=1e-6)
    model.zero_grad()  # one pass over every sequence, unpadded: the weights moved by lr 1e-9, within float tolerance
    chosen = torch.cat([rewards_of(model, [s], tok.pad_token_id, CPU) for s in pairs.chosen])
    rejected = torch.cat([rewards_of(model, [s], tok.pad_token_id, CPU) for s in pairs.rejected])
    pair_losses(chosen, rejected, torch.tensor(pairs.margins), 0.05).mean().backward()
    direct = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    assert torch.allclose(gradients[0], direct, atol=1e-5)


def digit_pairs(count: int, seed: int) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(count):
        digits = "".join(str(d) for d in torch.randint(0, 10, (int(torch.randint(2, 7, (1,), generator=generator)),), generator=generator).tolist())
        letters = "".join(chr(97 + c) for c in torch.randint(0, 26, (int(torch.randint(2, 7, (1,), generator=generator)),), generator=generator).tolist())
        rows.append({"id": f"p{i}", "prompt": f"Type a number: {i}", "chosen": digits, "rejected": letters})
    return rows


def test_a_trained_reward_model_ranks_held_out_pairs_and_rm_scores_as_it_trained(tiny_model, tmp_path):
    train, held_out = digit_pairs(96, seed=0), digit_pairs(32, seed=1)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held_out))
    cfg = load_config(None, ["reward_model.epochs=2", "reward_model.lr=1e-3", "reward_model.batch_size=16"])
    reported = []
    manifest = run(data=str(tmp_path / "train.jsonl"), val_data=str(tmp_path / "val.jsonl"), model=tiny_model, out=str(tmp_path / "rm"), cfg=cfg, device="cpu", report=reported.append)
    assert [r["epoch"] for r in reported] == [0, 1, 2] and "loss" not in reported[0]
    assert reported[-1]["val_accuracy"] >= 0.9 and reported[-1]["val_loss"] < reported[0]["val_loss"] / 2
    assert manifest.stage == "reward-model" and manifest.state["pairs"] == 96 and manifest.state["optimizer_steps"] == 12
    assert manifest.metrics["val_accuracy"] == reported[-1]["val_accuracy"]

    reward = load_reward(f"rm:{tmp_path / 'rm'}", batch_size=5)
    samples = RewardSamples([r["prompt"] for r in held_out] * 2, [r["chosen"] for r in held_out] + [r["rejected"] for r in held_out], [None] * 64, [None] * 64)
    scores = compute_rewards(reward, samples, timeout=60)
    right = sum(c > r for c, r in zip(scores[:32], scores[32:])) / 32
    assert right == reported[-1]["val_accuracy"]  # the scorer reads the pairs as the trainer read them
    model, tok = load_scorer(str(tmp_path / "rm"), CPU)
    alone = rewards_of(model, [tok(held_out[0]["prompt"] + held_out[0]["chosen"])["input_ids"] + [tok.eos_token_id]], tok.pad_token_id, CPU)
    assert scores[0] == pytest.approx(float(alone[0].detach()), abs=1e-5)
    again = run(data=str(tmp_path / "train.jsonl"), val_data=str(tmp_path / "val.jsonl"), model=tiny_model, out=str(tmp_path / "rm"), cfg=cfg, device="cpu")
    assert again.state.get("skipped")


def test_a_lora_reward_model_trains_adapters_and_the_head_and_is_written_merged(tiny_model, tmp_path):
    from safetensors.torch import load_file

    from rlctl.reward_model import LocalRewardModel

    train, held_out = digit_pairs(64, seed=0), digit_pairs(32, seed=1)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held_out))
    cfg = load_config(None, ["reward_model.epochs=2", "reward_model.lr=3e-3", "reward_model.batch_size=16", "reward_model.lora.r=8", "reward_model.lora.alpha=16"])
    held = LocalRewardModel(tiny_model, cfg.reward_model, "cpu")
    trained = {name for name, p in held.scorer.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in name or ".score." in name for name in trained) and any(".score." in name for name in trained)
    reported = []
    manifest = run(data=str(tmp_path / "train.jsonl"), val_data=str(tmp_path / "val.jsonl"), model=tiny_model, out=str(tmp_path / "rm"), cfg=cfg, device="cpu", report=reported.append)
    assert reported[-1]["val_loss"] < reported[0]["val_loss"] and reported[-1]["val_accuracy"] > reported[0]["val_accuracy"]
    assert manifest.config["reward_model"]["lora"]["r"] == 8
    assert not (tmp_path / "rm" / "adapter_config.json").exists()  # merged: rm: loads it as any reward model
    weights = load_file(str(tmp_path / "rm" / "model.safetensors"))
    assert not any("lora_" in name or "modules_to_save" in name for name in weights)
    base = load_scorer(tiny_model, CPU, new_head_seed=0)[0].state_dict()
    assert any(not torch.equal(weights[k], base[k]) for k in weights if "layers.0.self_attn.q_proj" in k)  # the adapters merged in
    reward = load_reward(f"rm:{tmp_path / 'rm'}")
    samples = RewardSamples([r["prompt"] for r in held_out] * 2, [r["chosen"] for r in held_out] + [r["rejected"] for r in held_out], [None] * 64, [None] * 64)
    scores = compute_rewards(reward, samples, timeout=60)
    assert sum(c > r for c, r in zip(scores[:32], scores[32:])) / 32 == reported[-1]["val_accuracy"]  # the merged model ranks as the adapted one did


def test_rm_scores_a_chat_sample_through_the_chat_template(tiny_model, tmp_path, scorer):
    model, tok = scorer
    model.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    chat = [{"role": "user", "content": "2+2"}]
    reward = load_reward(f"rm:{tmp_path / 'rm'}")
    got = compute_rewards(reward, RewardSamples(["2+2"], ["4"], [None], [None], [{}], [chat]), timeout=30)
    expected = rewards_of(model, [scored_ids(tok, None, chat, "4")], tok.pad_token_id, CPU)
    assert got[0] == pytest.approx(float(expected[0].detach()), abs=1e-5)
    assert scored_ids(tok, None, chat, "4") != scored_ids(tok, "2+2", None, "4")


def test_reward_model_bf16_takes_a_boolean_as_update_bf16_does():
    assert load_config(None, ["reward_model.bf16=false"]).reward_model.bf16 == "false"
    assert load_config(None, ["reward_model.bf16=true"]).reward_model.bf16 == "true"


def test_rm_scores_in_length_sorted_batches_and_in_bf16_under_autocast_when_asked(tiny_model, tmp_path, scorer):
    model, tok = scorer
    model.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    responses = ["a much longer response than the others", "7", "twelve", "x y z", "another fairly long one here", "9"]
    samples = RewardSamples(["q: "] * 6, responses, [None] * 6, [None] * 6)
    batched = compute_rewards(load_reward(f"rm:{tmp_path / 'rm'}", batch_size=4), samples, timeout=30)
    alone = [compute_rewards(load_reward(f"rm:{tmp_path / 'rm'}", batch_size=1), samples.subset(i), timeout=30)[0] for i in range(6)]
    assert batched == pytest.approx(alone, abs=1e-5)  # each score in its own row's place, whatever batch it ran in
    bf16 = compute_rewards(load_reward(f"rm:{tmp_path / 'rm'}", batch_size=4, dtype="bf16"), samples, timeout=30)
    assert bf16 != batched and bf16 == pytest.approx(batched, abs=0.05 + 0.02 * max(map(abs, batched)))


def test_the_unpadded_forward_gives_transformers_rewards_and_gradients_pooling_where_it_pools(tiny_model, monkeypatch):
    from rlctl.backends import unpadded
    from rlctl.reward_model import pooled

    model, tok = load_scorer(tiny_model, CPU, new_head_seed=1)
    sequences = [tok("2+2=4")["input_ids"] + [tok.eos_token_id], tok("a longer side, padded in the other path")["input_ids"], [5, 6, 7]]
    results = []
    for choice, pad in (("rlctl", 0), ("transformers", 0), ("rlctl", tok.eos_token_id), ("transformers", tok.eos_token_id)):
        monkeypatch.setenv(unpadded.OVERRIDE_ENV, choice)
        model.config.pad_token_id = pad  # pad = end token (TRL's default where a tokenizer has none): pooled before it
        assert (unpadded.for_model(model) is not None) == (choice == "rlctl")
        model.zero_grad()
        rewards = rewards_of(model, sequences, tok.pad_token_id, CPU)
        (rewards * torch.tensor([1.0, -2.0, 0.5])).sum().backward()
        results.append((rewards.detach(), torch.cat([p.grad.reshape(-1) for p in model.parameters()])))
    for ours, theirs in (results[0:2], results[2:4]):
        assert torch.allclose(ours[0], theirs[0], atol=1e-5) and torch.allclose(ours[1], theirs[1], atol=1e-5)
    assert not torch.allclose(results[0][0][0], results[2][0][0])  # the first sequence ends in the end token: pooled elsewhere
    # transformers pools at the last token that is not padding: with pad = end token, the one before it
    assert pooled([4, 9, 3, 3], pad_token_id=3) == [4, 9] and pooled([4, 9], pad_token_id=3) == [4, 9] and pooled([4, 9, 3], None) == [4, 9, 3]
