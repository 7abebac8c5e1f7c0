"""The reference mixed from the policy: α·policy + (1 − α)·reference per tensor, a weights file
at a time, whatever files the reference keeps its tensors in; committed, reused only when made
of the same things; only safetensors folders of one architecture mix."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlctl.checkpoint import save_checkpoint
from rlctl.errors import InputError
from rlctl.manifest import Manifest
from rlctl.ref_sync import RefSync, check_mixable, mixed, prune_references, write_synced_reference
from rlctl.shards import commit_empty, is_committed, read_manifest


def test_a_sync_is_due_after_every_nth_iteration_and_never_at_zero():
    assert [i for i in range(1, 8) if RefSync(3, 1.0).due(i)] == [3, 6]
    assert not any(RefSync(0, 1.0).due(i) for i in range(1, 8))


def test_mixed_is_the_policy_at_alpha_one_and_the_weighted_sum_in_the_policys_dtype():
    policy, ref = torch.randn(4, 3), torch.randn(4, 3)
    assert mixed(policy, ref, 1.0) is policy
    torch.testing.assert_close(mixed(policy, ref, 0.6), 0.6 * policy + 0.4 * ref, rtol=0, atol=1e-6)
    low = mixed(policy.bfloat16(), ref.bfloat16(), 0.5)
    assert low.dtype == torch.bfloat16
    assert torch.equal(low, (0.5 * policy.bfloat16().float() + 0.5 * ref.bfloat16().float()).bfloat16())
    steps = torch.tensor([3, 4])
    assert torch.equal(mixed(steps, torch.tensor([0, 0]), 0.5), steps)  # not a weight: the policy's


@pytest.fixture
def folders(tmp_path, tiny_model):
    """A committed checkpoint of the tiny model, and a reference of other weights whose
    tensors lie in two files."""
    from rlctl.backends.hf import HFPolicy

    policy = tmp_path / "checkpoint"
    save_checkpoint(str(policy), policy=HFPolicy.load(tiny_model, "cpu"), trainer_state=None, manifest=Manifest(stage="checkpoint"))
    ref = tmp_path / "ref"
    shutil.copytree(tiny_model, ref)
    tensors = {name: tensor + 1.0 for name, tensor in load_file(str(ref / "model.safetensors")).items()}
    (ref / "model.safetensors").unlink()
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[::2]}, str(ref / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[1::2]}, str(ref / "model-00002-of-00002.safetensors"))
    return policy, ref, tensors


def test_the_mixed_reference_is_a_committed_model_folder_of_the_weighted_tensors(tmp_path, folders):
    from rlctl.backends.hf import HFPolicy

    policy, ref, ref_tensors = folders
    out = write_synced_reference(tmp_path / "refs" / "iter-0002", policy=policy, ref=str(ref), alpha=0.25)
    assert is_committed(str(out))
    weights, start = load_file(str(out / "model.safetensors")), load_file(str(policy / "model.safetensors"))
    assert weights.keys() == start.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, 0.25 * start[name] + 0.75 * ref_tensors[name], rtol=0, atol=1e-6)
    assert json.loads((out / "config.json").read_text()) == json.loads((policy / "config.json").read_text())
    assert not (out / "trainer_state").exists()
    HFPolicy.load(str(out), "cpu")  # verified against its manifest and loadable


def test_a_reset_copies_the_policys_weights_bit_for_bit(tmp_path, folders):
    policy, ref, _ = folders
    out = write_synced_reference(tmp_path / "reset", policy=policy, ref=str(ref), alpha=1.0)
    assert (out / "model.safetensors").read_bytes() == (policy / "model.safetensors").read_bytes()


def test_a_committed_reference_is_reused_only_when_made_of_the_same_things(tmp_path, folders):
    policy, ref, _ = folders
    out = write_synced_reference(tmp_path / "r", policy=policy, ref=str(ref), alpha=0.5)
    digest = read_manifest(str(out))[1]
    write_synced_reference(tmp_path / "r", policy=policy, ref=str(ref), alpha=0.5)
    assert read_manifest(str(out))[1] == digest
    write_synced_reference(tmp_path / "r", policy=policy, ref=str(ref), alpha=0.75)
    assert read_manifest(str(out))[0].config["ref_sync"]["alpha"] == 0.75


def test_only_safetensors_folders_of_one_architecture_mix(tmp_path, folders):
    policy, ref, tensors = folders
    name = sorted(tensors)[0]
    save_file({name: torch.zeros(2, 2)}, str(ref / "model-00001-of-00002.safetensors"))
    with pytest.raises(InputError, match=rf"tensor '{name}' is \[.*\] in {policy} but \[2, 2\] in {ref}"):
        check_mixable(policy, ref)
    (ref / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(InputError, match=rf"{ref} has no tensor '{name}'"):
        check_mixable(policy, ref)
    for file in ref.glob("*.safetensors"):
        file.unlink()
    with pytest.raises(InputError, match="holds no .safetensors weights"):
        write_synced_reference(tmp_path / "out", policy=policy, ref=str(ref), alpha=0.5)
    assert not (tmp_path / "out" / "_manifest.json").exists()


def test_references_no_checkpoint_score_or_current_run_names_are_pruned(tmp_path):
    run = tmp_path / "run"
    refs = [run / "refs" / f"iter-{i:04d}" for i in (1, 2, 3, 4)]
    for folder in refs:
        commit_empty(str(folder), Manifest(stage="reference"))
    commit_empty(str(run / "checkpoints" / "iter-0003"), Manifest(stage="checkpoint", state={"pipeline": {"ref_source": str(refs[1])}}))
    commit_empty(str(run / "iter-0004" / "score"), Manifest(stage="score", state={"ref_source": str(refs[2])}))
    commit_empty(str(run / "iter-0001" / "score-r2"), Manifest(stage="score", state={"ref_source": str(refs[0])}))
    (run / "iter-0002" / "score").mkdir(parents=True)  # uncommitted: names nothing
    removed = prune_references(run, current=str(refs[3]))
    assert removed == []
    (run / "iter-0001" / "score-r2" / "_manifest.json").unlink()
    assert prune_references(run, current=str(refs[3])) == [refs[0]]
    assert sorted(p.name for p in (run / "refs").iterdir()) == ["iter-0002", "iter-0003", "iter-0004"]
