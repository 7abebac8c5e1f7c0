"""pipeline.time_limit: a run stops with a checkpoint before its next iteration would pass the
limit (a job scheduler's wall-clock limit), exit 0, and the same command resumes it to the end
exactly as a run that never stopped."""

import json

import pytest

from rlctl.durations import describe_duration, parse_duration
from rlctl.threads import available_cpus
from tests.conftest import assert_same_metrics, metrics_without_timings


@pytest.mark.parametrize(("text", "seconds"), [("3h50m", 13800.0), ("90m", 5400.0), ("45s", 45.0), ("1h30m15s", 5415.0), ("1.5h", 5400.0), ("600", 600.0)])
def test_durations_read_as_people_write_them(text, seconds):
    assert parse_duration(text) == seconds
    assert parse_duration(describe_duration(seconds)) == seconds


@pytest.mark.parametrize("text", ["", "m", "3m2h", "3h3h", "3 h", "-5", "soon"])
def test_what_is_not_a_duration_reads_as_none(text):
    assert parse_duration(text) is None


@pytest.fixture
def config(tmp_path):
    prompts = [{"id": f"p{k}", "prompt": f"prompt {k}"} for k in range(4)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    (tmp_path / "limit.toml").write_text(
        '[model]\ninit_preset = "tiny"\npath = "model"\n'
        '[data]\nprompts = "prompts.jsonl"\nbatch_size = 2\n'
        '[rollout]\nn = 2\nmax_new_tokens = 6\n'
        '[update]\nlr = 1e-3\nmicro_batch_size = 4\n'
        '[pipeline]\niterations = 3\nsave_every = 10\n'  # without the limit: one checkpoint, at the end
        f'[workers]\nthreads = {available_cpus()}\n'  # the resume is compared bit for bit: a fixed thread count
    )
    return tmp_path / "limit.toml"


def test_a_run_out_of_time_checkpoints_stops_and_resumes_to_the_same_end(cli, tmp_path, config):
    run = tmp_path / "run"
    stopped = cli("pipeline", config, "--run-dir", run, "--quiet", "--set", "pipeline.time_limit=0.01s")  # one iteration alone takes longer
    assert stopped.exit_code == 0, stopped.stderr
    assert "rlctl: iteration 1: stopping within pipeline.time_limit = 0.01s (" in stopped.stderr and "checkpointed: the same command resumes here" in stopped.stderr
    assert len(metrics_without_timings(run)) == 1 and (run / "checkpoints" / "iter-0001" / "_manifest.json").exists()
    resumed = cli("pipeline", config, "--run-dir", run, "--quiet", "--set", "pipeline.time_limit=1h")  # the limit is not training config
    assert resumed.exit_code == 0, resumed.stderr
    assert "time_limit" not in resumed.stderr

    whole = tmp_path / "whole"
    assert cli("pipeline", config, "--run-dir", whole, "--quiet").exit_code == 0
    assert_same_metrics(run, whole)
    assert len(metrics_without_timings(whole)) == 3


def test_a_time_limit_that_is_not_a_duration_is_refused_before_any_work(cli, tmp_path, config):
    result = cli("pipeline", config, "--run-dir", tmp_path / "run", "--set", "pipeline.time_limit=3 hours")
    assert result.exit_code == 2 and not (tmp_path / "run").exists()
    assert result.stderr.strip().splitlines()[-1].endswith("pipeline.time_limit must be a duration above 0 like 3h50m, 90m, 45s or 3600 (seconds), got '3 hours'")
