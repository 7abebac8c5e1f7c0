"""Ray worker groups (CPU, gloo): N ranks training with FSDP2 make the update one process makes,
rows spread over ranks come back as one process would write them, and a dead worker stops the
command with exit 1 naming it."""

import json
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlctl import mkl_kernels, shards
from rlctl.algos.losses import LOSS_AGG_MODES
from rlctl.config import Config, UpdateConfig, WorkersConfig, load_config
from rlctl.manifest import Manifest
from rlctl.trainer import TrainBatch
from tests.conftest import one_line_error

pytest.importorskip("ray")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="module")
def gae_batch(tmp_path_factory, tiny_model) -> str:
    """A batch with values and returns (critic) and reference log-probs."""
    from typer.testing import CliRunner

    from rlctl.cli import app
    from tests.conftest import CLI_ENV

    tmp = tmp_path_factory.mktemp("batch")
    prompts = tmp / "p.jsonl"
    prompts.write_text("".join(f'{{"id": "p{i}", "prompt": "Question {i}: count to {i}"}}\n' for i in range(5)))
    runner = CliRunner(env=CLI_ENV)
    for args in (
        ["rollout", "--prompts", prompts, "--model", tiny_model, "--out", tmp / "r", "--n", "2", "--max-new-tokens", "6"],
        ["score", "--rollouts", tmp / "r", "--out", tmp / "s", "--reward", "builtin:length", "--ref", tiny_model, "--critic", tiny_model],
        ["advantage", "--scores", tmp / "s", "--out", tmp / "b", "--estimator", "gae", "--gamma", "0.99", "--lam", "0.95"],
    ):
        result = runner.invoke(app, [str(a) for a in args])
        assert result.exit_code == 0, result.stderr
    return str(tmp / "b")


# Weights after an update split over other ranks and passes differ by fp32 rounding alone:
# a prompt shared by rows in one pass runs once, and by rows split over passes or ranks once
# in each (the same function by other kernels, ~1e-6 in the log-probs), and the first Adam
# steps (≈ lr · sign(g)) magnify that on near-zero gradients (seen: ≤ 1.4e-5; a missing or
# doubled share moves a weight by ~lr = 1e-3). In float64 the gradients of two FSDP2 ranks
# sharing prompts equal those of one process making the same passes exactly.
SPLIT_ROUNDING = 5e-5


def config(tiny_model, *, workers: int, backend: str = "ray", **update) -> Config:
    cfg = load_config(data={"model": {"path": tiny_model, "critic": tiny_model, "device": "cpu"}})
    upd = UpdateConfig(lr=1e-3, critic_lr=1e-3, micro_batch_size=2, mini_batch_size=5, epochs=2, **update)
    return replace(cfg, update=upd, workers=WorkersConfig(backend=backend, num_workers=workers))


def trained_weights(cfg: Config, tiny_model: str, batch: TrainBatch, out) -> dict[str, torch.Tensor]:
    from rlctl.workers import make_workers

    workers = make_workers(cfg, policy_source=tiny_model, critic_source=tiny_model)
    try:
        workers.trainer.train(batch)
        workers.hand_over_weights()
        workers.save(str(out), Manifest(stage="test"), None)
    finally:
        workers.close()
    weights = load_file(str(out / "model.safetensors"))
    weights.update({f"critic.{k}": v for k, v in load_file(str(out / "critic" / "model.safetensors")).items()})
    weights.update({f"critic.{k}": v for k, v in load_file(str(out / "critic" / "value_head.safetensors")).items()})
    return weights


@pytest.mark.parametrize("mode,share", [(mode, "always") for mode in LOSS_AGG_MODES] + [("token-mean", "never")])
def test_two_workers_make_the_update_one_process_makes(ray_session, tiny_model, gae_batch, tmp_path, mode, share, monkeypatch):
    """With rows that share prompts run each prompt once (forced: the tiny model alone would
    not pay for it) and without; the setting reaches the workers as every RLCTL_* variable."""
    monkeypatch.setenv("RLCTL_SHARE_PROMPTS", share)
    batch = TrainBatch.from_table(shards.read(gae_batch, "batch").table)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker (cpus_per_worker = 1): the comparison is of the split, not of thread counts
    try:
        local = trained_weights(config(tiny_model, workers=1, backend="local", loss_agg_mode=mode), tiny_model, batch, tmp_path / "local")
    finally:
        torch.set_num_threads(threads)
    for n in (1, 2):
        got = trained_weights(config(tiny_model, workers=n, loss_agg_mode=mode), tiny_model, batch, tmp_path / f"ray{n}")
        assert got.keys() == local.keys()
        worst = max(float((got[k] - local[k]).abs().max()) for k in local)
        assert worst < SPLIT_ROUNDING, (n, mode, worst)
        moved = max(float((got[k] - load_file(f"{tiny_model}/model.safetensors").get(k, got[k])).abs().max()) for k in got if not k.startswith("critic."))
        assert moved > 1e-4  # the update did something


def test_two_workers_reject_and_normalize_the_rollout_correction_as_one_process_does(ray_session, tiny_model, gae_batch, tmp_path):
    """update.rollout_rs and rollout_is_batch_normalize are the whole batch's: each rank drops
    the same tokens and rows and divides by the same mean, so the split trains what one process does."""
    batch = TrainBatch.from_table(shards.read(gae_batch, "batch").table)
    g = torch.Generator().manual_seed(3)
    batch = replace(batch, rollout_logprobs=batch.old_logprobs + torch.where(batch.response_mask, torch.randn(batch.old_logprobs.shape, generator=g) * 0.3, 0))
    settings = {"rollout_rs": "token_k1,seq_max_k2", "rollout_rs_threshold": "0.75_1.33,0.15", "rollout_is": "token", "rollout_is_batch_normalize": True}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        local = trained_weights(config(tiny_model, workers=1, backend="local", **settings), tiny_model, batch, tmp_path / "local")
        plain = trained_weights(config(tiny_model, workers=1, backend="local"), tiny_model, batch, tmp_path / "plain")
    finally:
        torch.set_num_threads(threads)
    got = trained_weights(config(tiny_model, workers=2, **settings), tiny_model, batch, tmp_path / "ray2")
    assert max(float((got[k] - local[k]).abs().max()) for k in local) < SPLIT_ROUNDING
    assert max(float((plain[k] - local[k]).abs().max()) for k in local) > 1e-4  # the correction changed the update


def test_two_workers_with_gradient_checkpointing_make_the_update_one_process_makes(ray_session, tiny_model, gae_batch, tmp_path, monkeypatch):
    """FSDP2's hooks and the checkpointed layers' recompute together: the update of one
    process without checkpointing, policy and critic."""
    monkeypatch.setenv("RLCTL_SHARE_PROMPTS", "never")
    batch = TrainBatch.from_table(shards.read(gae_batch, "batch").table)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        local = trained_weights(config(tiny_model, workers=1, backend="local", bf16="false"), tiny_model, batch, tmp_path / "local")
    finally:
        torch.set_num_threads(threads)
    got = trained_weights(config(tiny_model, workers=2, bf16="false", gradient_checkpointing=True), tiny_model, batch, tmp_path / "ray")
    assert max(float((got[k] - local[k]).abs().max()) for k in local) < SPLIT_ROUNDING


def test_rows_spread_over_ranks_come_back_as_one_process_writes_them(ray_session, tiny_model, gae_batch):
    from rlctl.workers import make_workers

    table = shards.read(gae_batch, "batch").table
    prompt_ids, response_ids = table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist()
    results = {}
    for backend, n in (("local", 1), ("ray", 2)):
        cfg = replace(config(tiny_model, workers=n, backend=backend), model=replace(config(tiny_model, workers=n).model, ref=tiny_model))
        workers = make_workers(cfg, policy_source=tiny_model, critic_source=tiny_model)
        try:
            from rlctl.backends.base import SamplingParams

            generated = workers.engine.generate(prompt_ids, SamplingParams(max_new_tokens=8, temperature=1.0, seed=11), batch_size=3)
            results[backend] = (
                [g.response_ids for g in generated], [g.logprobs for g in generated],
                workers.ref.logprobs(prompt_ids, response_ids, temperature=1.0), workers.critic.values(prompt_ids, response_ids, pad_id=0),
                *workers.policy.logprobs_with_statistic(prompt_ids, response_ids, statistic="sum_pi_squared", temperature=0.8),
            )
        finally:
            workers.close()
    local, ray_ = results["local"], results["ray"]
    assert local[0] == ray_[0]  # the same tokens: every row draws from its own random stream
    for a, b in zip(local[1:], ray_[1:]):
        for row_a, row_b in zip(a, b):
            assert len(row_a) == len(row_b) and max(abs(x - y) for x, y in zip(row_a, row_b)) < 1e-5


def test_an_unreachable_address_is_bad_input_not_a_hang(cli, tmp_path, tiny_model):
    from tests.e2e.test_pipeline import write_config

    started = time.time()
    result = cli("pipeline", write_config(tmp_path, tiny_model), "--run-dir", tmp_path / "run", "--set", "workers.backend=ray", "--set", "workers.address=127.0.0.1:9")
    assert result.exit_code == 2, result.stderr
    assert "no Ray cluster answers there" in one_line_error(result) and time.time() - started < 30
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_worker_killed_mid_update_stops_the_run_and_a_rerun_resumes(tmp_path, tiny_model):
    from tests.e2e.test_pipeline import final_weights, metrics_without_timings, rlctl, write_config

    config_file = write_config(tmp_path, tiny_model, pipeline={"iterations": 2, "val_every": 0})
    ray2 = ["--set", "workers.backend=ray", "--set", "workers.num_workers=2"]
    rlctl("pipeline", config_file, "--run-dir", tmp_path / "reference", "--quiet", *ray2)
    run = tmp_path / "run"
    # 2 epochs × 2 mini-batches = 4 optimizer steps per iteration: step 6 is mid-iteration 2
    killed = rlctl("pipeline", config_file, "--run-dir", run, "--quiet", *ray2, env={"RLCTL_FAULT_KILL_AT": "rank-1:optimizer-step-6"}, check=False)
    assert killed.returncode == 1, killed.stderr[-2000:]
    line = killed.stderr.strip().splitlines()[-1]
    assert "worker rank 1 (pid" in line and "died during train" in line, killed.stderr[-2000:]
    assert f"Ray's logs: {run / 'logs' / 'ray'}" in line  # copied into the run folder before Ray's session ended
    assert any(f.name.startswith("worker-") for f in (run / "logs" / "ray").iterdir())
    assert not (run / "iter-0002" / "update" / "_manifest.json").exists()
    assert (run / "checkpoints" / "iter-0001" / "_manifest.json").exists() and not (run / "checkpoints" / "iter-0002").exists()
    rlctl("pipeline", config_file, "--run-dir", run, "--quiet", *ray2)
    expected, got = final_weights(tmp_path / "reference"), final_weights(run)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert metrics_without_timings(run) == metrics_without_timings(tmp_path / "reference")


@pytest.mark.slow
def test_a_two_worker_run_replays_identical_and_resumes_on_one_worker_and_locally(cli, tmp_path, tiny_model):
    from tests.e2e.test_pipeline import final_weights, rlctl, write_config

    config_file = write_config(tmp_path, tiny_model, pipeline={"iterations": 2, "val_every": 0})
    run = tmp_path / "run"
    first = rlctl("--verbose", "pipeline", config_file, "--run-dir", run, "--quiet", "--set", "workers.backend=ray", "--set", "workers.num_workers=2")
    assert f"Ray's logs are copied to {run / 'logs' / 'ray'}" in first.stderr and "Ray's logs (worker output, errors) are in" in first.stderr
    assert (run / "logs" / "ray").is_dir()
    for stage in ("rollout", "score"):  # written by the two ranks
        assert len(shards.read_manifest(str(run / "iter-0002" / stage))[0].files) == 2
    for stage in ("rollout", "score", "update"):  # computed by the ranks: what their last bits depend on
        state = shards.read_manifest(str(run / "iter-0002" / stage))[0].state
        assert (state["torch_threads"], state["mkl_kernels"]) == (1, mkl_kernels.recorded())
    for stage in ("prompts", "rollout", "score", "advantage", "update"):
        result = cli("replay", run / "iter-0002" / stage, "--check")
        assert result.exit_code == 0, (stage, result.stderr)
        assert result.stdout.strip() == "identical", (stage, result.stdout)
    at_two = final_weights(run)
    rlctl("pipeline", config_file, "--run-dir", run, "--quiet", "--iterations", "3", "--set", "workers.backend=ray", "--set", "workers.num_workers=1")
    rlctl("pipeline", config_file, "--run-dir", run, "--quiet", "--iterations", "4")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4] and [r["policy_version"] for r in rows] == [4, 8, 12, 16]
    checkpoints = sorted((run / "checkpoints").glob("iter-*"))
    assert checkpoints[-1].name == "iter-0004"
    assert load_file(str(run / "checkpoints" / "iter-0002" / "model.safetensors")).keys() == at_two.keys() - {k for k in at_two if k.startswith("critic.")}


def test_stage_commands_on_two_workers_write_what_one_process_writes(ray_session, cli, tmp_path, tiny_model, prompts_file):
    """rollout (with greedy baselines), score (with Σπ²) and update with --workers 2 against the
    same commands run locally."""
    runs = {}
    for name, flags in (("local", []), ("ray", ["--workers-backend", "ray", "--workers", "2"])):
        out = tmp_path / name
        for args in (
            ["rollout", "--prompts", prompts_file, "--model", tiny_model, "--out", out / "r", "--n", "3", "--max-new-tokens", "5", "--seed", "4", "--greedy-baseline"],
            ["score", "--rollouts", out / "r", "--out", out / "s", "--reward", "builtin:length", "--ref", tiny_model, "--policy", tiny_model, "--critic", tiny_model, "--sum-pi-squared"],
            ["advantage", "--scores", out / "s", "--out", out / "b", "--estimator", "gae"],
            ["update", "--batch", out / "b", "--model", tiny_model, "--critic", tiny_model, "--out", out / "c", "--lr", "1e-3", "--mini-batch-size", "3", "--micro-batch-size", "2"],
        ):
            result = cli(*args, *(flags if args[0] != "advantage" else []))
            assert result.exit_code == 0, (name, args[0], result.stderr)
        runs[name] = out
    local_r, ray_r = shards.read(str(runs["local"] / "r")).table, shards.read(str(runs["ray"] / "r")).table
    assert local_r.column("response_ids").to_pylist() == ray_r.column("response_ids").to_pylist()
    assert local_r.drop_columns(["rollout_logprobs"]).equals(ray_r.drop_columns(["rollout_logprobs"]))
    assert [f.rows for f in shards.read_manifest(str(runs["ray"] / "r"))[0].files] == [6, 3]  # each rank wrote its part
    assert [f.rows for f in shards.read_manifest(str(runs["ray"] / "s"))[0].files] == [5, 4]
    assert "baseline_response_ids" in ray_r.column_names and "baseline_reward_mean" in shards.read_manifest(str(runs["ray"] / "s"))[0].metrics
    for stage in ("r", "s"):  # the sample statistics of rows the ranks wrote are those of one process's rows
        local_metrics, ray_metrics = (shards.read_manifest(str(runs[name] / stage))[0].metrics for name in ("local", "ray"))
        assert ray_metrics == local_metrics and ray_metrics, stage
    local_s, ray_s = shards.read(str(runs["local"] / "s")).table, shards.read(str(runs["ray"] / "s")).table
    for column in ("ref_logprobs", "old_logprobs", "sum_pi_squared", "values", "rollout_logprobs"):
        a, b = local_s.column(column).to_pylist(), ray_s.column(column).to_pylist()
        assert max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)) < 1e-5, column
    local_w, ray_w = load_file(str(runs["local"] / "c" / "model.safetensors")), load_file(str(runs["ray"] / "c" / "model.safetensors"))
    assert max(float((local_w[k] - ray_w[k]).abs().max()) for k in local_w) < SPLIT_ROUNDING  # seen: 1.1e-5 on MKL's Intel kernels
    assert shards.read_manifest(str(runs["ray"] / "c"))[0].state["workers"]["num_workers"] == 2


class Stopped(Exception):
    """A run stopped from its report callback, as a crash would stop it."""


def stop_in_epoch_2(row: dict) -> None:
    if row["epoch"] == 2:
        raise Stopped


def a_reward_model(tiny_model: str, folder: Path) -> str:
    """A sequence-classification model with a seeded head, as `rm:` loads one."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model, num_labels=1)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    model.config.pad_token_id = config.pad_token_id
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(folder)
    return str(folder)


@pytest.mark.slow
def test_an_rm_reward_on_two_workers_is_scored_by_the_ranks_as_one_process_scores_it(ray_session, cli, tmp_path, tiny_model, prompts_file, monkeypatch):
    """`rm:` with --workers 2: every rank holds a replica of the reward model and scores its
    share of the samples (the controller loads none), alone or beside a reference the ranks
    hold; the rewards are one process's, and each rank writes its part."""
    from rlctl import rewards

    rm = a_reward_model(tiny_model, tmp_path / "rm")
    assert cli("rollout", "--prompts", prompts_file, "--model", tiny_model, "--out", tmp_path / "r", "--n", "3", "--max-new-tokens", "5").exit_code == 0
    assert cli("score", "--rollouts", tmp_path / "r", "--out", tmp_path / "local", "--reward", f"rm:{rm}").exit_code == 0
    want = shards.read(str(tmp_path / "local")).table.column("reward").to_pylist()

    def not_here(self, *args, **kwargs):
        raise AssertionError("the controller loaded the reward model: the ranks hold it")

    monkeypatch.setattr(rewards.RewardModel, "__init__", not_here)
    for name, extra in (("alone", []), ("beside_ref", ["--ref", tiny_model])):
        result = cli("score", "--rollouts", tmp_path / "r", "--out", tmp_path / name, "--reward", f"rm:{rm}", "--workers-backend", "ray", "--workers", "2", *extra)
        assert result.exit_code == 0, (name, result.stderr)
        got = shards.read(str(tmp_path / name)).table.column("reward").to_pylist()
        assert len(got) == 9 and max(abs(a - b) for a, b in zip(got, want)) < 1e-5, name
        assert [f.rows for f in shards.read_manifest(str(tmp_path / name))[0].files] == [5, 4]  # each rank wrote its part
        assert rm in [i.uri for i in shards.read_manifest(str(tmp_path / name))[0].inputs]
    again = cli("score", "--rollouts", tmp_path / "r", "--out", tmp_path / "alone", "--reward", f"rm:{rm}", "--workers-backend", "ray", "--workers", "2")
    assert again.exit_code == 0 and "skipped" in again.stderr


@pytest.mark.slow
def test_a_pipeline_on_two_workers_scores_its_rm_reward_on_the_ranks_and_replays_it_identical(ray_session, cli, tmp_path, tiny_model, monkeypatch):
    """The pipeline's ranks hold the `rm:` model beside the policy (the controller loads none):
    its score and validation stages are scored there, and replay scores them there again,
    bit for bit."""
    from rlctl import rewards
    from tests.e2e.test_pipeline import write_config

    rm = a_reward_model(tiny_model, tmp_path / "rm")
    config_file = write_config(tmp_path, tiny_model, score={"reward": f"rm:{rm}"}, pipeline={"iterations": 1, "val_every": 1})

    def not_here(self, *args, **kwargs):
        raise AssertionError("the controller loaded the reward model: the ranks hold it")

    monkeypatch.setattr(rewards.RewardModel, "__init__", not_here)
    run = tmp_path / "run"
    result = cli("pipeline", config_file, "--run-dir", run, "--quiet", "--set", "workers.backend=ray", "--set", "workers.num_workers=2")
    assert result.exit_code == 0, result.stderr
    scored = shards.read(str(run / "iter-0001" / "score")).table.column("reward").to_pylist()
    assert len(scored) == 6 and len(set(scored)) > 1  # a model's scores, not a constant
    for stage in ("score", "val"):
        replayed = cli("replay", run / "iter-0001" / stage, "--check")
        assert replayed.exit_code == 0 and replayed.stdout.strip() == "identical", (stage, replayed.stdout, replayed.stderr)


def test_a_sharded_reference_scores_what_a_replicated_one_does(ray_session, cli, tmp_path, tiny_model, prompts_file):
    """1/N of the reference per rank at rest, gathered for the call: the same log-probs; a rank
    with no rows (one row over two ranks) still takes part in the gather."""
    one = tmp_path / "one.jsonl"
    one.write_text(Path(prompts_file).read_text().splitlines()[0] + "\n")
    for name, prompts, n in (("r", prompts_file, "3"), ("r1", one, "1")):
        assert cli("rollout", "--prompts", prompts, "--model", tiny_model, "--out", tmp_path / name, "--n", n, "--max-new-tokens", "5").exit_code == 0
        scored = {}
        for reference in ("replicated", "sharded"):
            out = tmp_path / f"{name}-{reference}"
            result = cli(
                "score", "--rollouts", tmp_path / name, "--out", out, "--reward", "builtin:length", "--ref", tiny_model,
                "--workers-backend", "ray", "--workers", "2", "--set", f"workers.reference={reference}",
            )
            assert result.exit_code == 0, result.stderr
            scored[reference] = shards.read(str(out)).table.column("ref_logprobs").to_pylist()
        pairs = [(x, y) for a, b in zip(scored["replicated"], scored["sharded"]) for x, y in zip(a, b)]
        assert pairs and max(abs(x - y) for x, y in pairs) < 1e-6


@pytest.mark.slow
def test_a_part_written_by_a_worker_that_then_died_is_never_committed(tmp_path, tiny_model, prompts_file):
    from tests.e2e.test_pipeline import rlctl

    out = tmp_path / "r"
    args = ["rollout", "--prompts", prompts_file, "--model", tiny_model, "--out", out, "--n", "2", "--max-new-tokens", "4", "--workers-backend", "ray", "--workers", "2"]
    died = rlctl(*args, env={"RLCTL_FAULT_KILL_AT": "rank-1:rollouts-part-written"}, check=False)
    assert died.returncode == 1 and "worker rank 1" in died.stderr.strip().splitlines()[-1], died.stderr[-2000:]
    assert not out.exists() or not any(out.iterdir())  # its part, and rank 0's, went with the uncommitted write
    rlctl(*args)
    assert shards.read(str(out), "rollouts").table.num_rows == 6


@pytest.mark.slow
def test_a_worker_that_aborts_in_native_code_shows_its_last_output_above_the_error(tmp_path, tiny_model, prompts_file):
    from tests.e2e.test_pipeline import rlctl

    args = ["rollout", "--prompts", prompts_file, "--model", tiny_model, "--out", tmp_path / "r", "--n", "2", "--max-new-tokens", "4", "--workers-backend", "ray", "--workers", "2"]
    aborted = rlctl(*args, env={"RLCTL_FAULT_ABORT_AT": "rank-1:rollouts-part-written"}, check=False)
    assert aborted.returncode == 1
    *above, line = aborted.stderr.strip().splitlines()
    assert "worker rank 1 (pid" in line and "died during rollout_part" in line, aborted.stderr[-3000:]
    shown = "\n".join(above)
    assert "the last output of worker rank 1" in shown and "fault injected: abort at rank-1:rollouts-part-written" in shown
    assert "Fatal Python error: Aborted" in shown and "in _write_part" in shown  # the fault handler's stack of the rank's threads


def test_a_dead_workers_last_output_is_the_end_of_its_stderr_file(tmp_path):
    from rlctl.workers.ray import LAST_OUTPUT_LINES, last_output

    lines = [f"line {i}" for i in range(LAST_OUTPUT_LINES + 5)] + ["", "malloc(): unaligned tcache chunk detected", "Fatal Python error: Aborted", ""]
    (tmp_path / "worker-0a1b-01000000-4242.err").write_text("\n".join(lines))
    (tmp_path / "worker-9f8e-01000000-4243.err").write_text("another rank's output\n")
    (tmp_path / "worker-0a1b-01000000-4242.out").write_text("stdout is not shown\n")
    file, text = last_output(str(tmp_path), 4242)
    assert file.name == "worker-0a1b-01000000-4242.err"
    assert text.splitlines()[-2:] == ["malloc(): unaligned tcache chunk detected", "Fatal Python error: Aborted"]
    assert len(text.splitlines()) == LAST_OUTPUT_LINES and "line 4" not in text.splitlines()
    (tmp_path / "worker-7c6d-01000000-4244.err").write_text("\n\n")
    assert last_output(str(tmp_path), 4244) is None  # nothing written
    assert last_output(str(tmp_path), 4245) is None and last_output(str(tmp_path), "?") is None and last_output(None, 4242) is None


def test_two_workers_train_the_lora_adapter_one_process_trains(ray_session, tiny_model, gae_batch, tmp_path, monkeypatch):
    from rlctl.config import LoraConfig
    from rlctl.workers import make_workers

    monkeypatch.setenv("RLCTL_SHARE_PROMPTS", "always")  # GRPO-style groups through the adapter too

    batch = TrainBatch.from_table(shards.read(gae_batch, "batch").table)
    lora = LoraConfig(r=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
    adapters = {}
    for name, backend, n in (("local", "local", 1), ("ray1", "ray", 1), ("ray2", "ray", 2)):
        cfg = config(tiny_model, workers=n, backend=backend, lora=lora)
        cfg = replace(cfg, model=replace(cfg.model, ref=tiny_model))
        workers = make_workers(cfg, policy_source=tiny_model, critic_source=tiny_model)
        try:
            workers.trainer.train(batch)
            workers.hand_over_weights()
            workers.save(str(tmp_path / name), Manifest(stage="test"), None)
        finally:
            workers.close()
        adapters[name] = load_file(str(tmp_path / name / "adapter_model.safetensors"))
    for name in ("ray1", "ray2"):
        assert adapters[name].keys() == adapters["local"].keys()
        worst = max(float((adapters[name][k] - adapters["local"][k]).abs().max()) for k in adapters["local"])
        assert worst < SPLIT_ROUNDING, (name, worst)
    assert max(float(v.abs().max()) for k, v in adapters["local"].items() if "lora_B" in k) > 1e-4  # the adapter trained


@pytest.mark.slow
def test_split_pools_of_two_ranks_resume_and_train_what_one_process_trains(tmp_path, tiny_model):
    """Policy, reference and critic each on 2 FSDP2 ranks (6 processes); the critic's optimizer
    state goes into the checkpoint from its own pool and comes back on resume."""
    from tests.e2e.test_pipeline import final_weights, metrics_without_timings, rlctl, write_config

    config_file = write_config(tmp_path, tiny_model, pipeline={"iterations": 2, "val_every": 0})
    split = ["--quiet", "--workers-backend", "ray", "--workers", "2", "--set", "workers.placement=split"]
    first = rlctl("pipeline", config_file, "--run-dir", tmp_path / "split", "--iterations", "1", *split)
    assert "the reference and the critic in pools of their own: 3× the ranks" in first.stderr
    rlctl("pipeline", config_file, "--run-dir", tmp_path / "split", *split)  # resumed from iteration 1's checkpoint
    rlctl("pipeline", config_file, "--run-dir", tmp_path / "local", "--quiet")
    for ours, theirs in zip(metrics_without_timings(tmp_path / "split"), metrics_without_timings(tmp_path / "local"), strict=True):
        for key in ("reward_mean", "kl", "pg_loss", "vf_loss", "grad_norm"):
            assert ours[key] == pytest.approx(theirs[key], abs=1e-5), key
    expected, got = final_weights(tmp_path / "local"), final_weights(tmp_path / "split")
    diffs = torch.cat([(expected[k] - got[k]).abs().reshape(-1) for k in expected])
    # Adam normalises each step: a weight whose gradient is ~0 may move by a different fraction
    # of lr (1e-3) on float noise; the weights as a whole agree
    assert float(diffs.max()) < 1e-3 and float(diffs.mean()) < 1e-6


def test_a_stage_records_the_ranks_setting_where_they_agree_and_each_ranks_where_not():
    from rlctl.workers.ray import agreed_settings

    same = [{"torch_threads": 2, "mkl_kernels": "intel"}] * 3
    assert agreed_settings(same) == {"torch_threads": 2, "mkl_kernels": "intel"}
    hosts = [{"torch_threads": 2, "mkl_kernels": "intel"}, {"torch_threads": 2, "mkl_kernels": "default"}]
    assert agreed_settings(hosts) == {"torch_threads": 2, "mkl_kernels": ["intel", "default"]}


def test_two_workers_fine_tune_as_one_process_does(ray_session, tiny_model, tmp_path):
    """`rlctl sft` on two FSDP2 ranks: each takes its share of every step's examples (an odd
    count: one rank runs an empty pass), the losses are the group's sums, rank 0 writes the
    weights without a trainer state."""
    from rlctl import sft

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(f'{{"prompt": "Question {i}: count to {i}", "response": "{" ".join(map(str, range(i + 1)))}"}}\n' for i in range(7)))
    settings = ["sft.epochs=2", "sft.lr=1e-3", "sft.batch_size=4", "sft.micro_batch_size=1", "sft.bf16=false", "model.device=\"cpu\""]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker (cpus_per_worker = 1)
    try:
        local = sft.run(data=str(data), val_data=str(data), model=tiny_model, out=str(tmp_path / "local"), cfg=load_config(None, settings), device="cpu")
    finally:
        torch.set_num_threads(threads)
    ray_cfg = load_config(None, [*settings, 'workers.backend="ray"', "workers.num_workers=2"])
    on_ranks = sft.run(data=str(data), val_data=str(data), model=tiny_model, out=str(tmp_path / "ray"), cfg=ray_cfg, device="cpu")
    for ours, theirs in zip(on_ranks.state["epochs"], local.state["epochs"]):
        assert ours["epoch"] == theirs["epoch"] and ours.get("steps") == theirs.get("steps")
        for key in ("loss", "val_loss"):
            if key in theirs:
                assert abs(ours[key] - theirs[key]) < 1e-4, (key, ours, theirs)
    got, want = load_file(str(tmp_path / "ray" / "model.safetensors")), load_file(str(tmp_path / "local" / "model.safetensors"))
    assert max(float((got[k] - want[k]).abs().max()) for k in want) < SPLIT_ROUNDING
    assert not (tmp_path / "ray" / "trainer_state").exists() and on_ranks.state["workers"]["num_workers"] == 2


@pytest.mark.parametrize("lora", [0, 4])
def test_two_workers_train_a_reward_model_as_one_process_does(ray_session, tiny_model, tmp_path, lora):
    """`rlctl reward-model` on two FSDP2 ranks: each takes its share of every step's pairs (an
    odd count: one rank runs an empty pass), loss, accuracy and margin are the group's sums;
    stopped after an epoch it resumes from its epoch checkpoint; rank 0 writes the gathered
    weights with the new head (a LoRA model's adapters merged), which `rm:` scores with."""
    from rlctl import reward_model
    from rlctl.rewards import RewardModel

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Type a number: {i}", "chosen": f"{7 * i + 3}", "rejected": "no" if i % 2 else "maybe so"}) + "\n" for i in range(7)))
    settings = [
        "reward_model.epochs=2", "reward_model.lr=1e-3", "reward_model.batch_size=4", "reward_model.micro_batch_size=1",
        "reward_model.center_coef=0.01", "reward_model.bf16=false", "model.device=\"cpu\"", f"reward_model.lora.r={lora}",
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker (cpus_per_worker = 1)
    try:
        local = reward_model.run(data=str(data), val_data=str(data), model=tiny_model, out=str(tmp_path / "local"), cfg=load_config(None, settings), device="cpu")
    finally:
        torch.set_num_threads(threads)
    ray_cfg = load_config(None, [*settings, 'workers.backend="ray"', "workers.num_workers=2"])
    with pytest.raises(Stopped):  # after epoch 1's checkpoint (a LoRA model's adapters and head as trained): the run resumes there
        reward_model.run(data=str(data), val_data=str(data), model=tiny_model, out=str(tmp_path / "ray"), cfg=ray_cfg, device="cpu", report=stop_in_epoch_2)
    assert shards.read_manifest(str(tmp_path / "ray.progress" / "epoch-0001"))[0].state["epoch"] == 1
    on_ranks = reward_model.run(data=str(data), val_data=str(data), model=tiny_model, out=str(tmp_path / "ray"), cfg=ray_cfg, device="cpu")
    assert not (tmp_path / "ray.progress").exists()
    assert len(on_ranks.state["epochs"]) == len(local.state["epochs"]) == 3  # before training, then 2 epochs
    for ours, theirs in zip(on_ranks.state["epochs"], local.state["epochs"]):
        assert ours["epoch"] == theirs["epoch"] and ours.get("steps") == theirs.get("steps") and ours.get("pairs") == theirs.get("pairs")
        for key in ("loss", "accuracy", "margin", "val_loss", "val_accuracy"):
            if key in theirs:
                assert abs(ours[key] - theirs[key]) < 1e-4, (key, ours, theirs)
    assert on_ranks.state["optimizer_steps"] == local.state["optimizer_steps"] == 4
    got, want = load_file(str(tmp_path / "ray" / "model.safetensors")), load_file(str(tmp_path / "local" / "model.safetensors"))
    assert got.keys() == want.keys() and any(k.startswith("score.") for k in want)
    assert max(float((got[k] - want[k]).abs().max()) for k in want) < SPLIT_ROUNDING
    assert on_ranks.state["workers"]["num_workers"] == 2 and not (tmp_path / "ray" / "trainer_state").exists()
    scores = [RewardModel(str(tmp_path / folder), device="cpu")(prompts=["Type a number: 2"], responses=["17"]) for folder in ("ray", "local")]
    assert abs(scores[0][0] - scores[1][0]) < 1e-4


@pytest.mark.parametrize("moving", [[], ["kto.ref_sync_every=1", "kto.ref_sync_alpha=0.5"]], ids=["fixed", "moving"])
def test_two_workers_train_kto_as_one_process_does(ray_session, tiny_model, tmp_path, moving):
    """`rlctl kto` on two FSDP2 ranks: the reference's log-probabilities (of the responses and
    of the mismatched pairs) computed once and shared; each step's reference point is the
    group's mean, each rank its share of every step's examples (an odd count: one rank runs an
    empty pass). A moving reference (TR-KTO) is mixed on each rank's shards and swapped in for
    its forwards, as in one process."""
    from rlctl import kto
    from tests.unit.test_kto import number_examples

    data = tmp_path / "kto.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in number_examples(9)))
    settings = ["kto.epochs=2", "kto.lr=1e-4", "kto.batch_size=4", "kto.micro_batch_size=1", "kto.bf16=false", "kto.beta=0.5", "model.device=\"cpu\"", *moving]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker (cpus_per_worker = 1)
    try:
        local = kto.run(data=str(data), val_data=str(data), model=tiny_model, out=str(tmp_path / "local"), cfg=load_config(None, settings), device="cpu")
    finally:
        torch.set_num_threads(threads)
    ray_cfg = load_config(None, [*settings, 'workers.backend="ray"', "workers.num_workers=2"])
    on_ranks = kto.run(data=str(data), val_data=str(data), model=tiny_model, out=str(tmp_path / "ray"), cfg=ray_cfg, device="cpu")
    assert len(on_ranks.state["epochs"]) == len(local.state["epochs"]) == 3
    for ours, theirs in zip(on_ranks.state["epochs"], local.state["epochs"]):
        assert ours["epoch"] == theirs["epoch"] and ours.get("steps") == theirs.get("steps")
        for key in ("loss", "kl", "margin", "desirable_reward", "val_loss", "val_margin"):
            if key in theirs:
                assert abs(ours[key] - theirs[key]) < 1e-4, (key, ours, theirs)
    assert local.state["epochs"][-1]["val_margin"] > local.state["epochs"][0]["val_margin"]
    assert any(row.get("kl", 0) > 0 for row in local.state["epochs"])  # a reference point above 0: the ranks' shares of it summed
    got, want = load_file(str(tmp_path / "ray" / "model.safetensors")), load_file(str(tmp_path / "local" / "model.safetensors"))
    assert max(float((got[k] - want[k]).abs().max()) for k in want) < SPLIT_ROUNDING
    assert on_ranks.state["workers"]["num_workers"] == 2
    assert on_ranks.state.get("ref_syncs") == local.state.get("ref_syncs") == (6 if moving else None)


@pytest.mark.parametrize("moving", [
    [], ["dpo.ref_sync_every=1", "dpo.ref_sync_alpha=0.5"], ["dpo.use_weighting=true", "dpo.ld_alpha=0.5", "dpo.f_divergence=\"js_divergence\""],
], ids=["fixed", "moving", "weighted"])
def test_two_workers_train_dpo_as_one_process_does(ray_session, tiny_model, tmp_path, moving):
    """`rlctl dpo` on two FSDP2 ranks: the reference's log-probabilities computed once, each rank
    its share and every rank all of them; each takes its share of every step's pairs (an odd
    count: one rank runs an empty pass); stopped after an epoch it resumes from its epoch
    checkpoint (gathered weights and optimizer state); rank 0 writes the weights without a
    trainer state. WPO's weights (Σπ² from each rank's forward) and LD-DPO's token weights in
    every pass, an empty one's too, give one process's result. A moving reference (TR-DPO) is
    mixed on each rank's shards, swapped in for its forward, gathered into the epoch checkpoint
    and scattered again on the resume."""
    from rlctl import dpo

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Type a number: {i}", "chosen": f"{7 * i + 3}", "rejected": "no" if i % 2 else "maybe so"}) + "\n" for i in range(7)))
    settings = ["dpo.epochs=2", "dpo.lr=1e-3", "dpo.batch_size=4", "dpo.micro_batch_size=1", "dpo.bf16=false", "model.device=\"cpu\"", *moving]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker (cpus_per_worker = 1)
    try:
        local = dpo.run(data=str(data), val_data=str(data), model=tiny_model, out=str(tmp_path / "local"), cfg=load_config(None, settings), device="cpu")
    finally:
        torch.set_num_threads(threads)
    ray_cfg = load_config(None, [*settings, 'workers.backend="ray"', "workers.num_workers=2", "dpo.save_steps=1"])  # 2 steps an epoch: a checkpoint mid-epoch too
    with pytest.raises(Stopped):  # in epoch 2's report, after its mid-epoch checkpoint: the run resumes there
        dpo.run(data=str(data), val_data=str(data), model=tiny_model, out=str(tmp_path / "ray"), cfg=ray_cfg, device="cpu", report=stop_in_epoch_2)
    progress = shards.read_manifest(str(tmp_path / "ray.progress" / "epoch-0001-step-000001"))[0].state  # the last one: a step into epoch 2
    assert (progress["epoch"], progress["step"], progress["tally"]["steps"]) == (1, 1, 1)
    on_ranks = dpo.run(data=str(data), val_data=str(data), model=tiny_model, out=str(tmp_path / "ray"), cfg=ray_cfg, device="cpu")
    assert not (tmp_path / "ray.progress").exists()  # resumed: the ranks loaded the weights, the optimizer state and the kept reference
    assert len(on_ranks.state["epochs"]) == len(local.state["epochs"]) == 3
    for ours, theirs in zip(on_ranks.state["epochs"], local.state["epochs"]):
        assert ours["epoch"] == theirs["epoch"] and ours.get("steps") == theirs.get("steps")
        for key in ("loss", "accuracy", "margin", "chosen_reward", "val_loss", "val_accuracy"):
            if key in theirs:
                assert abs(ours[key] - theirs[key]) < 1e-4, (key, ours, theirs)
    got, want = load_file(str(tmp_path / "ray" / "model.safetensors")), load_file(str(tmp_path / "local" / "model.safetensors"))
    assert max(float((got[k] - want[k]).abs().max()) for k in want) < SPLIT_ROUNDING
    assert not (tmp_path / "ray" / "trainer_state").exists() and on_ranks.state["workers"]["num_workers"] == 2
    assert on_ranks.state.get("ref_syncs") == local.state.get("ref_syncs") == (4 if "dpo.ref_sync_every=1" in moving else None)


@pytest.mark.parametrize("placement,reference,workers", [
    pytest.param("colocate", "replicated", 2, marks=pytest.mark.slow), ("colocate", "sharded", 2), pytest.param("split", "replicated", 1, marks=pytest.mark.slow),
])
def test_ranks_score_with_a_reference_loaded_in_place_of_the_first(ray_session, tmp_path, tiny_model, placement, reference, workers):
    """pipeline.ref_sync_every's reload: every rank holding the reference (a replica, FSDP2
    shards, or the reference's own pool) scores with the new one as one process does."""
    from rlctl.backends.hf import HFPolicy
    from rlctl.modelinit import init_model
    from rlctl.workers import worker_group

    other = str(init_model(tmp_path / "other", "tiny", seed=1))
    prompts, responses = [[5, 6, 7], [8, 9], [10, 11, 12, 13]], [[20, 21, 22], [23], [24, 25]]
    policy = tiny_model if placement == "split" else None
    settings = WorkersConfig(backend="ray", num_workers=workers, placement=placement, reference=reference)
    with worker_group(settings, policy=policy, ref=tiny_model) as group:
        before = group.ref.logprobs(prompts, responses, temperature=1.0)
        group.load_reference(other)
        after = group.ref.logprobs(prompts, responses, temperature=1.0)
    expected = HFPolicy.load(other, "cpu").logprobs(prompts, responses, temperature=1.0)
    pairs = [(x, y) for a, b in zip(after, expected) for x, y in zip(a, b)]
    assert max(abs(x - y) for x, y in pairs) < 1e-6
    assert max(abs(x - y) for a, b in zip(before, after) for x, y in zip(a, b)) > 1e-3


@pytest.mark.slow
def test_two_workers_drop_the_prompts_one_process_drops_and_sample_the_rest_as_it_does(ray_session, cli, tmp_path, tiny_model, prompts_file):
    args = ("rollout", "--prompts", prompts_file, "--model", tiny_model, "--n", "2", "--max-new-tokens", "5", "--seed", "4", "--max-prompt-tokens", "6", "--truncate", "drop")
    one = cli(*args, "--out", tmp_path / "one")
    two = cli(*args, "--out", tmp_path / "two", "--workers-backend", "ray", "--workers", "2")
    assert one.exit_code == 0 and two.exit_code == 0, two.stderr
    assert "left out 1 of 3 prompts over max_prompt_tokens=6: 'p1'" in two.stderr
    ray, local = shards.read(str(tmp_path / "two")).table, shards.read(str(tmp_path / "one")).table
    assert ray.drop_columns(["rollout_logprobs"]).equals(local.drop_columns(["rollout_logprobs"]))  # the same rows and tokens
    pairs = zip(ray.column("rollout_logprobs").to_pylist(), local.column("rollout_logprobs").to_pylist())
    assert max(abs(x - y) for a, b in pairs for x, y in zip(a, b)) < 1e-5  # a pass of other rows: fp32 rounding



def test_two_workers_stop_an_update_at_the_target_kl_where_one_process_does(ray_session, tiny_model, gae_batch, tmp_path, monkeypatch):
    """update.target_kl on FSDP2 ranks: the KL that decides is the group's sum, so every rank
    stops at the step one process stops at (a rank that went on would hang the others)."""
    from rlctl.trainer import Trainer

    batch = TrainBatch.from_table(shards.read(gae_batch, "batch").table)
    kls = []
    measured = Trainer.accumulate_gradients

    def record(self, rows, indices):
        stats = measured(self, rows, indices)
        kls.append(stats["approx_kl"])
        return stats

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with monkeypatch.context() as patched:
            patched.setattr(Trainer, "accumulate_gradients", record)
            every = trained_weights(config(tiny_model, workers=1, backend="local", target_kl=1e9), tiny_model, batch, tmp_path / "every")
        assert len(kls) == 4  # 2 epochs of 2 mini-batches
        stop = max(j for j in range(1, 4) if kls[j] > 1.01 * max(kls[:j]))  # a step clearly past every one before it
        target = (kls[stop] + max(kls[:stop])) / 2 / 1.5
        local = trained_weights(config(tiny_model, workers=1, backend="local", target_kl=target), tiny_model, batch, tmp_path / "local")
    finally:
        torch.set_num_threads(threads)
    assert max(float((every[k] - local[k]).abs().max()) for k in local) > 1e-4  # it stopped: fewer steps
    got = trained_weights(config(tiny_model, workers=2, target_kl=target), tiny_model, batch, tmp_path / "ray")
    assert max(float((got[k] - local[k]).abs().max()) for k in local) < SPLIT_ROUNDING


def test_two_workers_train_vespo_with_the_off_policy_mask_unbiased_kl_and_entropy_control_as_one_process_does(ray_session, tiny_model, gae_batch, tmp_path):
    """The policy-loss settings of TRL's GRPOTrainer on FSDP2 ranks: the same update as one
    process, and the adaptive entropy controller's state in the checkpoint the same (each rank
    moves it by the group's entropy)."""
    import json

    batch = TrainBatch.from_table(shards.read(gae_batch, "batch").table)
    settings = {
        "policy_loss": "vespo", "off_policy_mask": 0.01, "use_kl_loss": True, "kl_loss_unbiased": True, "kl_loss_coef": 0.1,
        "entropy_target": 100.0, "entropy_coef": 0.01, "entropy_coef_delta": 0.01,
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        local = trained_weights(config(tiny_model, workers=1, backend="local", **settings), tiny_model, batch, tmp_path / "local")
    finally:
        torch.set_num_threads(threads)
    got = trained_weights(config(tiny_model, workers=2, **settings), tiny_model, batch, tmp_path / "ray")
    assert max(float((got[k] - local[k]).abs().max()) for k in local) < SPLIT_ROUNDING
    controls = [json.loads((tmp_path / name / "trainer_state" / "state.json").read_text())["entropy_control"] for name in ("local", "ray")]
    assert controls[0]["coef"] == controls[1]["coef"] == pytest.approx(0.01 + 4 * 0.01)  # 2 epochs × 2 mini-batches, each below the target
    assert controls[1]["last_entropy"] == pytest.approx(controls[0]["last_entropy"], rel=1e-5)
