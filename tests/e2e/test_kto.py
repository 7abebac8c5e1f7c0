"""`rlctl kto` from the command line: a committed checkpoint a pipeline starts from, rerun
skipped, a killed run resumed; bad input is one line and nothing written."""

import json
from pathlib import Path

import pytest

from rlctl.checkpoint import is_intact
from tests.conftest import assert_not_written, one_line_error
from tests.unit.test_kto import number_examples


@pytest.fixture
def examples(tmp_path) -> Path:
    path = tmp_path / "kto.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in number_examples(8)))
    return path


def test_kto_writes_a_checkpoint_with_its_epochs_that_a_pipeline_starts_from(cli, tmp_path, tiny_model, examples):
    args = ("kto", "--data", examples, "--val-data", examples, "--model", tiny_model, "--out", tmp_path / "kto", "--epochs", "2", "--lr", "1e-3", "--batch-size", "4", "--beta", "0.5")
    result = cli(*args)
    assert result.exit_code == 0, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith("kto: epoch 0  val_loss 0.5  val_margin 0") and lines[2].startswith("kto: epoch 2  loss") and "kto: wrote" in lines[-1]
    assert "kl" in lines[2] and "desirable_reward" in lines[2]
    assert is_intact(str(tmp_path / "kto")) is None and not (tmp_path / "kto" / "trainer_state").exists()
    manifest = json.loads((tmp_path / "kto" / "_manifest.json").read_text())
    assert manifest["stage"] == "kto" and manifest["config"]["kto"]["beta"] == 0.5 and manifest["state"]["optimizer_steps"] == 4
    assert manifest["metrics"]["val_loss"] < 0.5 and manifest["metrics"]["val_margin"] > 0
    assert "skipped" in cli(*args).stderr
    from tests.e2e.test_pipeline import write_config

    config = write_config(tmp_path, str(tmp_path / "kto"), model={"critic": ""}, advantage={"estimator": "grpo", "kl_coef": 0.0}, pipeline={"iterations": 1, "val_every": 0})
    run = cli("pipeline", config, "--run-dir", tmp_path / "run", "--quiet")
    assert run.exit_code == 0, run.stderr


def test_a_pipeline_with_dpo_and_kto_data_trains_dpo_then_kto_from_its_weights_once_and_starts_rl_from_ktos(cli, tmp_path, tiny_model, examples):
    """The warm starts chain: DPO from model.path, KTO from DPO's weights (its reference too:
    the first epoch's loss is 0.5), RL from KTO's (model.ref = "policy" is RUN/kto); each
    trained once, kept on resume."""
    from tests.e2e.test_dpo import PAIRS
    from tests.e2e.test_pipeline import write_config

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
    config = write_config(
        tmp_path, tiny_model, model={"critic": "", "ref": "policy"}, advantage={"estimator": "grpo", "kl_coef": 0.0},
        dpo={"data": str(pairs), "epochs": 1, "lr": 1e-3, "batch_size": 4},
        kto={"data": str(examples), "val_data": str(examples), "epochs": 1, "lr": 1e-3, "batch_size": 4, "beta": 0.5},
        update={"use_kl_loss": True}, pipeline={"iterations": 1, "val_every": 0},
    )
    run = tmp_path / "run"
    plan = cli("pipeline", config, "--run-dir", run, "--dry-run")
    assert plan.exit_code == 0, plan.stderr
    assert f"warm start    {run / 'dpo'}: {tiny_model} trained on the pairs {pairs} (DPO, sigmoid loss, beta 0.1), 1 epoch(s) at lr 0.001, before iteration 1\n" in plan.stdout
    assert f"warm start    {run / 'kto'}: {run / 'dpo'} trained on the labelled examples {examples} (KTO, beta 0.5)" in plan.stdout
    assert f"reference     {run / 'kto'}" in plan.stdout
    first = cli("pipeline", config, "--run-dir", run, "--quiet")
    assert first.exit_code == 0, first.stderr
    kto_manifest = (run / "kto" / "_manifest.json").read_bytes()
    trained = json.loads(kto_manifest)
    assert trained["stage"] == "kto" and trained["config"]["kto"]["beta"] == 0.5 and trained["state"]["optimizer_steps"] == 2
    assert str(run / "dpo") in [i["uri"] for i in trained["inputs"]]  # KTO started from DPO's weights
    epochs = trained["state"]["epochs"]
    assert epochs[0]["val_loss"] == pytest.approx(0.5, abs=1e-6) and epochs[-1]["val_loss"] < 0.5  # its reference is where it started
    rollout = json.loads((run / "iter-0001" / "rollout" / "_manifest.json").read_text())
    assert rollout["state"]["weights_source"] == str(run / "kto")
    more = cli("pipeline", config, "--run-dir", run, "--quiet", "--iterations", "2")
    assert more.exit_code == 0, more.stderr
    assert (run / "kto" / "_manifest.json").read_bytes() == kto_manifest  # resumed: no second KTO


def test_eval_measures_a_trained_policy_against_its_recorded_reference_over_all_and_per_data_source(cli, tmp_path, tiny_model, examples):
    trained = cli("kto", "--data", examples, "--val-data", examples, "--model", tiny_model, "--out", tmp_path / "kto", "--epochs", "2", "--lr", "1e-3", "--batch-size", "4")
    assert trained.exit_code == 0, trained.stderr
    manifest = json.loads((tmp_path / "kto" / "_manifest.json").read_text())
    assert manifest["state"]["reference"] == str(tiny_model)
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({**r, "data_source": "small" if i < 4 else "large"}) + "\n" for i, r in enumerate(number_examples(8))))
    result = cli("kto", "--eval", "--data", held, "--model", tmp_path / "kto", "--json")
    assert result.exit_code == 0, result.stderr
    every, *per_source = json.loads(result.stdout)["rows"]
    # the same examples against the recorded reference: the trained policy's own held-out figures
    assert every["source"] == "all" and every["examples"] == 8
    assert abs(every["loss"] - manifest["metrics"]["val_loss"]) < 1e-5 and abs(every["margin"] - manifest["metrics"]["val_margin"]) < 1e-5
    assert [(r["source"], r["examples"]) for r in per_source] == [("small", 4), ("large", 4)]
    named = json.loads(cli("kto", "--eval", "--data", held, "--model", tmp_path / "kto", "--ref", tiny_model, "--json").stdout)["rows"][0]
    assert named == every
    start = json.loads(cli("kto", "--eval", "--data", held, "--model", tiny_model, "--ref", tiny_model, "--json").stdout)["rows"][0]
    assert abs(start["loss"] - 0.5) < 1e-6 and abs(start["margin"]) < 1e-6 and start["kl"] == 0.0  # a policy against itself: r = z = 0
    only_good = tmp_path / "good.jsonl"
    only_good.write_text("".join(json.dumps(r) + "\n" for r in number_examples(8) if r["label"]))
    table = cli("kto", "--eval", "--data", only_good, "--model", tmp_path / "kto")
    assert table.exit_code == 0 and "undesirable_reward" in table.stdout and "—" in table.stdout  # no undesirable example: no figure
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.jsonl", "held.jsonl", "kto", "kto.jsonl"]  # nothing written


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--eval", "--model", "{tiny_model}"], "kto --eval: {tiny_model} is not a checkpoint rlctl kto wrote, so its reference is unknown: give it as --ref"),
        (["--eval", "--model", "{tiny_model}", "--ref", "{tiny_model}", "--out", "{tmp_path}/out"], "--eval trains nothing and writes nothing"),
        (["--model", "{tiny_model}", "--ref", "{tiny_model}", "--out", "{tmp_path}/out"], "kto --ref names the reference of --eval"),
        (["--model", "{tiny_model}"], "kto needs --out"),
    ],
)
def test_eval_without_a_known_reference_or_a_write_asked_of_eval_is_one_line(cli, tmp_path, tiny_model, examples, args, fragment):
    result = cli("kto", "--data", examples, *(a.format(tiny_model=tiny_model, tmp_path=tmp_path) for a in args))
    assert result.exit_code == 2 and fragment.format(tiny_model=tiny_model) in one_line_error(result), result.stderr
    assert_not_written(tmp_path / "out")


@pytest.mark.parametrize(
    ("rows", "args", "fragment"),
    [
        ([{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": "d"}], [], "KTO examples need a 'label' column"),
        ([{"prompt": "a", "completion": "b", "label": True}], [], "KTO needs at least 2 examples"),
        ([{"prompt": "a", "completion": "", "label": True}, {"prompt": "c", "completion": "d", "label": False}], [], "example '0' has an empty response"),
        ([{"prompt": "a", "completion": "b " * 40, "label": True}, {"prompt": "c", "completion": "d", "label": False}], ["--set", "kto.max_tokens=20"], "over 20 (kto.max_tokens)"),
        ([{"prompt": "a", "completion": "b", "label": True}, {"prompt": "c", "completion": "d", "label": False}], ["--beta", "0"], "kto.beta must be > 0"),
        ([{"prompt": "a", "completion": "b", "label": True}, {"prompt": "c", "completion": "d", "label": False}], ["--batch-size", "1"], "kto.batch_size must be ≥ 2"),
        ([{"prompt": "a", "completion": "b", "label": True}, {"prompt": "c", "completion": "d", "label": False}], ["--set", "kto.undesirable_weight=0"], "kto.undesirable_weight must be > 0"),
        ([{"prompt": "a", "completion": "b", "label": True}, {"prompt": "c", "completion": "d", "label": False}], ["--set", "kto.ref_sync_every=4", "--set", "kto.ref_sync_alpha=1.5"], "kto.ref_sync_alpha must be in (0, 1], got 1.5"),
        ([{"prompt": "a", "completion": "b", "label": True}, {"prompt": "c", "completion": "d", "label": False}], ["--set", "kto.ref_sync_every=-1"], "kto.ref_sync_every must be ≥ 0"),
        ([{"prompt": "a", "completion": "b", "label": True}, {"prompt": "c", "completion": "d", "label": False}], ["--loss", "apo_zero"], "kto.loss must be one of kto, apo_zero_unpaired"),
        ([{"prompt": "a", "completion": "b", "label": True}, {"prompt": "c", "completion": "d", "label": False}], ["--set", "kto.ref_sync_every=4", "--set", "kto.ref_sync_alpha=0.6", "--set", "kto.lora.r=4"], "a LoRA run trains its adapters only"),
    ],
)
def test_bad_input_is_one_line_and_nothing_written(cli, tmp_path, tiny_model, rows, args, fragment):
    data = tmp_path / "kto.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = cli("kto", "--data", data, "--model", tiny_model, "--out", tmp_path / "out", *args)
    assert result.exit_code == 2, result.stderr
    assert fragment in one_line_error(result)
    assert_not_written(tmp_path / "out")


def test_kto_into_its_own_model_folder_is_refused(cli, tmp_path, tiny_model, examples):
    result = cli("kto", "--data", examples, "--model", tiny_model, "--out", tiny_model)
    assert result.exit_code == 2 and "is the --model folder" in one_line_error(result)


@pytest.mark.slow
def test_a_kto_killed_mid_epoch_resumes_with_the_starting_weights_reference_to_the_uninterrupted_result(tmp_path, tiny_model, examples):
    """The checkpoint keeps the reference's log-probabilities of the responses and of the
    mismatched pairs: the weights it holds are no longer the reference."""
    from tests.e2e.test_pipeline import rlctl
    from tests.e2e.test_sft import comparable

    args = ["kto", "--data", examples, "--val-data", examples, "--model", tiny_model, "--epochs", "2", "--lr", "1e-3", "--batch-size", "2", "--set", "kto.save_steps=3"]
    rlctl(*args, "--out", tmp_path / "whole")
    assert rlctl(*args, "--out", tmp_path / "kto", env={"RLCTL_FAULT_KILL_AT": "kto:epoch-2-step-3-saved"}, check=False).returncode == -9
    assert [f.name for f in (tmp_path / "kto.progress").iterdir()] == ["epoch-0001-step-000003"]
    resumed = rlctl(*args, "--out", tmp_path / "kto")
    assert "resuming kto 3 steps into epoch 2" in resumed.stderr and not (tmp_path / "kto.progress").exists()
    assert (tmp_path / "kto" / "model.safetensors").read_bytes() == (tmp_path / "whole" / "model.safetensors").read_bytes()
    got, want = (json.loads((tmp_path / name / "_manifest.json").read_text())["state"]["epochs"] for name in ("kto", "whole"))
    assert comparable(got) == comparable(want) and len(got) == 3
