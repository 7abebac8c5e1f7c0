"""`rlctl dpo` from the command line: a committed checkpoint that a pipeline starts from, rerun
skipped; bad input is one line and nothing written."""

import json
from pathlib import Path

import pytest

from rlctl import shards
from rlctl.checkpoint import is_intact
from tests.conftest import assert_not_written, one_line_error

PAIRS = [{"id": f"p{i}", "prompt": f"Type a number: {i}", "chosen": f"{7 * i + 3}", "rejected": "no idea" if i % 2 else "maybe"} for i in range(8)]


@pytest.fixture
def pairs(tmp_path) -> Path:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
    return path


def test_dpo_writes_a_checkpoint_with_its_epochs_and_a_rerun_is_skipped(cli, tmp_path, tiny_model, pairs):
    args = ("dpo", "--data", pairs, "--val-data", pairs, "--model", tiny_model, "--out", tmp_path / "dpo", "--epochs", "2", "--lr", "1e-3", "--batch-size", "4", "--beta", "0.2")
    result = cli(*args)
    assert result.exit_code == 0, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith("dpo: epoch 0  val_loss 0.6931") and lines[2].startswith("dpo: epoch 2  loss") and "dpo: wrote" in lines[-1]
    assert is_intact(str(tmp_path / "dpo")) is None and not (tmp_path / "dpo" / "trainer_state").exists()
    manifest = json.loads((tmp_path / "dpo" / "_manifest.json").read_text())
    assert manifest["stage"] == "dpo" and manifest["config"]["dpo"]["beta"] == 0.2 and manifest["state"]["optimizer_steps"] == 4
    assert manifest["metrics"]["val_loss"] < 0.6931
    assert "skipped" in cli(*args).stderr
    shown = cli("show", tmp_path / "dpo")
    assert shown.exit_code == 0 and "dpo" in shown.stdout


@pytest.mark.parametrize(
    ("rows", "args", "fragment"),
    [
        ([{"prompt": "a", "chosen": "b"}], [], "need 'chosen' and 'rejected' columns"),
        ([{"prompt": "a", "chosen": "b", "rejected": None}], [], "row 0 has no rejected response"),
        ([{"prompt": "a", "chosen": "b", "rejected": "c " * 40}], ["--set", "dpo.max_tokens=20"], "the rejected response of pair '0' has"),
        ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--beta", "0"], "dpo.beta must be > 0"),
        ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--set", "dpo.label_smoothing=0.5"], "dpo.label_smoothing must be at least 0 and below 0.5"),
        ([{"prompt": "a", "chosen": "", "rejected": "c"}], [], "the chosen response of pair '0' has an empty response"),
        ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--loss", "kto"], "dpo.loss must be losses from sigmoid, robust"),
        ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--loss", "sigmoid,kto"], "comma-separated (an unknown 'kto')"),
        ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--loss", "sigmoid,sigmoid"], "dpo.loss names a loss twice ('sigmoid,sigmoid')"),
        ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--loss", "simpo,sigmoid"], "simpo and orpo have no reference and stand alone"),
        ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--loss", "sigmoid,bco_pair", "--set", "dpo.loss_weights=[0.8]"], "dpo.loss_weights gives 1 weight(s) for the 2 loss(es)"),
        ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--loss", "ipo", "--set", "dpo.label_smoothing=0.1"], "dpo.label_smoothing applies to the sigmoid, robust, simpo, exo_pair and aot losses"),
        ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--loss", "aot", "--set", "dpo.use_weighting=true"], "dpo.use_weighting weighs each pair's loss, and dpo.loss = 'aot' pairs margins by rank"),
        ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--loss", "orpo", "--set", "dpo.sft_weight=1"], "dpo.sft_weight adds the chosen responses' NLL, which dpo.loss = \"orpo\" has already"),
        ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--set", "dpo.sft_weight=-1"], "dpo.sft_weight must be ≥ 0"),
        ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--loss", "exo_pair"], "dpo.loss = \"exo_pair\" needs dpo.label_smoothing > 0"),
        ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--loss", "discopop", "--set", "dpo.discopop_tau=0"], "dpo.discopop_tau must be > 0"),
        ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--set", "dpo.reference_free=true", "--set", "dpo.ref_sync_every=8"], "dpo.ref_sync_every moves the reference, which dpo.reference_free leaves out"),
        ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--loss", "simpo", "--set", "dpo.ld_alpha=0.5"], "dpo.ld_alpha weighs the log-ratios of DPO's losses against a reference"),
        ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--loss", "nca_pair", "--set", "dpo.f_divergence=js_divergence"], "dpo.f_divergence = 'js_divergence' applies to the losses on the chosen-rejected difference"),
        ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--set", "dpo.ref_sync_every=4", "--set", "dpo.ref_sync_alpha=0"], "dpo.ref_sync_alpha must be in (0, 1], got 0"),
        ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--loss", "simpo", "--set", "dpo.ref_sync_every=4"], "dpo.ref_sync_every moves the reference, which dpo.loss = 'simpo' has none of"),
        ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--set", "dpo.ref_sync_every=4", "--set", "dpo.ref_sync_alpha=0.6", "--set", "dpo.lora.r=4"], "a LoRA run trains its adapters only"),
    ],
)
def test_bad_input_is_one_line_and_nothing_written(cli, tmp_path, tiny_model, rows, args, fragment):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = cli("dpo", "--data", data, "--model", tiny_model, "--out", tmp_path / "out", *args)
    assert result.exit_code == 2, result.stderr
    assert fragment in one_line_error(result)
    assert_not_written(tmp_path / "out")


def test_eval_measures_a_trained_policy_against_the_reference_it_started_from_over_all_and_per_data_source(cli, tmp_path, tiny_model, pairs):
    trained = cli("dpo", "--data", pairs, "--val-data", pairs, "--model", tiny_model, "--out", tmp_path / "dpo", "--epochs", "2", "--lr", "1e-3", "--batch-size", "4")
    assert trained.exit_code == 0, trained.stderr
    manifest = json.loads((tmp_path / "dpo" / "_manifest.json").read_text())
    assert manifest["state"]["reference"] == str(tiny_model)
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({**r, "data_source": "odd" if i % 2 else "even"}) + "\n" for i, r in enumerate(PAIRS)))
    result = cli("dpo", "--eval", "--data", held, "--model", tmp_path / "dpo", "--json")
    assert result.exit_code == 0, result.stderr
    every, *per_source = json.loads(result.stdout)["rows"]
    # the same pairs against the recorded reference: the trained policy's own held-out figures
    assert every["source"] == "all" and every["pairs"] == 8 and every["accuracy"] == manifest["metrics"]["val_accuracy"]
    assert abs(every["loss"] - manifest["metrics"]["val_loss"]) < 1e-5 and abs(every["margin"] - (every["chosen_reward"] - every["rejected_reward"])) < 1e-9
    assert [(r["source"], r["pairs"]) for r in per_source] == [("even", 4), ("odd", 4)]
    named = json.loads(cli("dpo", "--eval", "--data", held, "--model", tmp_path / "dpo", "--ref", tiny_model, "--json").stdout)["rows"][0]
    assert named == every
    start = json.loads(cli("dpo", "--eval", "--data", held, "--model", tiny_model, "--ref", tiny_model, "--json").stdout)["rows"][0]
    assert abs(start["loss"] - 0.6931) < 1e-4 and start["accuracy"] == 0.0  # a policy against itself: h = 0
    simpo = cli("dpo", "--eval", "--data", held, "--model", tiny_model, "--loss", "simpo")  # no reference to name
    assert simpo.exit_code == 0 and "chosen_reward" in simpo.stdout and "odd" in simpo.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dpo", "held.jsonl", "pairs.jsonl"]  # nothing written


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--eval", "--model", "{tiny_model}"], "is not a checkpoint rlctl dpo wrote, so its reference is unknown: give it as --ref"),
        (["--eval", "--model", "{tiny_model}", "--ref", "{tiny_model}", "--out", "{tmp_path}/out"], "--eval trains nothing and writes nothing"),
        (["--model", "{tiny_model}", "--ref", "{tiny_model}", "--out", "{tmp_path}/out"], "dpo --ref names the reference of --eval"),
        (["--model", "{tiny_model}"], "dpo needs --out"),
    ],
)
def test_eval_without_a_known_reference_or_a_write_asked_of_eval_is_one_line(cli, tmp_path, tiny_model, pairs, args, fragment):
    result = cli("dpo", "--data", pairs, *(a.format(tiny_model=tiny_model, tmp_path=tmp_path) for a in args))
    assert result.exit_code == 2 and fragment in one_line_error(result), result.stderr
    assert_not_written(tmp_path / "out")


def test_dpo_into_its_own_model_folder_is_refused(cli, tmp_path, tiny_model, pairs):
    result = cli("dpo", "--data", pairs, "--model", tiny_model, "--out", tiny_model)
    assert result.exit_code == 2 and "is the --model folder" in one_line_error(result)


def test_a_pipeline_with_sft_and_dpo_data_warm_starts_sft_then_dpo_once_and_starts_rl_from_dpos_weights(cli, tmp_path, tiny_model, pairs):
    """The RLHF order: SFT, then DPO from SFT's weights, then RL from DPO's (its reference
    too, with model.ref = "policy"); each trained once, kept on resume, and the first
    iteration replays."""
    from tests.e2e.test_pipeline import write_config
    from tests.e2e.test_sft import EXAMPLES

    examples = tmp_path / "sft.jsonl"
    examples.write_text("".join(json.dumps(r) + "\n" for r in EXAMPLES))
    config = write_config(
        tmp_path, tiny_model, model={"critic": "", "ref": "policy"}, advantage={"estimator": "grpo", "kl_coef": 0.0},
        sft={"data": str(examples), "epochs": 1, "lr": 1e-3, "batch_size": 4},
        dpo={"data": str(pairs), "val_data": str(pairs), "epochs": 2, "lr": 1e-3, "batch_size": 4, "loss": "ipo", "beta": 0.5},
        update={"use_kl_loss": True}, pipeline={"iterations": 1, "val_every": 0},
    )
    run = tmp_path / "run"
    plan = cli("pipeline", config, "--run-dir", run, "--dry-run")
    assert plan.exit_code == 0, plan.stderr
    assert f"warm start    {run / 'sft'}" in plan.stdout and f"warm start    {run / 'dpo'}: {run / 'sft'} trained on the pairs" in plan.stdout
    assert f"reference     {run / 'dpo'}" in plan.stdout
    first = cli("pipeline", config, "--run-dir", run, "--quiet")
    assert first.exit_code == 0, first.stderr
    dpo_manifest = (run / "dpo" / "_manifest.json").read_bytes()
    trained = json.loads(dpo_manifest)
    assert trained["stage"] == "dpo" and trained["config"]["dpo"]["loss"] == "ipo" and trained["state"]["optimizer_steps"] == 4
    assert str(run / "sft") in [i["uri"] for i in trained["inputs"]]  # DPO started from SFT's weights
    assert trained["state"]["epochs"][-1]["val_loss"] < trained["state"]["epochs"][0]["val_loss"] == pytest.approx(1.0, abs=1e-6)  # IPO: 1/(4β²) at the start
    rollout = json.loads((run / "iter-0001" / "rollout" / "_manifest.json").read_text())
    assert rollout["state"]["weights_source"] == str(run / "dpo")
    replayed = cli("replay", run / "iter-0001" / "rollout", "--check")
    assert replayed.exit_code == 0 and "identical" in replayed.stdout, (replayed.stdout, replayed.stderr)
    more = cli("pipeline", config, "--run-dir", run, "--quiet", "--iterations", "2")
    assert more.exit_code == 0, more.stderr
    assert (run / "dpo" / "_manifest.json").read_bytes() == dpo_manifest  # resumed: no second DPO


@pytest.mark.parametrize("command", ["dpo", "kto", "reward-model"])
def test_a_score_stages_output_trains_on_each_prompts_best_and_worst_sample(cli, tmp_path, tiny_model, prompts_file, command):
    """Online DPO out of the stage commands: rollout → score → dpo (or kto, or a reward model
    learning the scores) on the scores, each prompt whose samples' rewards differ one pair; none
    over min_reward_gap is one line."""
    assert cli("rollout", "--prompts", prompts_file, "--model", tiny_model, "--out", tmp_path / "r", "--n", "4", "--max-new-tokens", "8").exit_code == 0
    assert cli("score", "--rollouts", tmp_path / "r", "--out", tmp_path / "s", "--reward", "builtin:length").exit_code == 0
    table = shards.read(str(tmp_path / "s")).table
    rewards: dict[str, set] = {}
    for row in table.to_pylist():
        rewards.setdefault(row["id"], set()).add(row["reward"])
    differing = sum(len(values) > 1 for values in rewards.values())
    assert differing >= 2
    result = cli(command, "--data", tmp_path / "s", "--val-data", tmp_path / "s", "--model", tiny_model, "--out", tmp_path / "out", "--epochs", "1", "--lr", "1e-3", "--batch-size", "2")
    assert result.exit_code == 0, result.stderr
    state = json.loads((tmp_path / "out" / "_manifest.json").read_text())["state"]
    assert state["examples" if command == "kto" else "pairs"] == differing * (2 if command == "kto" else 1)
    section = command.replace("-", "_")
    gap = cli(command, "--data", tmp_path / "s", "--model", tiny_model, "--out", tmp_path / "none", "--set", f"{section}.min_reward_gap=100")
    assert gap.exit_code == 2 and "no prompt's samples differ in reward by more than 100" in one_line_error(gap)
    assert_not_written(tmp_path / "none")


@pytest.mark.slow
def test_a_dpo_killed_after_an_epoch_resumes_with_the_starting_weights_reference_to_the_uninterrupted_result(tmp_path, tiny_model, pairs):
    """The epoch checkpoint keeps the reference's log-probabilities: the weights it holds are
    no longer the reference."""
    from tests.e2e.test_pipeline import rlctl
    from tests.e2e.test_sft import comparable

    args = ["dpo", "--data", pairs, "--val-data", pairs, "--model", tiny_model, "--epochs", "3", "--lr", "1e-3", "--batch-size", "4"]
    rlctl(*args, "--out", tmp_path / "whole")
    assert rlctl(*args, "--out", tmp_path / "dpo", env={"RLCTL_FAULT_KILL_AT": "dpo:epoch-2-saved"}, check=False).returncode == -9
    assert [f.name for f in (tmp_path / "dpo.progress").iterdir()] == ["epoch-0002"]  # the one before removed once it was committed
    resumed = rlctl(*args, "--out", tmp_path / "dpo")
    assert "resuming dpo after epoch 2" in resumed.stderr and not (tmp_path / "dpo.progress").exists()
    assert (tmp_path / "dpo" / "model.safetensors").read_bytes() == (tmp_path / "whole" / "model.safetensors").read_bytes()
    got, want = (json.loads((tmp_path / name / "_manifest.json").read_text())["state"]["epochs"] for name in ("dpo", "whole"))
    assert comparable(got) == comparable(want) and len(got) == 4


@pytest.mark.parametrize(("alpha", "words"), [(1.0, "the reference reset to the policy every 8 steps"), (0.6, "the reference moved 0.6 of the way to the policy every 8 steps")])
@pytest.mark.parametrize(("section", "trained"), [("dpo", "the pairs {data} (DPO, sigmoid loss, beta 0.1"), ("kto", "the labelled examples {data} (KTO, beta 0.1")])
def test_the_plan_says_how_a_preference_warm_starts_reference_moves(cli, tmp_path, tiny_model, pairs, alpha, words, section, trained):
    from tests.e2e.test_pipeline import write_config

    config = write_config(
        tmp_path, tiny_model, model={"critic": ""}, advantage={"estimator": "grpo"}, pipeline={"iterations": 1},
        **{section: {"data": str(pairs), "ref_sync_every": 8, "ref_sync_alpha": alpha}},
    )
    plan = cli("pipeline", config, "--run-dir", tmp_path / "run", "--dry-run")
    assert plan.exit_code == 0, plan.stderr
    assert f"trained on {trained.format(data=pairs)}, {words}), 1 epoch(s)" in plan.stdout
