"""`rlctl sft` from the command line: a committed checkpoint a pipeline starts from at step 0,
with LoRA too; rerun is skipped; bad input is one line and nothing written."""

import json
import math
from pathlib import Path

import pytest

from rlctl.checkpoint import is_intact
from tests.conftest import assert_not_written, one_line_error
from tests.e2e.test_pipeline import write_config

EXAMPLES = [{"prompt": f"Question {i}: what is {i} + {i}?", "response": f"{2 * i}"} for i in range(6)]


@pytest.fixture
def examples(tmp_path) -> Path:
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in EXAMPLES))
    return path


def test_sft_writes_a_checkpoint_that_a_pipeline_starts_from_at_step_0(cli, tmp_path, tiny_model, examples):
    result = cli("sft", "--data", examples, "--val-data", examples, "--model", tiny_model, "--out", tmp_path / "sft", "--epochs", "3", "--lr", "1e-3", "--batch-size", "4")
    assert result.exit_code == 0, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith("sft: epoch 0  val_loss") and lines[3].startswith("sft: epoch 3  loss") and "sft: wrote" in lines[-1]
    assert is_intact(str(tmp_path / "sft")) is None
    manifest = json.loads((tmp_path / "sft" / "_manifest.json").read_text())
    assert manifest["stage"] == "sft" and manifest["state"]["optimizer_steps"] == 6 and manifest["metrics"]["val_loss"] < manifest["state"]["epochs"][0]["val_loss"]
    assert "skipped" in cli("sft", "--data", examples, "--val-data", examples, "--model", tiny_model, "--out", tmp_path / "sft", "--epochs", "3", "--lr", "1e-3", "--batch-size", "4").stderr
    shown = cli("show", tmp_path / "sft")
    assert shown.exit_code == 0 and "sft" in shown.stdout and "val_loss" in shown.stdout

    config = write_config(tmp_path, str(tmp_path / "sft"), model={"critic": ""}, advantage={"estimator": "grpo", "kl_coef": 0.0}, pipeline={"iterations": 1, "val_every": 0})
    run = cli("pipeline", config, "--run-dir", tmp_path / "run", "--quiet")
    assert run.exit_code == 0, run.stderr
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["iteration"] == 1 and row["policy_version"] == 4
    state = json.loads((tmp_path / "run" / "checkpoints" / "iter-0001" / "trainer_state" / "state.json").read_text())
    assert state["step"] == 4  # the RL optimizer's own steps from 0 (2 mini-batches × 2 epochs), not after the SFT's 6


def test_lora_sft_writes_an_adapter_over_its_base(cli, tmp_path, tiny_model, examples):
    result = cli("sft", "--data", examples, "--val-data", examples, "--model", tiny_model, "--out", tmp_path / "sft", "--set", "sft.lora.r=4", "--lr", "1e-3", "--json")
    assert result.exit_code == 0, result.stderr
    written = json.loads(result.stdout)
    assert written["stage"] == "sft"
    assert (tmp_path / "sft" / "adapter_config.json").exists() and not (tmp_path / "sft" / "model.safetensors").exists()
    measured = json.loads(cli("sft", "--eval", "--data", examples, "--model", tmp_path / "sft", "--json").stdout)["rows"][0]
    assert abs(measured["loss"] - written["metrics"]["val_loss"]) < 1e-5  # the adapter over its base, as training measured it
    merged = cli("reshard", "--checkpoint", tmp_path / "sft", "--out", tmp_path / "merged", "--merge-lora")
    assert merged.exit_code == 0, merged.stderr


def test_eval_measures_a_model_on_held_out_examples_over_all_and_per_data_source(cli, tmp_path, tiny_model, examples):
    trained = cli("sft", "--data", examples, "--val-data", examples, "--model", tiny_model, "--out", tmp_path / "sft", "--epochs", "2", "--lr", "1e-3", "--batch-size", "4")
    assert trained.exit_code == 0, trained.stderr
    manifest = json.loads((tmp_path / "sft" / "_manifest.json").read_text())
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({**r, "data_source": "odd" if i % 2 else "even"}) + "\n" for i, r in enumerate(EXAMPLES)))
    result = cli("sft", "--eval", "--data", held, "--model", tmp_path / "sft", "--json")
    assert result.exit_code == 0, result.stderr
    every, *per_source = json.loads(result.stdout)["rows"]
    # the same examples: the trained model's own held-out loss, per response token; before training, epoch 0's
    assert every["source"] == "all" and every["examples"] == 6 and abs(every["loss"] - manifest["metrics"]["val_loss"]) < 1e-5
    assert abs(every["perplexity"] - math.exp(every["loss"])) < 1e-6 * every["perplexity"]
    assert [(r["source"], r["examples"]) for r in per_source] == [("even", 3), ("odd", 3)]
    assert sum(r["tokens"] for r in per_source) == every["tokens"]
    assert abs(sum(r["tokens"] * r["loss"] for r in per_source) / every["tokens"] - every["loss"]) < 1e-6  # a mean per token, not per example
    start = json.loads(cli("sft", "--eval", "--data", held, "--model", tiny_model, "--json").stdout)["rows"][0]
    assert abs(start["loss"] - manifest["state"]["epochs"][0]["val_loss"]) < 1e-5 and start["loss"] > every["loss"]
    table = cli("sft", "--eval", "--data", held, "--model", tmp_path / "sft")
    assert table.exit_code == 0 and "perplexity" in table.stdout and "odd" in table.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["held.jsonl", "sft", "sft.jsonl"]  # nothing written


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--eval", "--out", "{tmp_path}/out"], "sft --eval trains nothing and writes nothing"),
        (["--eval", "--val-data", "{examples}"], "sft --eval trains nothing and writes nothing"),
        ([], "sft needs --out"),
    ],
)
def test_eval_asked_to_write_or_training_without_out_is_one_line(cli, tmp_path, tiny_model, examples, args, fragment):
    result = cli("sft", "--data", examples, "--model", tiny_model, *(a.format(tmp_path=tmp_path, examples=examples) for a in args))
    assert result.exit_code == 2 and fragment in one_line_error(result), result.stderr
    assert_not_written(tmp_path / "out")


@pytest.mark.parametrize(
    ("rows", "args", "fragment"),
    [
        ([{"prompt": "a"}], [], "example '0' has no response"),
        ([{"prompt": "a", "response": ""}], [], "example '0' has an empty response"),
        ([{"prompt": "a", "response": "b " * 40}], ["--set", "sft.max_tokens=20"], "over 20 (sft.max_tokens)"),
        ([{"response": "b"}], [], "needs one of the columns 'prompt', 'messages'"),
        ([{"prompt": "a", "response": "b"}], ["--set", "sft.truncate=left"], "sft.truncate must be one of error, right"),
        ([{"prompt": "a", "response": "b"}], ["--set", "sft.micro_batch_tokens=lots"], "sft.micro_batch_tokens must be auto, 0 (no cap) or a number"),
        ([{"prompt": "a", "response": "b"}], ["--epochs", "0"], "sft.epochs must be ≥ 1"),
    ],
)
def test_bad_input_is_one_line_and_nothing_written(cli, tmp_path, tiny_model, rows, args, fragment):
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = cli("sft", "--data", data, "--model", tiny_model, "--out", tmp_path / "out", *args)
    assert result.exit_code == 2, result.stderr
    assert fragment in one_line_error(result)
    assert_not_written(tmp_path / "out")


def test_sft_into_its_own_model_folder_is_refused(cli, tmp_path, tiny_model, examples):
    result = cli("sft", "--data", examples, "--model", tiny_model, "--out", tiny_model)
    assert result.exit_code == 2 and "is the --model folder" in one_line_error(result)


def test_a_pipeline_with_sft_data_warm_starts_once_and_its_first_iteration_replays(cli, tmp_path, tiny_model, examples):
    config = write_config(
        tmp_path, tiny_model, model={"critic": "", "ref": "policy"}, advantage={"estimator": "grpo", "kl_coef": 0.0},
        sft={"data": str(examples), "epochs": 2, "lr": 1e-3, "batch_size": 4}, update={"use_kl_loss": True},
        pipeline={"iterations": 1, "val_every": 1, "val_before_train": True},
    )
    plan = cli("pipeline", config, "--run-dir", tmp_path / "run", "--dry-run")
    assert f"warm start    {tmp_path / 'run' / 'sft'}" in plan.stdout and f"reference     {tmp_path / 'run' / 'sft'}" in plan.stdout
    first = cli("pipeline", config, "--run-dir", tmp_path / "run", "--quiet")
    assert first.exit_code == 0, first.stderr
    sft_manifest = (tmp_path / "run" / "sft" / "_manifest.json").read_bytes()
    assert json.loads(sft_manifest)["state"]["optimizer_steps"] == 4 and is_intact(str(tmp_path / "run" / "sft")) is None
    rollout = json.loads((tmp_path / "run" / "iter-0001" / "rollout" / "_manifest.json").read_text())
    assert rollout["state"]["weights_source"] == str(tmp_path / "run" / "sft")
    for stage in ("iter-0000/val", "iter-0001/rollout", "iter-0001/update"):
        replayed = cli("replay", tmp_path / "run" / stage, "--check")
        assert replayed.exit_code == 0 and "identical" in replayed.stdout, (stage, replayed.stdout, replayed.stderr)
    more = cli("pipeline", config, "--run-dir", tmp_path / "run", "--quiet", "--iterations", "2")
    assert more.exit_code == 0, more.stderr
    assert (tmp_path / "run" / "sft" / "_manifest.json").read_bytes() == sft_manifest  # resumed from the checkpoint: no second warm start


@pytest.mark.parametrize("section", ["sft", "dpo", "kto"])
def test_a_pipeline_warm_start_with_lora_is_refused_before_any_work(cli, tmp_path, tiny_model, examples, section):
    config = write_config(tmp_path, tiny_model, **{section: {"data": str(examples)}})
    result = cli("pipeline", config, "--run-dir", tmp_path / "run", "--set", f"{section}.lora.r=4")
    assert result.exit_code == 2 and f"{section}.data: the pipeline's warm start trains every weight" in one_line_error(result)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_pipeline_on_ray_workers_warm_starts_on_them_then_trains(cli, tmp_path, tiny_model, examples):
    config = write_config(
        tmp_path, tiny_model, model={"critic": "", "ref": "policy"}, advantage={"estimator": "grpo", "kl_coef": 0.0},
        sft={"data": str(examples), "epochs": 2, "lr": 1e-3, "batch_size": 4}, update={"use_kl_loss": True}, pipeline={"iterations": 1, "val_every": 0},
    )
    result = cli("pipeline", config, "--run-dir", tmp_path / "run", "--quiet", "--workers-backend", "ray", "--workers", "2")
    assert result.exit_code == 0, result.stderr
    manifest = json.loads((tmp_path / "run" / "sft" / "_manifest.json").read_text())
    assert manifest["state"]["workers"]["num_workers"] == 2 and manifest["state"]["optimizer_steps"] == 4
    assert json.loads((tmp_path / "run" / "iter-0001" / "rollout" / "_manifest.json").read_text())["state"]["weights_source"] == str(tmp_path / "run" / "sft")


def comparable(rows: list[dict]) -> list[dict]:
    """An epoch's figures without its clock."""
    return [{k: v for k, v in row.items() if k not in ("seconds", "tokens_per_s", "pairs_per_s", "examples_per_s")} for row in rows]


@pytest.mark.slow  # the mid-epoch case below stays in the default run
@pytest.mark.parametrize("lora", [0, 4])
def test_an_sft_killed_mid_run_resumes_from_its_last_whole_epoch_checkpoint_to_the_uninterrupted_result(tmp_path, tiny_model, examples, lora):
    from tests.e2e.test_pipeline import rlctl

    args = ["sft", "--data", examples, "--val-data", examples, "--model", tiny_model, "--epochs", "3", "--lr", "1e-3", "--batch-size", "4", "--set", f"sft.lora.r={lora}"]
    rlctl(*args, "--out", tmp_path / "whole")
    # killed while epoch 2's checkpoint is written: epoch 1's is still whole
    killed = rlctl(*args, "--out", tmp_path / "sft", env={"RLCTL_FAULT_KILL_AT": "sft.progress/epoch-0002:before-commit"}, check=False)
    assert killed.returncode == -9 and not (tmp_path / "sft" / "_manifest.json").exists()
    assert is_intact(str(tmp_path / "sft.progress" / "epoch-0001")) is None  # the weights and optimizer state after epoch 1
    assert not (tmp_path / "sft.progress" / "epoch-0002" / "_manifest.json").exists()
    resumed = rlctl(*args, "--out", tmp_path / "sft")
    assert f"resuming sft after epoch 1 from {tmp_path / 'sft.progress' / 'epoch-0001'}" in resumed.stderr
    assert [line.split("  ")[0] for line in resumed.stderr.splitlines() if line.startswith("sft: epoch")] == ["sft: epoch 2", "sft: epoch 3"]
    assert not (tmp_path / "sft.progress").exists() and is_intact(str(tmp_path / "sft")) is None
    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    assert (tmp_path / "sft" / weights).read_bytes() == (tmp_path / "whole" / weights).read_bytes()  # bit for bit
    got, want = (json.loads((tmp_path / name / "_manifest.json").read_text())["state"] for name in ("sft", "whole"))
    assert comparable(got["epochs"]) == comparable(want["epochs"]) and got["optimizer_steps"] == want["optimizer_steps"] == 6


def test_an_epoch_checkpoint_of_other_settings_is_not_resumed_from(cli, tmp_path, tiny_model, examples):
    args = ["sft", "--data", examples, "--model", tiny_model, "--out", tmp_path / "sft", "--epochs", "2", "--lr", "1e-3", "--batch-size", "4"]
    from tests.e2e.test_pipeline import rlctl

    assert rlctl(*args, env={"RLCTL_FAULT_KILL_AT": "sft:epoch-1-saved"}, check=False).returncode == -9
    other = cli(*args[:-2], "--batch-size", "3")
    assert other.exit_code == 0 and "resuming" not in other.stderr and not (tmp_path / "sft.progress").exists()


def test_a_finished_runs_leftover_epoch_checkpoint_goes_at_the_skipped_rerun_and_another_runs_stays(cli, tmp_path, tiny_model, examples, monkeypatch):
    """A crash between the output's commit and the removal of its epoch checkpoints leaves
    them beside a committed output: the rerun, skipped, removes them; a checkpoint of another
    run's settings is not this output's to remove."""
    import shutil

    from rlctl import epoch_checkpoints

    args = ["sft", "--data", examples, "--model", tiny_model, "--epochs", "2", "--lr", "1e-3"]
    with monkeypatch.context() as crashed:
        crashed.setattr(epoch_checkpoints, "clear", lambda out: None)  # as if killed before the removal
        assert cli(*args, "--batch-size", "4", "--out", tmp_path / "sft").exit_code == 0
        assert cli(*args, "--batch-size", "3", "--out", tmp_path / "other").exit_code == 0
    assert (tmp_path / "sft.progress" / "epoch-0001").is_dir()
    rerun = cli(*args, "--batch-size", "4", "--out", tmp_path / "sft")
    assert rerun.exit_code == 0 and "skipped" in rerun.stderr and not (tmp_path / "sft.progress").exists()
    shutil.move(tmp_path / "other.progress", tmp_path / "sft.progress")  # another run's, crashed while training into the same folder
    assert "skipped" in cli(*args, "--batch-size", "4", "--out", tmp_path / "sft").stderr
    assert (tmp_path / "sft.progress" / "epoch-0001").is_dir()


def test_an_sft_killed_mid_epoch_resumes_from_its_step_checkpoint_to_the_uninterrupted_result(tmp_path, tiny_model, examples):
    """sft.save_steps: a checkpoint every N optimizer steps within an epoch too, the sums of
    the epoch's steps so far in its manifest; saving more or less often is not a change of
    the run (a rerun without the setting resumes from it)."""
    from tests.e2e.test_pipeline import rlctl

    args = ["sft", "--data", examples, "--val-data", examples, "--model", tiny_model, "--epochs", "2", "--lr", "1e-3", "--batch-size", "2"]  # 3 steps an epoch
    rlctl(*args, "--out", tmp_path / "whole")
    killed = rlctl(*args, "--out", tmp_path / "sft", "--set", "sft.save_steps=2", env={"RLCTL_FAULT_KILL_AT": "sft:epoch-2-step-2-saved"}, check=False)
    assert killed.returncode == -9
    assert [f.name for f in (tmp_path / "sft.progress").iterdir()] == ["epoch-0001-step-000002"]
    resumed = rlctl(*args, "--out", tmp_path / "sft")
    assert "resuming sft 2 steps into epoch 2" in resumed.stderr
    assert (tmp_path / "sft" / "model.safetensors").read_bytes() == (tmp_path / "whole" / "model.safetensors").read_bytes()
    got, want = (json.loads((tmp_path / name / "_manifest.json").read_text())["state"] for name in ("sft", "whole"))
    assert comparable(got["epochs"]) == comparable(want["epochs"]) and got["optimizer_steps"] == want["optimizer_steps"] == 6


def test_sft_on_a_score_stages_output_trains_on_each_prompts_best_samples_over_the_bar(cli, tmp_path, tiny_model, prompts_file):
    """Rejection-sampling fine-tuning out of the stage commands: rollout → score → sft keeps
    each prompt's best sample at or above sft.min_reward, its sampled tokens the response."""
    from rlctl import shards

    assert cli("rollout", "--prompts", prompts_file, "--model", tiny_model, "--out", tmp_path / "r", "--n", "4", "--max-new-tokens", "8").exit_code == 0
    assert cli("score", "--rollouts", tmp_path / "r", "--out", tmp_path / "s", "--reward", "builtin:length").exit_code == 0
    rows = shards.read(str(tmp_path / "s")).table.to_pylist()
    bar = sorted(r["reward"] for r in rows)[len(rows) // 2]  # the median: some prompts' best over it, maybe not all
    best = {}
    for row in rows:
        if row["reward"] >= bar and row["reward"] > best.get(row["id"], {"reward": -1.0})["reward"]:
            best[row["id"]] = row
    result = cli("sft", "--data", tmp_path / "s", "--model", tiny_model, "--out", tmp_path / "out", "--epochs", "1", "--lr", "1e-3", "--set", f"sft.min_reward={bar}")
    assert result.exit_code == 0, result.stderr
    state = json.loads((tmp_path / "out" / "_manifest.json").read_text())["state"]
    assert state["examples"] == len(best) and state["response_tokens"] == sum(len(r["response_ids"]) for r in best.values())
    none = cli("sft", "--data", tmp_path / "s", "--model", tiny_model, "--out", tmp_path / "none", "--set", "sft.min_reward=1000")
    assert none.exit_code == 2 and "no sample is rewarded 1000 or more" in one_line_error(none)
    assert_not_written(tmp_path / "none")
