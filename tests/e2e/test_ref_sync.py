"""pipeline.ref_sync_every: after every N iterations' update the reference becomes the policy
(or a mix with it), written to RUN/refs and scored with from the next iteration on; a run
stopped between its checkpoint and the sync resumes to the same weights; score replays with
the reference it used."""

import pytest
import torch
from safetensors.torch import load_file

from rlctl import shards
from rlctl.pipeline import Pipeline
from tests.conftest import one_line_error
from tests.e2e.test_pipeline import metrics_without_timings, write_config

SYNCED = {
    "model": {"critic": ""},
    "advantage": {"estimator": "grpo", "kl_coef": 0.05, "kl_controller": "fixed"},
    "score": {"old_logprobs": "recompute", "dtype": "fp32"},  # the reference's and the policy's log-probs compared
    "update": {"epochs": 1},
    "pipeline": {"iterations": 4, "val_every": 0, "ref_sync_every": 2},
}


def synced_config(tmp_path, tiny_model, **changes):
    sections = {name: {**values, **changes.get(name, {})} for name, values in SYNCED.items()}
    return write_config(tmp_path, tiny_model, **sections)


def token_gaps(scores) -> float:
    """The largest |reference − policy| log-prob over the scored tokens."""
    ref, old = scores.column("ref_logprobs").to_pylist(), scores.column("old_logprobs").to_pylist()
    return max(abs(a - b) for r, o in zip(ref, old) for a, b in zip(r, o))


@pytest.fixture(scope="module")
def synced_run(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("synced")
    config = synced_config(tmp, tiny_model)
    rows = Pipeline.from_config(config, [f"pipeline.run_dir={tmp / 'run'}"]).run()
    return config, tmp / "run", rows


def test_after_a_sync_the_reference_is_the_policy_that_scores_the_next_iteration(synced_run):
    _, run, rows = synced_run
    assert [row["ref_syncs"] for row in rows] == [0, 1, 1, 2]
    synced = load_file(str(run / "refs" / "iter-0002" / "model.safetensors"))
    checkpoint = load_file(str(run / "checkpoints" / "iter-0002" / "model.safetensors"))
    assert synced.keys() == checkpoint.keys() and all(torch.equal(synced[k], checkpoint[k]) for k in synced)
    gaps = {i: token_gaps(shards.read(str(run / f"iter-{i:04d}" / "score"), "scores").table) for i in (1, 2, 3, 4)}
    assert gaps[1] < 1e-6 and gaps[3] < 1e-6  # iteration 1: the policy starts as the reference; 3: it was just synced
    assert gaps[2] > 1e-3 and gaps[4] > 1e-3  # one update away from it
    assert rows[2]["kl_divergence"] == pytest.approx(0.0, abs=1e-6) and rows[1]["kl_divergence"] != pytest.approx(0.0, abs=1e-6)
    states = {i: shards.read_manifest(str(run / f"iter-{i:04d}" / "score"))[0].state["ref_source"] for i in (2, 3)}
    assert states[3] == str(run / "refs" / "iter-0002") and states[2] != states[3]
    assert (run / "refs" / "iter-0004" / "_manifest.json").exists()  # the reference a continued run starts from


def test_a_score_that_used_a_synced_reference_replays_identical(cli, synced_run):
    _, run, _ = synced_run
    replayed = cli("replay", run / "iter-0003" / "score", "--check")
    assert replayed.exit_code == 0 and "identical" in replayed.stdout, replayed.stderr


def test_a_run_stopped_between_its_checkpoint_and_the_sync_resumes_to_the_same_weights_and_metrics(tmp_path, tiny_model, synced_run, monkeypatch):
    config, reference, _ = synced_run

    def crash(self, i):
        raise KeyboardInterrupt

    run = tmp_path / "run"
    with monkeypatch.context() as patched:
        patched.setattr(Pipeline, "_sync_reference", crash)
        with pytest.raises(KeyboardInterrupt):
            Pipeline.from_config(config, [f"pipeline.run_dir={run}"]).run()
    assert (run / "checkpoints" / "iter-0002" / "_manifest.json").exists() and not (run / "refs").exists()
    Pipeline.from_config(config, [f"pipeline.run_dir={run}"]).run(iterations=3)  # made again from checkpoint 2
    Pipeline.from_config(config, [f"pipeline.run_dir={run}"]).run()  # from checkpoint 3, with the reference it recorded
    expected, got = final_weights_of(reference), final_weights_of(run)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert metrics_without_timings(run) == metrics_without_timings(reference)


def final_weights_of(run):
    return load_file(str(run / "checkpoints" / "iter-0004" / "model.safetensors"))


def test_a_mixing_sync_moves_the_reference_part_way_and_old_references_are_pruned(tmp_path, tiny_model):
    config = synced_config(tmp_path, tiny_model, pipeline={"ref_sync_every": 1, "ref_sync_alpha": 0.5, "iterations": 3, "keep_shards": 1, "keep_checkpoints": 1})
    run = tmp_path / "run"
    Pipeline.from_config(config, [f"pipeline.run_dir={run}"]).run()
    start = load_file(f"{tiny_model}/model.safetensors")
    first = load_file(str(run / "refs" / "iter-0001" / "model.safetensors")) if (run / "refs" / "iter-0001").exists() else None
    assert first is None  # named by nothing kept: iteration 1's score is pruned, and its checkpoint
    assert sorted(p.name for p in (run / "refs").iterdir()) == ["iter-0002", "iter-0003"]  # iteration 3 scored with the first, the next starts from the second
    policy = load_file(str(run / "checkpoints" / "iter-0003" / "model.safetensors"))
    before = load_file(str(run / "refs" / "iter-0002" / "model.safetensors"))
    after = load_file(str(run / "refs" / "iter-0003" / "model.safetensors"))
    for name, tensor in after.items():
        torch.testing.assert_close(tensor, 0.5 * policy[name] + 0.5 * before[name], rtol=0, atol=1e-7)
    assert any(not torch.equal(after[k], start[k]) and not torch.equal(after[k], policy[k]) for k in after)


def test_dry_run_says_how_the_reference_follows_the_policy(cli, tmp_path, tiny_model):
    result = cli("pipeline", synced_config(tmp_path, tiny_model, pipeline={"ref_sync_alpha": 0.6}), "--run-dir", tmp_path / "run", "--dry-run")
    assert result.exit_code == 0, result.stderr
    assert "← 0.6·policy + 0.4·reference after every 2 iteration(s)' update" in result.stdout


@pytest.mark.parametrize("args,fragment", [
    (["--set", "model.ref=", "--set", "advantage.kl_coef=0"], "pipeline.ref_sync_every moves the reference model towards the policy: set model.ref"),
    (["--set", "update.lora.r=4"], "pipeline.ref_sync_every mixes the policy's full weights into the reference"),
    (["--set", "pipeline.ref_sync_alpha=0"], "pipeline.ref_sync_alpha must be in (0, 1], got 0"),
    (["--set", "pipeline.ref_sync_every=-1"], "pipeline.ref_sync_every"),
])
def test_bad_ref_sync_settings_fail_before_any_work(cli, tmp_path, tiny_model, args, fragment):
    result = cli("pipeline", synced_config(tmp_path, tiny_model), "--run-dir", tmp_path / "run", *args)
    assert result.exit_code == 2, result.stderr
    assert fragment in one_line_error(result)
    assert not (tmp_path / "run").exists()


def test_a_reference_of_another_architecture_cannot_follow_the_policy(cli, tmp_path, tiny_model, tmp_path_factory):
    from rlctl.modelinit import init_model

    other = init_model(tmp_path_factory.mktemp("models") / "small", "small", seed=0)
    result = cli("pipeline", synced_config(tmp_path, tiny_model), "--run-dir", tmp_path / "run", "--set", f"model.ref={other}")
    assert result.exit_code == 2, result.stderr
    assert f"pipeline.ref_sync_every: tensor 'model.embed_tokens.weight' is [512, 128] in {tiny_model} but [" in one_line_error(result)
    assert not (tmp_path / "run").exists()
