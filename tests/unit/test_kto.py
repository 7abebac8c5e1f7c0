"""Kahneman-Tversky optimization: labelled examples (or pairs taken apart) read as `rlctl sft`
reads them, the loss is the paper's with a reference point from mismatched pairs, passes of
any size give one step's gradient, and the policy learns to favour the desirable responses."""

import json
import math

import pyarrow as pa
import pytest
import torch

from rlctl.backends.hf import HFPolicy
from rlctl.config import DataConfig, KtoConfig, load_config
from rlctl.errors import InputError
from rlctl.kto import KtoTrainer, encode_kto_examples, kto_losses, mismatched_partners, run
from rlctl.shards import read
from tests.unit.test_dpo import summed_logps


@pytest.fixture(scope="module")
def policy(tiny_model):
    return HFPolicy.load(tiny_model, "cpu")


def table_of(tmp_path, rows) -> pa.Table:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return read(str(path)).table


def encode(policy, table, cfg=KtoConfig(micro_batch_tokens="0")):
    return encode_kto_examples(table, policy.tokenizer, DataConfig(), cfg, end_ids=policy.stop_ids, context_length=policy.context_length, source="test")


def number_examples(count: int) -> list[dict]:
    """Right answers are desirable, refusals undesirable."""
    return [
        {"id": f"e{i}", "prompt": f"Type a number: {i}", "completion": f"{7 * i + 3}" if i % 2 else ("no idea" if i % 4 else "maybe so"), "label": bool(i % 2)}
        for i in range(count)
    ]


def test_the_loss_is_the_papers_with_the_reference_point():
    logratio, desirable = torch.tensor([1.0, -0.5, 2.0, 0.3]), torch.tensor([True, True, False, False])
    losses, rewards = kto_losses(logratio, desirable, 0.4, beta=0.5, desirable_weight=1.5, undesirable_weight=0.8)
    sigma = torch.sigmoid
    want = torch.tensor([
        1.5 * (1 - sigma(torch.tensor(0.5 * (1.0 - 0.4)))), 1.5 * (1 - sigma(torch.tensor(0.5 * (-0.5 - 0.4)))),
        0.8 * (1 - sigma(torch.tensor(0.5 * (0.4 - 2.0)))), 0.8 * (1 - sigma(torch.tensor(0.5 * (0.4 - 0.3)))),
    ])
    assert torch.allclose(losses, want) and torch.allclose(rewards, 0.5 * logratio)
    at_start, _ = kto_losses(torch.zeros(4), desirable, 0.0, beta=0.1)
    assert torch.allclose(at_start, torch.full((4,), 0.5))  # r = z = 0: 1 - sigma(0)


def test_apo_zero_unpaired_pushes_each_response_against_the_reference_with_no_reference_point():
    logratio, desirable = torch.tensor([1.0, -0.5, 2.0, 0.3]), torch.tensor([True, True, False, False])
    losses, rewards = kto_losses(logratio, desirable, 0.4, beta=0.5, desirable_weight=1.5, undesirable_weight=0.8, loss="apo_zero_unpaired")
    sigma = torch.sigmoid
    want = torch.tensor([1.5 * (1 - sigma(torch.tensor(0.5))), 1.5 * (1 - sigma(torch.tensor(-0.25))), 0.8 * sigma(torch.tensor(1.0)), 0.8 * sigma(torch.tensor(0.15))])
    assert torch.allclose(losses, want) and torch.allclose(rewards, 0.5 * logratio)  # z = 0.4 given, and not used


def test_apo_zero_unpaired_computes_no_mismatched_pairs_and_learns(tiny_model, tmp_path, monkeypatch):
    """No reference point: the mismatched pairs' reference values stay 0 (no forward over them)
    and z is 0, yet the desirable responses rise against the undesirable ones."""
    policy = HFPolicy.load(tiny_model, "cpu")
    trainer = KtoTrainer(policy, KtoConfig(micro_batch_tokens="0", bf16="false", loss="apo_zero_unpaired"), total_steps=1)
    examples = encode(policy, table_of(tmp_path, number_examples(6)))
    seen = []
    forward = policy.forward
    monkeypatch.setattr(policy, "forward", lambda packed, **kw: (seen.append(packed.input_ids.shape[0]), forward(packed, **kw))[1])
    referenced = trainer.with_reference(examples)
    assert sum(seen) == 6 and referenced.ref_mismatched == [0.0] * 6  # one forward row per example, none for mismatched pairs
    assert trainer.reference_point(referenced, list(range(6))) == 0.0 and sum(seen) == 6
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in number_examples(16)))
    cfg = load_config(None, ["kto.epochs=3", "kto.lr=1e-3", "kto.batch_size=4", "kto.bf16=false", "kto.beta=0.5", "kto.loss=apo_zero_unpaired"])
    reported = []
    run(data=str(tmp_path / "train.jsonl"), val_data=str(tmp_path / "train.jsonl"), model=tiny_model, out=str(tmp_path / "apo"), cfg=cfg, device="cpu", report=reported.append)
    assert reported[0]["val_loss"] == pytest.approx(0.5, abs=1e-6) and reported[-1]["val_loss"] < 0.35 and reported[-1]["val_margin"] > 1.0
    assert all(r.get("kl", 0) == 0 for r in reported)


def test_each_prompt_meets_another_examples_response_in_a_fixed_seeded_derangement():
    partner = mismatched_partners(7, seed=3)
    assert sorted(partner) == list(range(7)) and all(p != i for i, p in enumerate(partner))
    assert partner == mismatched_partners(7, seed=3) and partner != mismatched_partners(7, seed=4)


def test_labelled_rows_and_pairs_taken_apart_read_as_sft_reads_a_prompt_and_response(policy, tmp_path):
    labelled = encode(policy, table_of(tmp_path, [{"prompt": "2+2=", "completion": "4", "label": True}, {"prompt": "2+2=", "completion": "five", "label": False}]))
    paired = encode(policy, table_of(tmp_path, [{"id": "q", "prompt": "2+2=", "chosen": "4", "rejected": "five"}]))
    assert labelled.examples.prompt_ids == paired.examples.prompt_ids and labelled.examples.response_ids == paired.examples.response_ids
    assert labelled.desirable == paired.desirable == [True, False] and paired.ids == ["q:chosen", "q:rejected"]
    tok = policy.tokenizer
    assert tok.decode(paired.examples.response_ids[1]) == "five" + tok.eos_token
    assert paired.mismatched.response_ids == [paired.examples.response_ids[1], paired.examples.response_ids[0]]  # two examples: each the other's


@pytest.mark.parametrize(
    ("rows", "fragment"),
    [
        ([{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": "d"}], "KTO examples need a 'label' column"),
        ([{"prompt": "a", "completion": "b", "label": "yes"}, {"prompt": "c", "completion": "d", "label": "no"}], "example '0' has label 'yes': it must be true"),
        ([{"prompt": "a", "completion": "b", "label": True}, {"prompt": "c", "completion": "d", "label": None}], "example '1' has label None: it must be true"),
        ([{"prompt": "a", "completion": "b", "label": True}], "KTO needs at least 2 examples"),
    ],
)
def test_examples_without_a_boolean_label_or_too_few_are_one_error(policy, tmp_path, rows, fragment):
    with pytest.raises(InputError, match=fragment):
        encode(policy, table_of(tmp_path, rows))


def test_the_reference_is_the_starting_weights_so_the_first_loss_is_one_half(policy, tmp_path):
    examples = encode(policy, table_of(tmp_path, number_examples(6)))
    trainer = KtoTrainer(policy, KtoConfig(micro_batch_size=2, micro_batch_tokens="0", bf16="false"), total_steps=1)
    referenced = trainer.with_reference(examples)
    with torch.no_grad():
        want = summed_logps(policy.model, examples.examples.prompt_ids, examples.examples.response_ids)
        mismatched = summed_logps(policy.model, examples.mismatched.prompt_ids, examples.mismatched.response_ids)
    assert referenced.ref == pytest.approx(want.tolist(), abs=1e-4) and referenced.ref_mismatched == pytest.approx(mismatched.tolist(), abs=1e-4)
    assert trainer.reference_point(referenced, list(range(6))) == pytest.approx(0.0, abs=1e-5)
    loss, margin = trainer.evaluate(referenced)
    assert loss == pytest.approx(0.5, abs=1e-6) and margin == pytest.approx(0.0, abs=1e-6)


def test_passes_of_any_size_give_the_gradient_of_the_steps_mean_loss_at_its_reference_point(tiny_model, tmp_path):
    gradients, points = [], []
    for micro, cap in ((1, "0"), (5, "0"), (4, "40")):
        policy = HFPolicy.load(tiny_model, "cpu")
        cfg = KtoConfig(batch_size=5, micro_batch_size=micro, micro_batch_tokens=cap, bf16="false", lr=1e-9, max_grad_norm=0.0, beta=0.3, desirable_weight=1.3)
        trainer = KtoTrainer(policy, cfg, total_steps=1)
        examples = trainer.with_reference(encode(policy, table_of(tmp_path, number_examples(5))))
        # a reference other than the weights, so that z > 0 and the gradient is not the one at r = 0
        examples = examples.with_reference_values(torch.tensor([[v - 0.4 * i for i, v in enumerate(examples.ref)], [v - 0.3 for v in examples.ref_mismatched]]))
        points.append(trainer.reference_point(examples, list(range(5))))
        trainer.train_epoch(examples, 1)  # one optimizer step of lr 1e-9: the gradient is the one to compare
        gradients.append(torch.cat([p.grad.reshape(-1) for p in policy.model.parameters() if p.grad is not None]))
    assert points[0] == pytest.approx(0.3, abs=1e-5) and points[0] == pytest.approx(points[1], abs=1e-6) == pytest.approx(points[2], abs=1e-6)
    assert torch.allclose(gradients[0], gradients[1], atol=1e-6) and torch.allclose(gradients[0], gradients[2], atol=1e-6)
    policy.model.zero_grad()
    logps = summed_logps(policy.model, examples.examples.prompt_ids, examples.examples.response_ids)
    losses, _ = kto_losses(logps - torch.tensor(examples.ref).double(), torch.tensor(examples.desirable), 0.3, beta=0.3, desirable_weight=1.3)
    losses.mean().backward()  # z without a gradient, as the passes compute it
    direct = torch.cat([p.grad.reshape(-1) for p in policy.model.parameters() if p.grad is not None]).float()
    assert torch.allclose(gradients[0], direct, atol=2e-5 * float(direct.abs().max()))


def test_kto_learns_to_favour_the_desirable_responses_and_writes_a_checkpoint(tiny_model, tmp_path):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in number_examples(16)))
    cfg = load_config(None, ["kto.epochs=3", "kto.lr=1e-3", "kto.batch_size=4", "kto.bf16=false", "kto.beta=0.5"])
    reported = []
    manifest = run(data=str(tmp_path / "train.jsonl"), val_data=str(tmp_path / "train.jsonl"), model=tiny_model, out=str(tmp_path / "kto"), cfg=cfg, device="cpu", report=reported.append)
    assert [r["epoch"] for r in reported] == [0, 1, 2, 3] and reported[0]["val_loss"] == pytest.approx(0.5, abs=1e-6)
    assert reported[-1]["val_loss"] < 0.4 and reported[-1]["val_margin"] > 1.0 and reported[-1]["kl"] >= 0
    assert manifest.stage == "kto" and manifest.state["optimizer_steps"] == 12 and manifest.state["examples"] == 16 and manifest.state["desirable"] == 8
    trained, start = HFPolicy.load(str(tmp_path / "kto"), "cpu"), HFPolicy.load(tiny_model, "cpu")
    examples = encode(start, table_of(tmp_path, number_examples(16)))
    with torch.no_grad():
        moved = summed_logps(trained.model, examples.examples.prompt_ids, examples.examples.response_ids) - summed_logps(start.model, examples.examples.prompt_ids, examples.examples.response_ids)
    good = torch.tensor(examples.desirable)
    assert float(moved[good].mean()) > 0 > float(moved[~good].mean())  # desirable responses up, undesirable down, against the start
    assert run(data=str(tmp_path / "train.jsonl"), val_data=str(tmp_path / "train.jsonl"), model=tiny_model, out=str(tmp_path / "kto"), cfg=cfg, device="cpu").state.get("skipped")
    assert not math.isnan(manifest.metrics["margin"])


# --- a reference that moves towards the policy (kto.ref_sync_every; TR-KTO) ------------------


@pytest.mark.parametrize("lora", [0, 4])
def test_a_reference_reset_to_the_policy_after_every_step_makes_every_steps_loss_one_half(tiny_model, tmp_path, lora):
    """α = 1 after every step: each step finds the policy equal to its reference (r = z = 0, loss
    1/2), yet the gradient there is not 0, so the policy moves towards the desirable responses;
    the held-out figures stay against the starting weights, as `--eval` measures them."""
    from rlctl.kto import evaluate

    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in number_examples(8)))
    common = ["kto.epochs=2", "kto.lr=1e-3", "kto.batch_size=2", "kto.bf16=false", "kto.beta=0.5", f"kto.lora.r={lora}"]
    runs = {}
    for name, extra in (("synced", ["kto.ref_sync_every=1"]), ("fixed", [])):
        rows = []
        manifest = run(data=str(tmp_path / "train.jsonl"), val_data=str(tmp_path / "train.jsonl"), model=tiny_model, out=str(tmp_path / name),
                       cfg=load_config(None, common + extra), device="cpu", report=rows.append)
        runs[name] = (rows, manifest)
    synced, manifest = runs["synced"]
    assert [r["loss"] for r in synced[1:]] == pytest.approx([0.5, 0.5], abs=1e-5) and [r["kl"] for r in synced[1:]] == pytest.approx([0, 0], abs=1e-5)
    assert synced[-1]["grad_norm"] > 1e-3 and manifest.state["ref_syncs"] == 8
    measured = evaluate(data=str(tmp_path / "train.jsonl"), model=str(tmp_path / "synced"), cfg=load_config(None, common), device="cpu")[0]
    assert synced[-1]["val_loss"] == pytest.approx(measured.loss, abs=1e-5) and synced[-1]["val_margin"] == pytest.approx(measured.margin, abs=1e-5)
    assert measured.margin > 0.05 and measured.loss < 0.5 - 0.005
    fixed, plain = runs["fixed"]
    assert fixed[-1]["loss"] < 0.5 - 0.01 and "ref_syncs" not in plain.state


def test_a_mixed_kto_reference_scores_the_examples_and_their_mismatched_pairs_as_its_weights(tiny_model, tmp_path):
    """Two syncs at α = 0.5: the held copy is α·θ₄ + (1 − α)(α·θ₂ + (1 − α)·θ₀), the policy's
    weights come back from the swaps bit for bit, and both reference values (responses and
    mismatched pairs) are those of a model loaded with the mixed weights."""
    policy = HFPolicy.load(tiny_model, "cpu")
    start = {name: p.detach().clone() for name, p in policy.model.named_parameters()}
    cfg = KtoConfig(batch_size=2, micro_batch_size=2, micro_batch_tokens="0", bf16="false", lr=1e-3, beta=0.5, ref_sync_every=2, ref_sync_alpha=0.5)
    trainer = KtoTrainer(policy, cfg, total_steps=4)
    at_syncs, sync = [], trainer.sync_reference

    def recorded() -> None:
        at_syncs.append({name: p.detach().clone() for name, p in policy.model.named_parameters()})
        sync()

    trainer.sync_reference = recorded
    examples = trainer.with_reference(encode(policy, table_of(tmp_path, number_examples(8))))
    before = list(examples.ref_mismatched)
    trainer.train_epoch(examples, 1)
    assert len(at_syncs) == 2  # after steps 2 and 4
    want = {n: 0.5 * at_syncs[1][n] + 0.5 * (0.5 * at_syncs[0][n] + 0.5 * start[n]) for n in start}
    held = {name: w for (name, _), w in zip(trainer.moving_reference.named, trainer.moving_reference.weights)}
    assert max(float((held[n] - want[n]).abs().max()) for n in want) < 1e-6
    assert all(torch.equal(p, at_syncs[1][n]) for n, p in policy.model.named_parameters())
    mixed = HFPolicy.load(tiny_model, "cpu")
    mixed.model.load_state_dict(want, strict=False)
    with torch.no_grad():
        for sequences, values in ((examples.examples, examples.ref), (examples.mismatched, examples.ref_mismatched)):
            assert values == pytest.approx(summed_logps(mixed.model, sequences.prompt_ids, sequences.response_ids).tolist(), abs=1e-4)
    assert max(abs(a - b) for a, b in zip(before, examples.ref_mismatched)) > 1e-3


def test_a_kto_run_stopped_mid_epoch_resumes_its_mixed_reference_to_the_uninterrupted_weights(tiny_model, tmp_path):
    """The epoch checkpoints keep the held copy and both reference values as of their step."""
    from safetensors.torch import load_file

    from tests.unit.test_dpo import assert_resumed_as_uninterrupted, stopped_in_epoch_2

    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in number_examples(8)))
    cfg = load_config(None, ["kto.epochs=2", "kto.lr=1e-3", "kto.batch_size=4", "kto.bf16=false", "kto.save_steps=1", "kto.ref_sync_every=1", "kto.ref_sync_alpha=0.5"])
    args = {"data": str(tmp_path / "train.jsonl"), "val_data": str(tmp_path / "train.jsonl"), "model": tiny_model, "cfg": cfg, "device": "cpu"}
    whole = run(out=str(tmp_path / "whole"), **args)
    stopped_in_epoch_2(run, out=str(tmp_path / "kto"), **args)
    kept = set(load_file(str(tmp_path / "kto.progress" / "epoch-0001-step-000001" / "kept.safetensors")))
    assert {"train", "held_out"} <= kept and any(name.startswith("reference_weights/") for name in kept)
    resumed = run(out=str(tmp_path / "kto"), **args)
    assert_resumed_as_uninterrupted(resumed, whole, tmp_path / "kto", ("loss", "kl", "margin", "val_loss", "val_margin"))
    assert resumed.state["ref_syncs"] == 4
