"""DAPO's dynamic sampling in the pipeline: groups whose rewards are all equal are dropped, more
prompts are sampled until the batch is full, the prompt stream moves on by the rounds used
(also across a resume), and every round's stage replays identical."""

import json

import pytest

from rlctl import shards
from rlctl.algos.sampling import groups_with_signal, select_groups
from rlctl.threads import available_cpus
from tests.conftest import assert_same_metrics

REWARD = '''
def reward(prompts, responses):
    """Prompts that say "same" give every sample 1.0 (no signal); the others reward length."""
    return [1.0 if "same" in p else float(len(r)) for p, r in zip(prompts, responses)]
'''


def test_groups_with_equal_rewards_are_dropped_and_the_batch_filled_in_order():
    rounds = [[1, 1, 0, 2], [3, 3, 5, 5]]  # groups of 2: round 1 = [equal, differ], round 2 = [equal, equal]
    assert groups_with_signal(rounds[0], 2) == [False, True]
    picked = select_groups(rounds, n=2, batch_prompts=2)
    assert (picked.kept, picked.dropped, picked.filled) == (1, 3, 1)
    assert picked.rows == [(0, 0), (0, 1), (0, 2), (0, 3)]  # the kept group and the first dropped one, in generation order
    assert select_groups([[0, 1, 2, 2, 4, 5]], n=2, batch_prompts=1).rows == [(0, 0), (0, 1)]  # the first groups with signal


@pytest.fixture
def config(tmp_path):
    (tmp_path / "reward.py").write_text(REWARD)
    prompts = [{"id": f"{kind}-{k}", "prompt": f"{kind} prompt {k}"} for k in range(6) for kind in ("same", "vary")]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    (tmp_path / "ds.toml").write_text(
        '[model]\ninit_preset = "tiny"\npath = "model"\n'
        '[data]\nprompts = "prompts.jsonl"\nbatch_size = 2\nshuffle = false\n'
        '[rollout]\nn = 3\nmax_new_tokens = 6\n'
        '[score]\nreward = "reward.py:reward"\n'
        '[advantage]\nestimator = "grpo"\n'
        '[update]\nlr = 1e-3\nmicro_batch_size = 6\n'
        '[pipeline]\niterations = 2\ndynamic_sampling = true\nmax_sampling_rounds = 3\n'
        f'[workers]\nthreads = {available_cpus()}\n'  # the resume below is compared bit for bit: a fixed thread count
    )
    return tmp_path / "ds.toml"


def test_a_pipeline_with_dynamic_sampling_trains_only_on_groups_with_signal(cli, tmp_path, config):
    run = tmp_path / "run"
    result = cli("pipeline", config, "--run-dir", run, "--quiet")
    assert result.exit_code == 0, result.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # each round of 2 prompts holds one "same" and one "vary" prompt: two rounds fill a batch of 2
    assert [r["dynamic_sampling/rounds"] for r in rows] == [2, 2]
    assert all(r["dynamic_sampling/groups_kept"] == 2 and r["dynamic_sampling/groups_filled"] == 0 for r in rows)
    batch = shards.read(str(run / "iter-0001" / "filter"), "scores").table
    assert batch.column("id").to_pylist() == ["vary-0"] * 3 + ["vary-1"] * 3
    assert shards.read(str(run / "iter-0001" / "advantage"), "batch").table.num_rows == 6
    # the stream moved on by the rounds used: iteration 2 starts at prompt 4
    assert shards.read(str(run / "iter-0002" / "prompts")).table.column("id").to_pylist() == ["same-2", "vary-2"]
    for stage in ("prompts-r2", "rollout-r2", "score-r2", "filter", "advantage"):
        replayed = cli("replay", run / "iter-0002" / stage, "--check", "--trust-run-code")
        assert replayed.exit_code == 0 and "identical" in replayed.stdout, (stage, replayed.stdout, replayed.stderr)

    resumed = tmp_path / "resumed"
    assert cli("pipeline", config, "--run-dir", resumed, "--quiet", "--iterations", "1").exit_code == 0
    assert cli("pipeline", config, "--run-dir", resumed, "--quiet").exit_code == 0
    assert_same_metrics(resumed, run)


CORRECT_BUT_LONGER = '''
def reward(prompts, responses):
    """Prompts that say "same": every sample is correct (acc 1), its score 1 plus a length bonus
    that makes the totals differ; the others: acc and score the length."""
    return [{"score": 1.0 + len(r) / 100, "acc": 1.0} if "same" in p else {"score": float(len(r)), "acc": float(len(r))} for p, r in zip(prompts, responses)]
'''


def test_dynamic_sampling_on_a_reported_metric_drops_the_groups_whose_metric_is_equal_though_their_rewards_differ(cli, tmp_path, config):
    """pipeline.dynamic_sampling_metric = "reward/acc" (verl's filter_groups.metric): the "same"
    groups, all correct, are dropped although a length bonus makes their rewards differ; the
    filter replays identical. A metric the scores do not have is one line, exit 2."""
    (tmp_path / "reward.py").write_text(CORRECT_BUT_LONGER)
    run = tmp_path / "run"
    result = cli("pipeline", config, "--run-dir", run, "--quiet", "--set", 'pipeline.dynamic_sampling_metric="reward/acc"')
    assert result.exit_code == 0, result.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["dynamic_sampling/groups_kept"] == 2 and r["dynamic_sampling/groups_filled"] == 0 for r in rows)
    for i in (1, 2):
        batch = shards.read(str(run / f"iter-{i:04d}" / "filter"), "scores").table
        assert all(key.startswith("vary") for key in batch.column("id").to_pylist())
    dropped = [shards.read(str(run / "iter-0001" / name), "scores").table.to_pylist() for name in ("score", "score-r2")]
    same_totals = [[row["reward"] for row in table if row["id"].startswith("same")] for table in dropped]
    assert any(len(set(totals)) > 1 for totals in same_totals)  # by the total reward these groups had signal
    replayed = cli("replay", run / "iter-0002" / "filter", "--check", "--trust-run-code")
    assert replayed.exit_code == 0 and "identical" in replayed.stdout, replayed.stderr
    missing = cli("pipeline", config, "--run-dir", tmp_path / "other", "--quiet", "--set", 'pipeline.dynamic_sampling_metric="reward/accuracy"')
    assert missing.exit_code == 2 and "pipeline.dynamic_sampling_metric = reward/accuracy: the scores have no such column (they have reward, reward/acc)" in missing.stderr
    wrong = cli("pipeline", config, "--run-dir", tmp_path / "other", "--set", 'pipeline.dynamic_sampling_metric="acc"')
    assert wrong.exit_code == 2 and "reward or a reward/... column" in wrong.stderr
