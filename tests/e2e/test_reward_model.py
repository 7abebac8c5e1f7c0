"""`rlctl reward-model` from the command line: a committed reward model that `rm:` scores with,
in a stage command and in a pipeline that trains it before iteration 1 (`rm:trained`); rerun
and resume keep it; bad input is one line and nothing written."""

import json
from pathlib import Path

import pytest

from rlctl.checkpoint import is_intact
from tests.conftest import assert_not_written, one_line_error
from tests.e2e.test_pipeline import write_config

PAIRS = [{"id": f"p{i}", "prompt": f"Type a number: {i}", "chosen": f"{7 * i + 3}", "rejected": "no idea" if i % 2 else "maybe"} for i in range(8)]


@pytest.fixture
def pairs(tmp_path) -> Path:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
    return path


def test_reward_model_writes_a_folder_that_score_rewards_with(cli, tmp_path, tiny_model, pairs):
    args = ("reward-model", "--data", pairs, "--val-data", pairs, "--model", tiny_model, "--out", tmp_path / "rm", "--epochs", "3", "--lr", "1e-3", "--batch-size", "4")
    result = cli(*args)
    assert result.exit_code == 0, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith("reward-model: epoch 0  val_loss") and lines[3].startswith("reward-model: epoch 3  loss") and "reward-model: wrote" in lines[-1]
    assert is_intact(str(tmp_path / "rm")) is None
    manifest = json.loads((tmp_path / "rm" / "_manifest.json").read_text())
    assert manifest["stage"] == "reward-model" and manifest["state"]["optimizer_steps"] == 6 and manifest["metrics"]["val_accuracy"] == 1.0
    assert "skipped" in cli(*args).stderr
    shown = cli("show", tmp_path / "rm")
    assert shown.exit_code == 0 and "reward-model" in shown.stdout and "val_accuracy" in shown.stdout

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": r["id"], "prompt": r["prompt"]}) + "\n" for r in PAIRS[:2]))
    rollout = cli("rollout", "--prompts", prompts, "--model", tiny_model, "--out", tmp_path / "rollout", "--n", "2", "--max-new-tokens", "4")
    assert rollout.exit_code == 0, rollout.stderr
    scored = cli("score", "--rollouts", tmp_path / "rollout", "--reward", f"rm:{tmp_path / 'rm'}", "--out", tmp_path / "score")
    assert scored.exit_code == 0, scored.stderr
    score = json.loads((tmp_path / "score" / "_manifest.json").read_text())
    assert score["config"]["score"]["reward"] == f"rm:{tmp_path / 'rm'}" and str(tmp_path / "rm") in [i["uri"] for i in score["inputs"]]
    retrained = cli(*args[:-1], "2", "--force")  # another reward model in the same folder: the score is stale, not up to date
    assert retrained.exit_code == 0, retrained.stderr
    again = cli("score", "--rollouts", tmp_path / "rollout", "--reward", f"rm:{tmp_path / 'rm'}", "--out", tmp_path / "score")
    assert again.exit_code == 0 and "skipped" not in again.stderr


@pytest.mark.parametrize(
    ("rows", "args", "fragment"),
    [
        ([{"prompt": "a", "chosen": "b"}], [], "need 'chosen' and 'rejected' columns"),
        ([{"prompt": "a", "chosen": "b", "rejected": None}], [], "row 0 has no rejected response"),
        ([{"prompt": "a", "chosen": "b " * 40, "rejected": "c"}], ["--set", "reward_model.max_tokens=20"], "over 20 (reward_model.max_tokens)"),
        ([{"prompt": "a", "chosen": "b " * 40, "rejected": "c"}], ["--set", "reward_model.max_tokens=20", "--set", "reward_model.too_long=drop"], "every pair is over 20 tokens"),
        ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--set", "reward_model.too_long=cut"], "reward_model.too_long must be one of error, drop"),
        ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--epochs", "0"], "reward_model.epochs must be ≥ 1"),
        ([{"prompt": "a", "chosen": "b", "rejected": "c", "margin": "lots"}], [], "pair '0' has a margin that is not a finite number: 'lots'"),
    ],
)
def test_bad_input_is_one_line_and_nothing_written(cli, tmp_path, tiny_model, rows, args, fragment):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = cli("reward-model", "--data", data, "--model", tiny_model, "--out", tmp_path / "out", *args)
    assert result.exit_code == 2, result.stderr
    assert fragment in one_line_error(result)
    assert_not_written(tmp_path / "out")


def test_eval_measures_a_reward_model_on_held_out_pairs_over_all_and_per_data_source(cli, tmp_path, tiny_model, pairs):
    trained = cli("reward-model", "--data", pairs, "--val-data", pairs, "--model", tiny_model, "--out", tmp_path / "rm", "--epochs", "3", "--lr", "1e-3", "--batch-size", "4")
    assert trained.exit_code == 0, trained.stderr
    metrics = json.loads((tmp_path / "rm" / "_manifest.json").read_text())["metrics"]
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({**r, "data_source": "odd" if i % 2 else "even"}) + "\n" for i, r in enumerate(PAIRS)))
    result = cli("reward-model", "--eval", "--data", held, "--model", tmp_path / "rm", "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    every, *per_source = summary["rows"]
    # the same pairs, read as training read them: the trained model's own held-out figures
    assert every["source"] == "all" and every["pairs"] == 8 and summary["dropped"] == 0
    assert every["accuracy"] == metrics["val_accuracy"] and abs(every["loss"] - metrics["val_loss"]) < 1e-5
    assert [(r["source"], r["pairs"]) for r in per_source] == [("even", 4), ("odd", 4)]
    assert abs(sum(r["margin"] for r in per_source) / 2 - every["margin"]) < 1e-5
    table = cli("reward-model", "--eval", "--data", held, "--model", tmp_path / "rm")
    assert table.exit_code == 0 and "data_source" in table.stdout and "odd" in table.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["held.jsonl", "pairs.jsonl", "rm"]  # nothing written


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--eval", "--model", "{tiny_model}"], "not a trained reward model"),
        (["--eval", "--model", "{tiny_model}", "--out", "{tmp_path}/out"], "--eval trains nothing and writes nothing"),
        (["--model", "{tiny_model}"], "reward-model needs --out"),
    ],
)
def test_eval_of_a_model_without_a_trained_head_or_a_write_asked_of_eval_is_one_line(cli, tmp_path, tiny_model, pairs, args, fragment):
    result = cli("reward-model", "--data", pairs, *(a.format(tiny_model=tiny_model, tmp_path=tmp_path) for a in args))
    assert result.exit_code == 2 and fragment in one_line_error(result), result.stderr
    assert_not_written(tmp_path / "out")


def test_a_reward_model_into_its_own_base_folder_is_refused(cli, tmp_path, tiny_model, pairs):
    result = cli("reward-model", "--data", pairs, "--model", tiny_model, "--out", tiny_model)
    assert result.exit_code == 2 and "is the --model folder" in one_line_error(result)


def test_a_pipeline_trains_its_reward_model_once_scores_with_it_and_replays_its_score(cli, tmp_path, tiny_model, pairs):
    config = write_config(
        tmp_path, tiny_model, model={"critic": "", "ref": ""}, advantage={"estimator": "grpo", "kl_coef": 0.0},
        reward_model={"data": str(pairs), "val_data": str(pairs), "epochs": 2, "lr": 1e-3, "batch_size": 4},
        score={"reward": "rm:trained"}, pipeline={"iterations": 1, "val_every": 1},
    )
    trained = tmp_path / "run" / "reward_model"
    plan = cli("pipeline", config, "--run-dir", tmp_path / "run", "--dry-run")
    assert plan.exit_code == 0, plan.stderr
    assert f"reward model  {trained}: trained on {pairs} from {tiny_model}" in plan.stdout and f"reward        rm:{trained}" in plan.stdout
    assert not trained.exists()
    first = cli("pipeline", config, "--run-dir", tmp_path / "run", "--quiet")
    assert first.exit_code == 0, first.stderr
    rm_manifest = (trained / "_manifest.json").read_bytes()
    assert json.loads(rm_manifest)["state"]["optimizer_steps"] == 4 and is_intact(str(trained)) is None
    score = json.loads((tmp_path / "run" / "iter-0001" / "score" / "_manifest.json").read_text())
    assert score["config"]["reward"] == f"rm:{trained}"
    replayed = cli("replay", tmp_path / "run" / "iter-0001" / "score", "--check")
    assert replayed.exit_code == 0 and "identical" in replayed.stdout, replayed.stdout + replayed.stderr
    more = cli("pipeline", config, "--run-dir", tmp_path / "run", "--quiet", "--iterations", "2")
    assert more.exit_code == 0, more.stderr
    assert (trained / "_manifest.json").read_bytes() == rm_manifest  # resumed: no second training


@pytest.mark.slow
def test_a_pipeline_on_ray_workers_trains_its_reward_model_on_them_then_scores_with_it(cli, tmp_path, tiny_model, pairs):
    config = write_config(
        tmp_path, tiny_model, model={"critic": "", "ref": ""}, advantage={"estimator": "grpo", "kl_coef": 0.0},
        reward_model={"data": str(pairs), "epochs": 2, "lr": 1e-3, "batch_size": 4}, score={"reward": "rm:trained"}, pipeline={"iterations": 1, "val_every": 0},
    )
    result = cli("pipeline", config, "--run-dir", tmp_path / "run", "--quiet", "--workers-backend", "ray", "--workers", "2")
    assert result.exit_code == 0, result.stderr
    manifest = json.loads((tmp_path / "run" / "reward_model" / "_manifest.json").read_text())
    assert manifest["state"]["workers"]["num_workers"] == 2 and manifest["state"]["optimizer_steps"] == 4
    assert is_intact(str(tmp_path / "run" / "reward_model")) is None
    assert (tmp_path / "run" / "iter-0001" / "score" / "_manifest.json").exists()


@pytest.mark.parametrize(
    ("sections", "fragment"),
    [
        ({"score": {"reward": "rm:trained"}}, "rm:trained is the reward model the run trains on reward_model.data, which is not set"),
        ({"reward_model": {"data": "pairs.jsonl"}}, "reward_model.data trains a reward model that no reward uses"),
    ],
)
def test_a_reward_model_the_run_would_not_train_or_not_use_is_refused_before_any_work(cli, tmp_path, tiny_model, sections, fragment):
    config = write_config(tmp_path, tiny_model, **sections)
    result = cli("pipeline", config, "--run-dir", tmp_path / "run")
    assert result.exit_code == 2 and fragment in one_line_error(result)
    assert not (tmp_path / "run").exists()


def test_an_rm_path_in_a_config_file_is_relative_to_the_file(tmp_path):
    from rlctl.config import load_config, paths_relative_to

    cfg = paths_relative_to(load_config(None, ["score.reward=rm:models/rm"]), tmp_path)
    assert cfg.score.reward == f"rm:{tmp_path / 'models' / 'rm'}"
    kept = paths_relative_to(load_config(None, ["score.reward=rm:trained"]), tmp_path)
    assert kept.score.reward == "rm:trained"


@pytest.mark.slow
@pytest.mark.parametrize("lora", [0, 4])
def test_a_reward_model_killed_after_an_epoch_resumes_from_its_epoch_checkpoint_to_the_uninterrupted_result(tmp_path, tiny_model, pairs, lora):
    """A LoRA reward model's epoch checkpoint holds its adapters and head as trained (the output
    holds them merged): the run goes on training them."""
    from tests.e2e.test_pipeline import rlctl
    from tests.e2e.test_sft import comparable

    args = ["reward-model", "--data", pairs, "--val-data", pairs, "--model", tiny_model, "--epochs", "3", "--lr", "1e-3", "--batch-size", "4", "--set", f"reward_model.lora.r={lora}"]
    rlctl(*args, "--out", tmp_path / "whole")
    assert rlctl(*args, "--out", tmp_path / "rm", env={"RLCTL_FAULT_KILL_AT": "rm:epoch-1-saved"}, check=False).returncode == -9
    assert (tmp_path / "rm.progress" / "epoch-0001" / ("adapter_model.safetensors" if lora else "model.safetensors")).exists()
    resumed = rlctl(*args, "--out", tmp_path / "rm")
    assert "resuming reward-model after epoch 1" in resumed.stderr and not (tmp_path / "rm.progress").exists()
    assert (tmp_path / "rm" / "model.safetensors").read_bytes() == (tmp_path / "whole" / "model.safetensors").read_bytes()
    got, want = (json.loads((tmp_path / name / "_manifest.json").read_text())["state"]["epochs"] for name in ("rm", "whole"))
    assert comparable(got) == comparable(want) and len(got) == 4
