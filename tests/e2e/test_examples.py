"""The shipped examples run as a user would run them."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlctl import shards

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_stages_script_runs_two_iterations_and_the_pipe(tmp_path):
    env = {**os.environ, "WORK": str(tmp_path / "work")}
    result = subprocess.run(["bash", "examples/stages.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    work = tmp_path / "work"
    for it in (1, 2):
        for stage in ("rollout", "score", "advantage", "update", "weights"):
            assert (work / f"iter-{it}" / stage / "_manifest.json").exists()
    assert shards.read(str(work / "iter-2" / "rollout")).table.column("policy_version").to_pylist()[0] == 1
    assert shards.read(str(work / "piped" / "advantage"), "batch").table.num_rows == 48


def run_example(config: str, tmp_path, *flags: str) -> list[dict]:
    import json

    result = subprocess.run(
        [sys.executable, "-m", "rlctl", "pipeline", f"examples/{config}", "--run-dir", str(tmp_path / "run"), "--quiet", *flags],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def learning_margin(rows: list[dict]) -> float:
    rewards = [r["reward_mean"] for r in rows]
    return sum(rewards[-3:]) / 3 - sum(rewards[:3]) / 3


@pytest.mark.slow
def test_grpo_example_learns_by_the_stated_margin(tmp_path):
    rows = run_example("grpo.toml", tmp_path)
    assert len(rows) == 30
    assert learning_margin(rows) >= 0.5  # the margin stated in examples/grpo.toml
    assert rows[0]["kl"] is None  # no reference model: the KL is not recorded (not 0), and plot says so
    assert rows[-1]["val/score"] > rows[9]["val/score"] - 1e-9


@pytest.mark.slow
def test_grpo_example_learns_on_two_ray_workers_as_it_does_locally(tmp_path):
    rows = run_example("grpo.toml", tmp_path, "--workers-backend", "ray", "--workers", "2")
    assert len(rows) == 30
    assert learning_margin(rows) >= 0.5  # the margin stated in examples/grpo.toml
    local = run_example("grpo.toml", tmp_path / "local", "--iterations", "3")
    # iteration 1: the same rows and the same update to the float; after an update, float noise
    # from other batch splits (2 ranks of 1 thread vs 1 process) can flip a sampled token
    assert rows[0]["reward_mean"] == local[0]["reward_mean"] and abs(rows[0]["pg_loss"] - local[0]["pg_loss"]) < 1e-5
    for ours, theirs in zip(rows[1:3], local[1:3]):
        assert abs(ours["reward_mean"] - theirs["reward_mean"]) < 1e-2 and abs(ours["pg_loss"] - theirs["pg_loss"]) < 1e-3


@pytest.mark.slow
def test_online_dpo_example_learns_by_the_stated_margin(tmp_path):
    rows = run_example("online_dpo.toml", tmp_path)
    assert len(rows) == 30
    assert learning_margin(rows) >= 0.5  # the margin stated in examples/online_dpo.toml
    assert all(row["dpo/pairs"] >= 1 for row in rows[:10])  # early on most prompts' samples differ
    assert rows[0]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-3)  # the policy is its reference at the start: h = 0


@pytest.mark.slow
def test_dr_grpo_example_learns_by_the_stated_margin(tmp_path):
    rows = run_example("drgrpo.toml", tmp_path)
    assert len(rows) == 30
    assert learning_margin(rows) >= 0.5  # the margin stated in examples/drgrpo.toml


@pytest.mark.slow
def test_tool_use_example_learns_to_call_its_tool_by_the_stated_margin(tmp_path):
    rows = run_example("tool_use.toml", tmp_path)
    assert len(rows) == 30
    assert learning_margin(rows) >= 0.5  # the margin stated in examples/tool_use.toml
    assert rows[-1]["tool_calls"] > rows[0]["tool_calls"] + 0.5  # it learned to call the calculator


@pytest.mark.slow
def test_dapo_example_learns_by_the_stated_margin(tmp_path):
    rows = run_example("dapo.toml", tmp_path)
    assert len(rows) == 30
    assert learning_margin(rows) >= 0.5  # the margin stated in examples/dapo.toml
    assert all(r["dynamic_sampling/groups_kept"] + r["dynamic_sampling/groups_filled"] == 8 for r in rows)


@pytest.mark.slow
def test_ppo_example_learns_by_the_stated_margin(tmp_path):
    rows = run_example("ppo.toml", tmp_path)
    assert len(rows) == 30
    assert learning_margin(rows) >= 0.10  # the margin stated in examples/ppo.toml
    assert rows[-1]["kl"] > 0 and rows[-1]["vf_loss"] is not None


@pytest.mark.slow
def test_seed_script_prints_step_reward_kl(tmp_path):
    result = subprocess.run(
        [sys.executable, "examples/seed/train_ppo.py", "pipeline.iterations=3", f"pipeline.run_dir={tmp_path / 'seed'}"],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert [line.split(",")[0] for line in lines] == ["Step 1", "Step 2", "Step 3"]
    assert all(", Reward: " in line and ", KL: " in line for line in lines)


@pytest.mark.slow
def test_makefile_runs_iterations_as_stage_commands(tmp_path):
    run = tmp_path / "make"
    result = subprocess.run(["make", "-C", "examples", "-j1", "ITER=2", f"RUN={run}"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (run / "iter-2" / "weights" / "_manifest.json").exists()
    again = subprocess.run(["make", "-C", "examples", "-j1", "ITER=2", f"RUN={run}"], cwd=ROOT, capture_output=True, text=True)
    assert "Nothing to be done" in again.stdout


@pytest.mark.slow
def test_sft_grpo_example_learns_from_its_warm_start_by_the_stated_margin(tmp_path):
    rows = run_example("sft_grpo.toml", tmp_path)
    trained = [r for r in rows if r["iteration"] > 0]
    assert rows[0]["iteration"] == 0 and len(trained) == 30
    assert rows[0]["val/score"] >= 0.05  # the warm start alone (0.16 measured; 0 without it)
    assert learning_margin(trained) >= 0.3  # the margin stated in examples/sft_grpo.toml
    assert rows[-1]["val/score"] > rows[0]["val/score"] + 0.2


@pytest.mark.slow
def test_rm_grpo_example_trains_a_reward_model_that_teaches_the_rule_it_never_saw(tmp_path):
    import json

    rows = run_example("rm_grpo.toml", tmp_path)
    trained = json.loads((tmp_path / "run" / "reward_model" / "_manifest.json").read_text())
    assert trained["metrics"]["val_accuracy"] > 0.85  # the held-out pairs (0.91 measured in fp32)
    shares = [r["reward_mean/digit_share"] for r in rows]  # the rule, weight 0: measured, never optimized
    assert len(rows) == 30 and sum(shares[-3:]) / 3 - sum(shares[:3]) / 3 >= 0.5  # the margin stated in examples/rm_grpo.toml


@pytest.mark.slow
@pytest.mark.parametrize("warm,val_before,first,last,trained_metric", [
    ("dpo", 0.15, 0.2, 0.6, "val_accuracy"),  # measured: 0.35 before, first three 0.45, last three 0.91; val_accuracy > 0.8
    ("kto", 0.4, 0.4, 0.8, "val_margin"),  # measured: 0.83 before, 0.91, 0.99; val_margin > 0
])
def test_a_preference_warm_start_example_starts_rl_from_its_weights_by_the_stated_margins(tmp_path, warm, val_before, first, last, trained_metric):
    """examples/dpo_grpo.toml and examples/kto_grpo.toml: the margins their headers state."""
    import json

    rows = run_example(f"{warm}_grpo.toml", tmp_path)
    trained = [r for r in rows if r["iteration"] > 0]
    assert rows[0]["iteration"] == 0 and len(trained) == 10
    assert rows[0]["val/score"] >= val_before  # the warm-started policy alone (the random model: ~0.01)
    rewards = [r["reward_mean"] for r in trained]
    assert sum(rewards[:3]) / 3 >= first and sum(rewards[-3:]) / 3 >= last
    manifest = json.loads((tmp_path / "run" / warm / "_manifest.json").read_text())
    assert manifest["stage"] == warm and manifest["metrics"][trained_metric] > (0.8 if trained_metric == "val_accuracy" else 0.0)


@pytest.mark.slow
def test_dpo_on_the_examples_digit_preferences_raises_the_digit_share_of_samples(tmp_path):
    """README: `rlctl dpo` on the pairs examples/rm_grpo.toml trains its reward model on, offline,
    then `rlctl eval` with the rule the pairs were made by."""
    import json

    def rlctl(*args) -> str:
        result = subprocess.run([sys.executable, "-m", "rlctl", *map(str, args)], cwd=ROOT, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-2000:]
        return result.stdout

    rlctl("model", "init", tmp_path / "tiny", "--preset", "tiny")
    rlctl(
        "dpo", "--data", "examples/digit_prefs.jsonl", "--val-data", "examples/digit_prefs_val.jsonl", "--model", tmp_path / "tiny", "--out", tmp_path / "dpo",
        "--epochs", "2", "--lr", "1e-3",
    )

    def digit_share(model) -> float:
        rows = json.loads(rlctl(
            "eval", "--model", model, "--prompts", "examples/digits_val.jsonl", "--reward", "examples/rewards.py:digit_share", "--n", "8", "--max-new-tokens", "16", "--json",
        ))
        return rows[0]["mean"]

    before, after = digit_share(tmp_path / "tiny"), digit_share(tmp_path / "dpo")
    assert before < 0.05 and after - before >= 0.2  # 0.008 → 0.35 measured in fp32


@pytest.mark.slow
def test_iterative_dpo_script_raises_the_digit_share_round_by_round(tmp_path):
    """examples/iterative_dpo.sh: rollout → score → dpo on the scores, four rounds, each from the
    last round's policy; the sampled digit share grows and the held-out one ends well above
    the random model's."""
    import json

    env = {**os.environ, "WORK": str(tmp_path / "work")}
    result = subprocess.run(["bash", "examples/iterative_dpo.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    rounds = [shards.read(str(tmp_path / "work" / f"round-{r}" / "score")).table.column("reward").to_numpy().mean() for r in range(1, 5)]
    assert rounds[0] < 0.05 and rounds[-1] > 2 * rounds[0]  # 0.009 → 0.116 measured in fp32
    evaluated = subprocess.run(
        [sys.executable, "-m", "rlctl", "eval", "--model", str(tmp_path / "work" / "round-4" / "policy"), "--prompts", "examples/digits_val.jsonl",
         "--reward", "examples/rewards.py:digit_share", "--n", "8", "--max-new-tokens", "16", "--json"],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert json.loads(evaluated.stdout)[0]["mean"] >= 0.1  # 0.27 measured; the random model: 0.008
