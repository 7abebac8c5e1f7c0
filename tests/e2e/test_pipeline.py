"""The controller: resume after SIGKILL is bit-identical, replay reproduces every stage, each
model is loaded once, bad configs fail before any work."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rlctl import mkl_kernels, shards
from rlctl.config import load_config
from rlctl.passes import CPU_MICRO_BATCH_TOKENS
from rlctl.pipeline import Pipeline
from rlctl.threads import ThreadGovernor, available_cpus
from tests.conftest import metrics_without_timings, one_line_error

PROMPTS = [{"id": f"p{i}", "prompt": f"Question {i}: what is {i} + {i}?", "data_source": "even" if i % 2 else "odd"} for i in range(5)]


def write_config(tmp_path, tiny_model, **sections) -> Path:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    base = {
        "model": {"path": tiny_model, "ref": tiny_model, "critic": tiny_model},
        "data": {"prompts": str(prompts), "batch_size": 3, "val_prompts": str(prompts)},
        "rollout": {"n": 2, "max_new_tokens": 6},
        "score": {"reward": "builtin:length"},
        "advantage": {"estimator": "gae", "gamma": 0.99, "lam": 0.95, "kl_coef": 0.05, "kl_controller": "adaptive", "kl_target": 0.01, "kl_horizon": 50},
        "update": {"lr": 1e-3, "critic_lr": 1e-3, "mini_batch_size": 3, "micro_batch_size": 2, "epochs": 2},
        "pipeline": {"iterations": 4, "save_every": 1, "keep_checkpoints": 0, "val_every": 2},
        "workers": {"threads": available_cpus()},  # runs are compared bit for bit: one thread count, however busy the machine
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    lines = []
    for name, values in base.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path = tmp_path / "run.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def rlctl(*args, env=None, check=True):
    result = subprocess.run([sys.executable, "-m", "rlctl", *map(str, args)], capture_output=True, text=True, env={**os.environ, **(env or {})})
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    checkpoint = sorted((run_dir / "checkpoints").glob("iter-*"))[-1]
    weights = load_file(str(checkpoint / "model.safetensors"))
    weights.update({f"critic.{k}": v for k, v in load_file(str(checkpoint / "critic" / "value_head.safetensors")).items()})
    return weights


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("reference")
    config = write_config(tmp, tiny_model)
    result = rlctl("pipeline", config, "--run-dir", tmp / "run", "--quiet")
    (tmp / "stderr.txt").write_text(result.stderr)
    return config, tmp / "run"


KILL_POINTS = [
    "iter-0002/rollout:before-commit",  # outputs written, manifest not yet
    "iter-0002/score:part-00000.arrow",  # mid-write: a part on disk, uncommitted
    "iter-0003:after-update",  # trained in memory, not checkpointed
    "checkpoints/iter-0002:before-commit",  # checkpoint files written, uncommitted
    "iter-0001:after-checkpoint",  # checkpoint committed, metrics.jsonl not yet updated
]


@pytest.mark.slow
@pytest.mark.parametrize("point", KILL_POINTS)
def test_sigkill_then_resume_is_bit_identical(cli, tmp_path, reference_run, point):
    config, reference = reference_run
    run = tmp_path / "run"
    killed = rlctl("pipeline", config, "--run-dir", run, "--quiet", env={"RLCTL_FAULT_KILL_AT": point}, check=False)
    assert killed.returncode == -9, killed.stderr[-2000:]
    before = torch.get_num_threads()
    torch.set_num_threads(1 if before > 1 else 2)  # what an earlier run in this process could have left behind
    try:
        assert cli("pipeline", config, "--run-dir", run, "--quiet").exit_code == 0  # in-process: no second start-up
        assert torch.get_num_threads() == (1 if before > 1 else 2)  # the run gave the process its count back
    finally:
        torch.set_num_threads(before)
    expected, got = final_weights(reference), final_weights(run)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert metrics_without_timings(run) == metrics_without_timings(reference)


@pytest.mark.slow
def test_killed_twice_with_sparse_checkpoints_still_bit_identical(cli, tmp_path, tiny_model):
    config = write_config(tmp_path, tiny_model, pipeline={"save_every": 3})
    rlctl("pipeline", config, "--run-dir", tmp_path / "ref", "--quiet")
    run = tmp_path / "run"
    for point in ("iter-0002/advantage:before-commit", "iter-0004/rollout:before-commit"):
        assert rlctl("pipeline", config, "--run-dir", run, "--quiet", env={"RLCTL_FAULT_KILL_AT": point}, check=False).returncode == -9
    assert cli("pipeline", config, "--run-dir", run, "--quiet").exit_code == 0
    expected, got = final_weights(tmp_path / "ref"), final_weights(run)
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_resume_skips_a_damaged_checkpoint_and_says_so(cli, tmp_path, reference_run):
    config, reference = reference_run
    run = tmp_path / "run"
    assert rlctl("pipeline", config, "--run-dir", run, "--quiet", env={"RLCTL_FAULT_KILL_AT": "iter-0003:after-checkpoint"}, check=False).returncode == -9
    flip_a_byte(run / "checkpoints" / "iter-0003" / "model.safetensors")
    resumed = cli("pipeline", config, "--run-dir", run, "--quiet")
    assert resumed.exit_code == 0, resumed.stderr
    assert "checkpoint" in resumed.stderr and "iter-0003 is damaged" in resumed.stderr
    assert "resuming from iter-0002: iter-0003 did not verify" in resumed.stderr
    expected, got = final_weights(reference), final_weights(run)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert metrics_without_timings(run) == metrics_without_timings(reference)


@pytest.mark.slow
def test_resume_recomputes_a_damaged_committed_stage_instead_of_training_on_it(cli, tmp_path, reference_run):
    config, reference = reference_run
    run = tmp_path / "run"
    assert rlctl("pipeline", config, "--run-dir", run, "--quiet", env={"RLCTL_FAULT_KILL_AT": "iter-0002/advantage:before-commit"}, check=False).returncode == -9
    manifest = json.loads((run / "iter-0002" / "score" / "_manifest.json").read_text())
    part = run / "iter-0002" / "score" / manifest["files"][0]["path"]
    part.write_bytes(part.read_bytes().replace(b"Question", b"Questi0n", 1))
    resumed = cli("pipeline", config, "--run-dir", run, "--quiet")
    assert resumed.exit_code == 0, resumed.stderr
    assert "iter-0002/score is committed but damaged" in resumed.stderr and "recomputing it" in resumed.stderr
    expected, got = final_weights(reference), final_weights(run)
    assert all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.mark.slow
def test_a_run_with_compiled_layers_resumes_bit_identical_and_replays_its_update(cli, tmp_path, tiny_model):
    """update.compile (the policy's and the critic's layers): a run stopped after two iterations
    and continued trains what an unbroken run trains, and its update replays identical."""
    config = write_config(tmp_path, tiny_model, update={"compile": True}, pipeline={"iterations": 3})
    rlctl("pipeline", config, "--run-dir", tmp_path / "straight", "--quiet")
    rlctl("pipeline", config, "--run-dir", tmp_path / "resumed", "--quiet", "--set", "pipeline.iterations=2")
    rlctl("pipeline", config, "--run-dir", tmp_path / "resumed", "--quiet")
    expected, got = final_weights(tmp_path / "straight"), final_weights(tmp_path / "resumed")
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    assert metrics_without_timings(tmp_path / "straight") == metrics_without_timings(tmp_path / "resumed")
    replayed = cli("replay", tmp_path / "straight" / "iter-0003" / "update", "--check")
    assert replayed.stdout.strip() == "identical", replayed.stdout + replayed.stderr
    eager = cli("replay", tmp_path / "straight" / "iter-0003" / "update", "--check", "--set", "update.compile=false")
    assert "recorded with compiled decoder layers, replayed with eager ones" in eager.stdout


def test_replay_check_is_identical_for_every_stage_at_the_thread_count_it_ran_at(cli, tmp_path, tiny_model, monkeypatch):
    config = write_config(tmp_path, tiny_model, pipeline={"iterations": 2, "val_every": 1, "val_n": 2, "val_temperature": 0.8}, workers={"threads": 0})
    monkeypatch.setattr(ThreadGovernor, "MIN_WINDOW", 0.0)
    monkeypatch.setattr("rlctl.threads.threads_for", lambda limit, others_busy: 1)  # other processes left one CPU free
    with Pipeline.from_config(config, [f"pipeline.run_dir={tmp_path / 'run'}"]) as pipeline:
        pipeline.run()
    monkeypatch.undo()  # the replays run on a quiet machine
    recorded = {s: shards.read_manifest(str(tmp_path / "run" / "iter-0002" / s))[0].state for s in ("rollout", "score", "advantage", "update")}
    assert {(state["torch_threads"], state["mkl_kernels"]) for state in recorded.values()} == {(1, mkl_kernels.recorded())}
    for i in (1, 2):
        for stage in ("prompts", "rollout", "score", "advantage", "update", "val"):
            result = cli("replay", tmp_path / "run" / f"iter-{i:04d}" / stage, "--check")
            assert result.exit_code == 0, result.stderr
            assert result.stdout.strip() == "identical", (i, stage, result.stdout)
    what_if = cli("replay", tmp_path / "run" / "iter-0002" / "advantage", "--check", "--set", "advantage.lam=0.5")
    assert what_if.stdout.startswith("differs: column 'advantages' row 0")


def test_each_model_is_loaded_once_per_run(tmp_path, tiny_model, monkeypatch):
    from rlctl.backends import hf

    calls = []
    for cls in (hf.HFPolicy, hf.ValueModel):
        original = cls.load.__func__
        monkeypatch.setattr(cls, "load", classmethod(lambda c, uri, *a, _o=original, **k: calls.append((c.__name__, uri)) or _o(c, uri, *a, **k)))
    config = write_config(tmp_path, tiny_model, pipeline={"iterations": 3, "val_every": 1})
    pipeline = Pipeline.from_config(config, [f"pipeline.run_dir={tmp_path / 'run'}"])
    pipeline.run()
    assert sorted(calls) == sorted([("HFPolicy", tiny_model), ("HFPolicy", tiny_model), ("ValueModel", tiny_model)])
    assert len(pipeline.workers.loads) == 3


def test_python_api_steps_and_takes_a_callable_reward(tmp_path, tiny_model):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    pipeline = Pipeline.from_config(
        {"model": {"path": tiny_model, "ref": tiny_model}, "data": {"prompts": str(prompts), "batch_size": 2},
         "rollout": {"n": 2, "max_new_tokens": 4}, "advantage": {"estimator": "rloo", "kl_coef": 0.1},
         "pipeline": {"iterations": 2, "run_dir": str(tmp_path / "run")}},
        reward_fn=lambda responses: [float(len(r) % 3) for r in responses],
    )
    first = pipeline.step()
    assert first["iteration"] == 1 and {"reward_mean", "kl_divergence", "entropy", "grad_norm", "logprob_mismatch"} <= set(first)
    assert first["logprob_mismatch"] is None  # the HF engine in fp32 is the trainer: its log-probs are the old ones, nothing to compare
    assert len(pipeline.run()) == 1 and pipeline.iteration == 2
    pipeline.close()
    from typer.testing import CliRunner

    from rlctl.cli import app

    replayed = CliRunner().invoke(app, ["replay", str(tmp_path / "run" / "iter-0001" / "score"), "--check"])
    assert replayed.exit_code == 2 and "Pipeline(reward_fn=...) (<lambda>)" in replayed.stderr and "pass --reward" in replayed.stderr


def test_until_then_from_continues_to_the_same_weights(cli, tmp_path, tiny_model, reference_run):
    config, reference = reference_run
    run = tmp_path / "run"
    assert cli("pipeline", config, "--run-dir", run, "--until", "score", "--quiet").exit_code == 0
    assert (run / "iter-0001" / "score" / "_manifest.json").exists() and not (run / "iter-0001" / "advantage").exists()
    assert cli("pipeline", config, "--run-dir", run, "--from", "advantage", "--quiet").exit_code == 0
    assert all(torch.equal(a, b) for a, b in zip(final_weights(reference).values(), final_weights(run).values()))


def test_validation_scores_overall_and_per_data_source(reference_run):
    _, run = reference_run
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert "val/score" not in rows[0] and {"val/score", "val/score/odd", "val/score/even"} <= set(rows[1])
    assert (run / "iter-0002" / "val" / "_manifest.json").exists()


def test_sampled_validation_scores_the_mean_and_the_best_of_n_samples_from_the_same_seed(tmp_path, tiny_model):
    config = write_config(tmp_path, tiny_model, pipeline={"iterations": 2, "val_every": 1, "val_n": 3, "val_temperature": 1.0})
    with Pipeline.from_config(config, [f"pipeline.run_dir={tmp_path / 'run'}"]) as pipeline:
        rows = pipeline.run()
    for row in rows:
        scored = shards.read(str(tmp_path / "run" / f"iter-{row['iteration']:04d}" / "val"), "scores").table
        assert scored.num_rows == 3 * len(PROMPTS) and scored.column("sample").to_pylist() == [0, 1, 2] * len(PROMPTS)
        rewards = np.asarray(scored.column("reward").to_pylist()).reshape(len(PROMPTS), 3)
        assert row["val/score"] == pytest.approx(rewards.mean()) and row["val/best_of_3"] == pytest.approx(rewards.max(axis=1).mean())
        assert row["val/best_of_3"] >= row["val/score"] and {"val/best_of_3/odd", "val/best_of_3/even"} <= set(row)
        assert not any(key.startswith("val/maj_of") for key in row)  # the length reward reads no answer
    val = [shards.read(str(tmp_path / "run" / f"iter-{i:04d}" / "val"), "scores").table for i in (1, 2)]
    assert val[0].column("response_ids").to_pylist() != val[1].column("response_ids").to_pylist()  # the policy moved
    manifest = shards.read_manifest(str(tmp_path / "run" / "iter-0001" / "val"))[0]
    assert manifest.config["rollout"]["n"] == 3 and manifest.config["rollout"]["seed"] == 0 and manifest.metrics["val/best_of_3"] == rows[0]["val/best_of_3"]


def test_sampled_validation_votes_on_the_answers_the_reward_reports(tmp_path, tiny_model):
    """val/maj_of_N: each prompt's most common `pred` (verl's reward convention), its reward."""
    reward = tmp_path / "votes.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return {'score': len(solution_str) / 100, 'pred': str(len(solution_str) % 2)}\n")
    config = write_config(tmp_path, tiny_model, score={"reward": f"{reward}:compute_score"}, pipeline={"iterations": 1, "val_every": 1, "val_n": 3, "val_temperature": 1.0})
    with Pipeline.from_config(config, [f"pipeline.run_dir={tmp_path / 'run'}"]) as pipeline:
        (row,) = pipeline.run()
    scored = shards.read(str(tmp_path / "run" / "iter-0001" / "val"), "scores").table.to_pylist()
    majority = []
    for prompt in range(len(PROMPTS)):
        samples = scored[3 * prompt : 3 * prompt + 3]
        votes = [sample["reward/pred"] for sample in samples]
        top = max(votes, key=lambda answer: (votes.count(answer), -votes.index(answer)))
        majority.append(samples[votes.index(top)]["reward"])
    assert row["val/maj_of_3"] == pytest.approx(np.mean(majority)) and {"val/maj_of_3/odd", "val/maj_of_3/even"} <= set(row)


def test_a_critic_warm_up_holds_the_policy_for_its_optimizer_steps(tmp_path, tiny_model):
    config = write_config(tmp_path, tiny_model, pipeline={"iterations": 2, "val_every": 0}, update={"critic_warmup": 4})  # one iteration's 4 steps
    with Pipeline.from_config(config, [f"pipeline.run_dir={tmp_path / 'run'}"]) as pipeline:
        digests = [pipeline.workers.weights_digest()]
        rows = [pipeline.step(total=2)]
        digests.append(pipeline.workers.weights_digest())
        rows.append(pipeline.step(total=2))
        digests.append(pipeline.workers.weights_digest())
    assert digests[0] == digests[1] != digests[2]  # iteration 1 trained only the critic
    assert [(r["critic_warmup"], r["lr"]) for r in rows] == [(1.0, 0.0), (0.0, 1e-3)]
    assert rows[0]["pg_loss"] is None and rows[1]["pg_loss"] is not None and rows[0]["vf_loss"] is not None


def test_run_folder_layout_show_and_plot(cli, reference_run, tmp_path):
    _, run = reference_run
    assert (run / "config.resolved.toml").exists() and len((run / "metrics.jsonl").read_text().splitlines()) == 4
    for stage in ("prompts", "rollout", "score", "advantage", "update"):
        assert (run / "iter-0004" / stage / "_manifest.json").exists()
    assert load_config(run / "config.resolved.toml").update.micro_batch_tokens == str(CPU_MICRO_BATCH_TOKENS)  # auto, decided and recorded
    assert json.loads((run / "iter-0004" / "update" / "_manifest.json").read_text())["config"]["update"]["micro_batch_tokens"] == str(CPU_MICRO_BATCH_TOKENS)
    summary = cli("show", run, "--json")
    assert json.loads(summary.stdout)["iterations_done"] == 4
    plot = cli("plot", run, "--out", tmp_path / "m.png")
    assert plot.exit_code == 0 and (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"


def test_each_iteration_records_what_its_samples_look_like_and_the_run_says_what_to_change(reference_run):
    _, run = reference_run
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        folder = run / f"iter-{row['iteration']:04d}"
        rollouts = shards.read(str(folder / "rollout"), "rollouts").table
        cut = np.mean([reason == "length" for reason in rollouts.column("finish_reason").to_pylist()])
        assert row["response_length/clip_ratio"] == pytest.approx(cut)
        assert row["response_length/max"] == max(len(r) for r in rollouts.column("response_ids").to_pylist()) <= 6
        assert row["prompt_length/max"] == max(len(p) for p in rollouts.column("prompt_ids").to_pylist())
        rewards = shards.read(str(folder / "score"), "scores").table.column("reward").to_pylist()
        assert (row["reward_min"], row["reward_max"]) == (pytest.approx(min(rewards)), pytest.approx(max(rewards)))
        pairs = [rewards[i : i + 2] for i in range(0, len(rewards), 2)]  # n = 2, rows in prompt order
        assert row["groups/equal_rewards"] == pytest.approx(np.mean([a == b for a, b in pairs]))
        for stage in ("rollout", "score"):  # the stages' own manifests carry the same figures
            recorded = shards.read_manifest(str(folder / stage))[0].metrics
            assert recorded and all(row[k] == pytest.approx(v) for k, v in recorded.items())
    said = (run.parent / "stderr.txt").read_text()
    cut = [r["iteration"] for r in rows if r["response_length/clip_ratio"] >= 0.2]  # a random tiny model seldom stops by itself
    assert said.count("raise rollout.max_new_tokens") == (1 if cut else 0)  # said once, when it first showed
    if cut:
        assert f"rlctl: iteration {cut[0]}: {rows[cut[0] - 1]['response_length/clip_ratio']:.0%} of the responses ended at the length limit" in said


def test_dry_run_prints_the_plan_and_writes_nothing(cli, tmp_path, tiny_model):
    config = write_config(tmp_path, tiny_model)
    result = cli("pipeline", config, "--dry-run", "--run-dir", tmp_path / "run")
    assert result.exit_code == 0, result.stderr
    assert "iterations    1..4 of 4" in result.stdout and "rollout → score → advantage → update" in result.stdout
    assert "correction" not in result.stdout
    algorithm = next(line for line in result.stdout.splitlines() if line.startswith("algorithm"))
    said, source = algorithm.rsplit(": ", 1)  # where the old log-probs come from depends on the CPU's dtype (FACTS.md)
    assert said == "algorithm     gae (γ 0.99, λ 0.95), KL k1 × 0.05 in the reward (adaptive); ppo loss, ratio clipped to [0.8, 1.2], dual clip 3, token-mean; old log-probs"
    assert source in ("rollout", "update", "recompute")
    otb = cli("pipeline", config, "--dry-run", "--run-dir", tmp_path / "run", "--set", 'advantage.estimator="optimal_token_baseline"', "--set", "advantage.kl_coef=0",
              "--set", 'advantage.pf_ppo="max_min"', "--set", 'update.rollout_is="sequence"', "--set", 'update.policy_loss="sapo"', "--set", "update.entropy_coef=0.01",
              "--set", "update.target_kl=0.02")
    assert otb.exit_code == 0, otb.stderr
    assert ("algorithm     optimal_token_baseline (paths weighed by score's Σπ², × ρ̄² of sequence IS weights ≤ 2), batch redrawn by pf_ppo max_min; "
            "sapo loss, token-mean, entropy bonus × 0.01, stopped past KL 1.5 × 0.02; old log-probs: recompute") in otb.stdout
    deepseek = cli("pipeline", config, "--dry-run", "--run-dir", tmp_path / "run", "--set", "advantage.kl_coef=0", "--set", "update.use_kl_loss=true",
                   "--set", "update.kl_loss_unbiased=true", "--set", "update.entropy_target=0.3", "--set", "update.entropy_coef=0.002", "--set", "update.off_policy_mask=0.5",
                   "--set", "update.entropy_advantage=0.4", "--set", "advantage.critic_lam=1", "--set", "advantage.length_adaptive_alpha=0.05")
    assert deepseek.exit_code == 0, deepseek.stderr
    assert "algorithm     gae (γ 0.99, λ 1 − 1/(0.05·length), the critic's returns λ 1); ppo loss" in deepseek.stdout
    assert ("token-mean, KL loss k3 × 0.001 × π/π_old, entropy bonus while the entropy is ≤ 0.3, its coefficient from 0.002 ± 0.005 a step within [0, 1], "
            "negative sequences past KL 0.5 from the rollout masked, advantages + min(0.4·H, |A|/2); old log-probs") in deepseek.stdout
    corrected = cli(
        "pipeline", config, "--dry-run", "--run-dir", tmp_path / "run", "--set", 'update.rollout_is="token"', "--set", "update.rollout_is_batch_normalize=true",
        "--set", 'update.rollout_rs="token_k1,seq_max_k3"', "--set", 'update.rollout_rs_threshold="0.5_2,0.01"',
    )
    assert corrected.exit_code == 0, corrected.stderr
    assert ("correction    token importance weights truncated at 2, over their batch mean; rejected: token_k1 where π_rollout/π_old leaves [0.5, 2], "
            "seq_max_k3 above 0.01 (engine vs the old log-probs: recompute)") in corrected.stdout
    assert not (tmp_path / "run").exists()


def test_a_run_with_the_optimal_token_baseline_scores_sum_pi_squared_and_its_stages_replay(cli, tmp_path, tiny_model):
    """advantage.estimator = optimal_token_baseline turns score.sum_pi_squared on (recorded in
    the run's resolved config) and makes score recompute the old log-probs beside it; the
    advantage is the estimator's on those columns; score and advantage replay identically."""
    from rlctl.algos.kl import KLControllerState
    from rlctl.config import recorded_config
    from rlctl.stages.advantage import advantage_table

    config = write_config(
        tmp_path, tiny_model, model={"critic": ""}, advantage={"estimator": "optimal_token_baseline", "kl_coef": 0.0, "kl_controller": "fixed"},
        update={"epochs": 1}, pipeline={"iterations": 2, "val_every": 0},
    )
    pipeline = Pipeline.from_config(config, [f"pipeline.run_dir={tmp_path / 'run'}"])
    rows = pipeline.run()
    assert len(rows) == 2 and recorded_config(tmp_path / "run").score.sum_pi_squared
    assert all(row["variance_proxy/total_power"] > 0 and row["variance_proxy/expected_w"] > 0 for row in rows)
    for i in (1, 2):
        folder = tmp_path / "run" / f"iter-{i:04d}"
        scores = shards.read(str(folder / "score"), "scores").table
        assert [len(r) for r in scores.column("sum_pi_squared").to_pylist()] == [len(r) for r in scores.column("response_ids").to_pylist()]
        expected, _, _ = advantage_table(scores, pipeline.cfg.advantage, KLControllerState(0.0))
        recorded = shards.read(str(folder / "advantage"), "batch").table
        assert recorded.column("advantages").to_pylist() == expected.column("advantages").to_pylist()
        assert any(a != 0 for row in recorded.column("advantages").to_pylist() for a in row)
    for stage in ("score", "advantage"):
        replayed = cli("replay", tmp_path / "run" / "iter-0002" / stage, "--check")
        assert replayed.exit_code == 0 and "identical" in replayed.stdout, replayed.stderr


def test_a_run_with_policy_filtration_reports_what_it_drew_and_replays_its_draw(cli, tmp_path, tiny_model):
    config = write_config(tmp_path, tiny_model, model={"critic": ""}, advantage={"estimator": "grpo", "pf_ppo": "pow", "kl_coef": 0.0, "kl_controller": "fixed"},
                          pipeline={"iterations": 2, "val_every": 0})
    rows = Pipeline.from_config(config, [f"pipeline.run_dir={tmp_path / 'run'}"]).run()
    for row in rows:
        batch = shards.read(str(tmp_path / "run" / f"iter-{row['iteration']:04d}" / "advantage"), "batch").table
        assert row["pf_ppo/reward_mean"] == pytest.approx(np.mean(batch.column("reward").to_pylist()))
        assert 0 < row["pf_ppo/distinct_rows"] <= 1
    replayed = cli("replay", tmp_path / "run" / "iter-0002" / "advantage", "--check")
    assert replayed.exit_code == 0 and "identical" in replayed.stdout, replayed.stderr


def test_drop_leaves_over_long_prompts_out_before_the_draw_so_batches_stay_full_and_replay(cli, tmp_path, tiny_model, capfd):
    """data.truncate = drop (verl's filter_overlong_prompts): the prompts over the limit are
    never drawn, in training or validation; each batch is full; the prompts stage replays."""
    long_ones = [{"id": f"long{i}", "prompt": "Question: " + "and then what " * 20 + "?"} for i in range(2)]
    prompts = tmp_path / "mixed.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in [*long_ones, *PROMPTS]))
    config = write_config(tmp_path, tiny_model, data={"prompts": str(prompts), "val_prompts": str(prompts), "truncate": "drop", "max_prompt_tokens": 24},
                          model={"critic": ""}, advantage={"estimator": "grpo", "kl_coef": 0.0, "kl_controller": "fixed"}, pipeline={"iterations": 3, "val_every": 3})
    Pipeline.from_config(config, [f"pipeline.run_dir={tmp_path / 'run'}"]).run()
    assert capfd.readouterr().err.count("rlctl: data.truncate = drop: left out 2 of 7 prompts over max_prompt_tokens=24: 'long0', 'long1'") == 2  # training, validation
    for i in (1, 2, 3):
        drawn = shards.read(str(tmp_path / "run" / f"iter-{i:04d}" / "prompts"), "prompts").table.column("id").to_pylist()
        assert len(drawn) == 3 and not any(d.startswith("long") for d in drawn)
    validated = shards.read(str(tmp_path / "run" / "iter-0003" / "val"), "scores").table.column("id").to_pylist()
    assert sorted(set(validated)) == sorted(p["id"] for p in PROMPTS)
    replayed = cli("replay", tmp_path / "run" / "iter-0002" / "prompts", "--check")
    assert replayed.exit_code == 0 and "identical" in replayed.stdout, replayed.stderr


def test_keep_shards_prunes_old_stage_outputs(tmp_path, tiny_model):
    config = write_config(tmp_path, tiny_model, pipeline={"iterations": 3, "keep_shards": 1, "keep_checkpoints": 1, "val_every": 0})
    Pipeline.from_config(config, [f"pipeline.run_dir={tmp_path / 'run'}"]).run()
    assert sorted(p.name for p in (tmp_path / "run" / "iter-0001").iterdir()) == ["update"]
    assert (tmp_path / "run" / "iter-0003" / "rollout").exists()
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["iter-0003"]


def test_val_before_train_validates_the_initial_weights_as_iteration_0(cli, tmp_path, tiny_model):
    config = write_config(tmp_path, tiny_model, pipeline={"iterations": 2, "val_every": 1, "val_before_train": True})
    result = cli("pipeline", config, "--run-dir", tmp_path / "run", "--quiet")
    assert result.exit_code == 0, result.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2] and set(rows[0]) >= {"val/score", "val/score/odd"} and "reward_mean" not in rows[0]
    assert shards.read(str(tmp_path / "run" / "iter-0000" / "val"), "scores").table.num_rows == len(PROMPTS)
    shown = json.loads(cli("show", tmp_path / "run", "--json").stdout)
    assert shown["iterations_done"] == 2 and shown["rows"][0]["iteration"] == 0
    replayed = cli("replay", tmp_path / "run" / "iter-0000" / "val", "--check")
    assert replayed.exit_code == 0 and "identical" in replayed.stdout, replayed.stderr
    assert cli("plot", tmp_path / "run", "--out", tmp_path / "p.png").exit_code == 0


def test_keep_best_saves_and_keeps_the_checkpoint_of_the_best_iteration(cli, tmp_path, tiny_model):
    """pipeline.keep_best: an iteration that betters the metric saves a checkpoint (here no other
    would: save_every 0 saves only at the end), and pruning to the last one leaves it."""
    config = write_config(tmp_path, tiny_model, pipeline={"iterations": 4, "save_every": 0, "keep_checkpoints": 1, "val_every": 0, "keep_best": "reward_mean"})
    rows = Pipeline.from_config(config, [f"pipeline.run_dir={tmp_path / 'run'}"]).run()
    best = max(rows, key=lambda r: (r["reward_mean"], -r["iteration"]))["iteration"]
    assert best < 4  # the check covers a best that is not the last
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [f"iter-{best:04d}", "iter-0004"]
    shown = json.loads(cli("show", tmp_path / "run", "--json").stdout)
    assert shown["best"] == {"metric": "reward_mean", "value": rows[best - 1]["reward_mean"], "iteration": best, "checkpoint": str(tmp_path / "run" / "checkpoints" / f"iter-{best:04d}")}


@pytest.mark.parametrize("args,fragment", [
    (["--from", "scoring"], "--from 'scoring': unknown stage"),
    (["--set", "pipeline.val_every=0", "--set", "pipeline.keep_best=val/score"], "pipeline.keep_best = 'val/score' is measured by validation"),
    (["--set", "data.val_prompts=''", "--set", "pipeline.val_before_train=true"], "pipeline.val_before_train validates the initial weights on data.val_prompts"),
    (["--set", "update.mini_batch_size=4"], "mini_batch_size=4 does not divide the batch of 6"),
    (["--set", "model.ref="], "kl_coef > 0 needs a reference model"),
    (["--set", "model.critic="], "estimator gae needs a critic"),
    (["--set", "advantage.estimator=ppo"], "unknown advantage estimator 'ppo'"),
    (["--set", "model.critic=", "--set", "advantage.estimator=remax"], "estimator remax needs each prompt's greedy reward: set rollout.greedy_baseline = true"),
    (["--set", "pipeline.val_n=4"], "pipeline.val_n = 4 with val_temperature = 0: greedy samples of a prompt are all alike"),
    (["--set", "model.critic=", "--set", "advantage.estimator=grpo", "--set", "update.critic_warmup=4"], "update.critic_warmup trains only the critic for its steps: set model.critic"),
    (["--set", "update.lr_schedule=cosine"], "decays until update.decay_steps (0), which must exceed update.warmup_steps (0): set it in optimizer steps; this batch takes 4 optimizer steps per update"),
    (["--set", 'data.system_prompt="Be brief."'], "prompts.jsonl: prompt 'p0' is plain text, and data.system_prompt is a chat message: set data.chat_template = true"),
    (["--set", 'advantage.estimator="online_dpo"', "--set", "advantage.kl_coef=0", "--set", "model.ref="], "estimator online_dpo compares the policy's pairs with a reference: set model.ref"),
    (["--set", 'advantage.estimator="online_dpo"', "--set", "advantage.kl_coef=0", "--set", "rollout.n=1"], "estimator online_dpo makes a pair of each prompt's best and worst sample: set rollout.n ≥ 2"),
    (["--set", 'advantage.estimator="online_dpo"'], "estimator online_dpo holds the policy to the reference through advantage.dpo_beta: set advantage.kl_coef = 0"),
])
def test_bad_configs_fail_before_any_work(cli, tmp_path, tiny_model, args, fragment):
    config = write_config(tmp_path, tiny_model)
    result = cli("pipeline", config, "--run-dir", tmp_path / "run", *args)
    assert result.exit_code == 2, result.stderr
    assert fragment in one_line_error(result)
    assert not (tmp_path / "run").exists()


def test_remax_trains_on_each_samples_reward_less_its_prompts_greedy_reward_and_replays_identical(cli, tmp_path, tiny_model):
    """ReMax in a pipeline: the rollout decodes a greedy response per prompt beside the samples,
    score gives it its reward, the batch's advantage is reward − baseline_reward (no KL in the
    reward here); validation decodes no baselines; the rollout replays bit for bit."""
    config = write_config(
        tmp_path, tiny_model, model={"critic": ""}, rollout={"greedy_baseline": True},
        advantage={"estimator": "remax", "kl_coef": 0.0, "kl_controller": "fixed"}, pipeline={"iterations": 2, "val_every": 2},
    )
    run = tmp_path / "run"
    assert "× n=2 and a greedy response each: the baseline, not trained on)" in cli("pipeline", config, "--run-dir", run, "--dry-run").stdout
    result = cli("pipeline", config, "--run-dir", run, "--quiet")
    assert result.exit_code == 0, result.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= row["baseline_reward_mean"] for row in rows)
    for i in (1, 2):
        batch = shards.read(str(run / f"iter-{i:04d}" / "advantage"), "batch").table
        assert batch.num_rows == 6
        for row in batch.to_pylist():
            assert row["advantages"] == pytest.approx([row["reward"] - row["baseline_reward"]] * len(row["response_ids"]), abs=1e-6)
    val = shards.read(str(run / "iter-0002" / "val")).table
    assert "baseline_response" not in val.column_names and "baseline_reward" not in val.column_names
    replayed = cli("replay", run / "iter-0002" / "rollout", "--check")
    assert replayed.exit_code == 0 and "identical" in replayed.stdout, (replayed.stdout, replayed.stderr)


def test_a_run_resumes_only_with_the_training_config_it_started_with(cli, tmp_path, tiny_model):
    config = write_config(tmp_path, tiny_model, pipeline={"iterations": 1, "val_every": 0})
    run = tmp_path / "run"
    assert cli("pipeline", config, "--run-dir", run, "--quiet").exit_code == 0
    # more iterations, passes cut otherwise, rows of zero advantage trained: the same training, it goes on
    resume_sets = ["--set", "score.batch_size=8", "--set", "score.batch_tokens=0", "--set", "update.skip_zero_advantage=false"]
    assert cli("pipeline", config, "--run-dir", run, "--quiet", "--iterations", "2", *resume_sets).exit_code == 0
    changed = cli("pipeline", config, "--run-dir", run, "--quiet", "--iterations", "3", "--set", "update.lr=0.5")
    assert changed.exit_code == 2
    line = one_line_error(changed)
    assert "was started with another config (update.lr: 0.001 → 0.5)" in line and "--resume-with-changes" in line
    assert not (run / "iter-0003").exists()
    resumed = cli("pipeline", config, "--run-dir", run, "--quiet", "--iterations", "3", "--set", "update.lr=0.5", "--resume-with-changes")
    assert resumed.exit_code == 0, resumed.stderr
    state = json.loads((run / "checkpoints" / "iter-0003" / "_manifest.json").read_text())["state"]["pipeline"]
    assert state["config_changes"] == [{"from_iteration": 3, "changes": {"update.lr": [0.001, 0.5]}}]


def test_weighted_rewards_are_metrics_and_their_score_stage_replays(cli, tmp_path, tiny_model):
    (tmp_path / "judge.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(len(solution_str) % 2), 'chars': len(solution_str)}\n"
    )
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    rewards = [{"fn": "builtin:length", "weight": 1.0}, {"fn": f"{tmp_path / 'judge.py'}:compute_score", "weight": 0.5, "name": "parity"}]
    pipeline = Pipeline.from_config(
        {"model": {"path": tiny_model}, "data": {"prompts": str(prompts), "batch_size": 2}, "rollout": {"n": 2, "max_new_tokens": 4},
         "score": {"rewards": rewards}, "advantage": {"estimator": "grpo"}, "pipeline": {"iterations": 1, "run_dir": str(tmp_path / "run")}},
    )
    (row,) = pipeline.run()
    pipeline.close()
    scores = shards.read(str(tmp_path / "run" / "iter-0001" / "score"), "scores").table
    length, parity = (np.asarray(scores.column(c).to_pylist()) for c in ("reward/length", "reward/parity"))
    assert row["reward_mean"] == pytest.approx(float(np.mean(length + 0.5 * parity)), rel=1e-5)
    assert row["reward_mean/length"] == pytest.approx(float(length.mean())) and row["reward_mean/parity"] == pytest.approx(float(parity.mean()))
    assert row["reward_mean/parity/chars"] == pytest.approx(float(np.mean([len(r) for r in scores.column("response").to_pylist()])))
    stage = tmp_path / "run" / "iter-0001" / "score"
    refused = cli("replay", stage, "--check")
    assert refused.exit_code == 2 and "judge.py:compute_score" in refused.stderr and "--trust-run-code" in refused.stderr
    trusted = cli("replay", stage, "--check", "--trust-run-code")
    assert trusted.exit_code == 0 and trusted.stdout.strip() == "identical", trusted.stderr


def test_old_logprobs_come_from_the_rollout_when_the_engine_is_the_trainer(tmp_path, tiny_model):
    """auto skips score's policy forward for the HF engine in fp32 (says so in the score
    manifest) and trains as the recomputed log-probs would, within float noise."""
    runs = {}
    for mode in ("auto", "recompute"):
        (tmp_path / mode).mkdir()
        config = write_config(tmp_path / mode, tiny_model, score={"reward": "builtin:length", "old_logprobs": mode}, pipeline={"iterations": 2, "val_every": 0})
        Pipeline.from_config(config, [f"pipeline.run_dir={tmp_path / mode / 'run'}"]).run()
        runs[mode] = tmp_path / mode / "run"
    auto_scores = shards.read(str(runs["auto"] / "iter-0002" / "score"), "scores").table
    assert "old_logprobs" not in auto_scores.column_names
    manifest = json.loads((runs["auto"] / "iter-0002" / "score" / "_manifest.json").read_text())
    assert manifest["config"]["old_logprobs"] == "rollout"
    recomputed = metrics_without_timings(runs["recompute"])
    assert all(r["logprob_mismatch"] < 1e-4 for r in recomputed)  # what makes skipping the forward safe
    for ours, theirs in zip(metrics_without_timings(runs["auto"]), recomputed, strict=True):
        for key in ("reward_mean", "kl", "pg_loss", "vf_loss", "grad_norm"):
            assert ours[key] == pytest.approx(theirs[key], abs=1e-4), key
    expected, got = final_weights(runs["recompute"]), final_weights(runs["auto"])
    diffs = torch.cat([(expected[k] - got[k]).abs().reshape(-1) for k in expected])
    # Adam normalises each update: a weight whose gradient is ~0 may take a different fraction of
    # one step (lr = 1e-3) on 1e-7 noise; the weights as a whole stay the same
    assert float(diffs.max()) < 1e-3 and float(diffs.mean()) < 1e-6


def test_auto_dtypes_where_bf16_is_native_train_in_bf16_on_the_updates_own_logprobs(tmp_path, tiny_model, monkeypatch):
    """On bf16 hardware (forced here) auto decides bf16 for generation, scoring and training,
    records it, skips score's policy forward when the update makes one step (its own forward is
    the old policy's), trains as a recompute would, and a resumed run keeps the decision."""
    monkeypatch.setenv("RLCTL_NATIVE_BF16", "1")
    grpo = {
        "model": {"path": tiny_model, "ref": tiny_model, "critic": ""}, "advantage": {"estimator": "grpo", "kl_coef": 0.0},
        "update": {"lr": 1e-3, "mini_batch_size": 0, "micro_batch_size": 4, "epochs": 1, "use_kl_loss": True},
        "pipeline": {"iterations": 2, "val_every": 0},
    }
    runs = {}
    for mode in ("auto", "recompute"):
        (tmp_path / mode).mkdir()
        config = write_config(tmp_path / mode, tiny_model, **grpo, score={"reward": "builtin:length", "old_logprobs": mode})
        Pipeline.from_config(config, [f"pipeline.run_dir={tmp_path / mode / 'run'}"]).run()
        runs[mode] = tmp_path / mode / "run"
    recorded = load_config(runs["auto"] / "config.resolved.toml")
    assert (recorded.rollout.dtype, recorded.score.dtype, recorded.update.bf16) == ("bf16", "bf16", "true")
    score = runs["auto"] / "iter-0002" / "score"
    assert json.loads((score / "_manifest.json").read_text())["config"]["old_logprobs"] == "update"
    assert "old_logprobs" not in shards.read(str(score), "scores").table.column_names
    ours, theirs = metrics_without_timings(runs["auto"]), metrics_without_timings(runs["recompute"])
    assert ours[0]["reward_mean"] == theirs[0]["reward_mean"]  # the same weights generate the same first batch
    assert ours[0]["grad_norm"] == pytest.approx(theirs[0]["grad_norm"], rel=0.02)  # bf16 forward vs bf16 recompute
    assert 0 < ours[0]["logprob_mismatch"] < 0.05  # the bf16 engine against bf16 training, still measured
    monkeypatch.setenv("RLCTL_NATIVE_BF16", "0")  # resumed where bf16 is not native: the run keeps bf16
    config = tmp_path / "auto" / "run.toml"
    Pipeline.from_config(config, [f"pipeline.run_dir={runs['auto']}", "pipeline.iterations=3"]).run()
    assert len(metrics_without_timings(runs["auto"])) == 3
    assert json.loads((runs["auto"] / "iter-0003" / "score" / "_manifest.json").read_text())["config"]["score"]["dtype"] == "bf16"


def test_online_dpo_pairs_each_groups_best_and_worst_sample_and_its_update_raises_the_chosen_over_the_rejected(cli, tmp_path, tiny_model):
    """advantage.estimator = online_dpo: per prompt its best-rewarded sample gets a positive
    advantage and its worst a negative one (the gradient of the pair's DPO loss, scaled for the
    update's aggregation), the others none; after the update the pairs' DPO loss is lower; the
    advantage stage replays identically."""
    from rlctl.algos.kl import KLControllerState
    from rlctl.algos.preference import dpo_losses
    from rlctl.backends.hf import HFPolicy
    from rlctl.stages.advantage import advantage_table

    config = write_config(
        tmp_path, tiny_model, model={"critic": "", "ref": "policy"}, rollout={"n": 3, "max_new_tokens": 6},
        advantage={"estimator": "online_dpo", "kl_coef": 0.0, "kl_controller": "fixed", "dpo_beta": 0.5},
        update={"epochs": 1, "mini_batch_size": 0, "lr": 1e-3}, pipeline={"iterations": 2, "val_every": 0},
    )
    plan = cli("pipeline", config, "--dry-run", "--run-dir", tmp_path / "run")
    assert "online_dpo (each prompt's best and worst sample a pair, sigmoid loss, β 0.5, scaled for token-mean)" in plan.stdout, plan.stderr
    pipeline = Pipeline.from_config(config, [f"pipeline.run_dir={tmp_path / 'run'}"])
    metrics = pipeline.run()
    assert len(metrics) == 2
    folder = tmp_path / "run" / "iter-0001"
    scores = shards.read(str(folder / "score"), "scores").table
    batch = shards.read(str(folder / "advantage"), "batch").table
    expected, _, _ = advantage_table(scores, pipeline.cfg.advantage, KLControllerState(0.0))
    assert batch.column("advantages").to_pylist() == expected.column("advantages").to_pylist()
    ids, rewards = batch.column("id").to_pylist(), batch.column("reward").to_pylist()
    signs = [0 if not any(row) else (1 if row[0] > 0 else -1) for row in batch.column("advantages").to_pylist()]
    chosen, rejected = [], []
    for prompt in sorted(set(ids)):
        rows = [i for i, name in enumerate(ids) if name == prompt]
        if max(rewards[i] for i in rows) > min(rewards[i] for i in rows):
            assert sorted(signs[i] for i in rows) == [-1, 0, 1]
            chosen.append(next(i for i in rows if signs[i] > 0))
            rejected.append(next(i for i in rows if signs[i] < 0))
            assert rewards[chosen[-1]] == max(rewards[i] for i in rows) and rewards[rejected[-1]] == min(rewards[i] for i in rows)
        else:
            assert all(signs[i] == 0 for i in rows)
    assert chosen, "no prompt had samples of different rewards"
    prompts, responses = batch.column("prompt_ids").to_pylist(), batch.column("response_ids").to_pylist()
    trained = HFPolicy.load(str(tmp_path / "run" / "checkpoints" / "iter-0001"), "cpu")
    after = trained.logprobs([prompts[i] for i in chosen + rejected], [responses[i] for i in chosen + rejected], temperature=1.0)

    def pair_loss(logprobs: list[list[float]]) -> float:
        sums = torch.tensor([sum(row) for row in logprobs], dtype=torch.float64)
        ref = torch.tensor([sum(batch.column("ref_logprobs")[i].as_py()) for i in chosen + rejected], dtype=torch.float64)
        n = len(chosen)
        return float(dpo_losses(sums[:n], sums[n:], ref[:n], ref[n:], beta=0.5)[0].mean())

    before = pair_loss([batch.column("rollout_logprobs")[i].as_py() for i in chosen + rejected])
    assert pair_loss(after) < before - 1e-4
    assert metrics[0]["dpo/pairs"] == len(chosen) and metrics[0]["dpo/loss"] == pytest.approx(before, abs=1e-3) and 0 <= metrics[0]["dpo/accuracy"] <= 1
    replayed = cli("replay", folder / "advantage", "--check")
    assert replayed.exit_code == 0 and "identical" in replayed.stdout, replayed.stderr
