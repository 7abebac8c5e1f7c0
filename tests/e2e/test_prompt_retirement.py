"""data.retire_pass_rate in the pipeline (Skywork-OR1's online difficulty filtering): a prompt
whose samples all pass is left out of the epochs after its iteration, the run resumes and
replays the same draw, and a run that retires every prompt ends there."""

import json

import pytest

from rlctl import shards
from rlctl.threads import available_cpus
from tests.conftest import assert_same_metrics

REWARD = '''
def reward(prompts, responses):
    """Prompts that say "easy" are solved by every sample (1.0); the others score below 1."""
    return [1.0 if "easy" in p else len(r) / 1000 for p, r in zip(prompts, responses)]
'''


@pytest.fixture
def config(tmp_path):
    (tmp_path / "reward.py").write_text(REWARD)
    prompts = [{"id": f"{kind}-{k}", "prompt": f"{kind} prompt {k}"} for k in range(2) for kind in ("easy", "hard")]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    (tmp_path / "retire.toml").write_text(
        '[model]\ninit_preset = "tiny"\npath = "model"\n'
        '[data]\nprompts = "prompts.jsonl"\nbatch_size = 2\nshuffle = false\nretire_pass_rate = 1.0\n'
        '[rollout]\nn = 2\nmax_new_tokens = 6\n'
        '[score]\nreward = "reward.py:reward"\n'
        '[update]\nlr = 1e-3\nmicro_batch_size = 4\n'
        '[pipeline]\niterations = 4\n'
        f'[workers]\nthreads = {available_cpus()}\n'  # the resume below is compared bit for bit: a fixed thread count
    )
    return tmp_path / "retire.toml"


def drawn_ids(run, i):
    return shards.read(str(run / f"iter-{i:04d}" / "prompts")).table.column("id").to_pylist()


def test_solved_prompts_leave_the_epochs_after_their_iteration_and_a_resume_draws_the_same(cli, tmp_path, config):
    run = tmp_path / "run"
    result = cli("pipeline", config, "--run-dir", run, "--quiet")
    assert result.exit_code == 0, result.stderr
    # epoch 0 keeps its 4 prompts though easy-0 is solved in iteration 1; epochs 1 and 2 hold the hard ones only
    assert [drawn_ids(run, i) for i in (1, 2, 3, 4)] == [["easy-0", "hard-0"], ["easy-1", "hard-1"], ["hard-0", "hard-1"], ["hard-0", "hard-1"]]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["prompts_retired"], r["prompts_retired_now"]) for r in rows] == [(1, 1), (2, 1), (2, 0), (2, 0)]
    assert shards.read_manifest(str(run / "checkpoints" / "iter-0004"))[0].state["pipeline"]["retired_prompts"] == {"easy-0": 1, "easy-1": 1}
    replayed = cli("replay", run / "iter-0003" / "prompts", "--check")
    assert replayed.exit_code == 0 and "identical" in replayed.stdout, (replayed.stdout, replayed.stderr)

    resumed = tmp_path / "resumed"
    assert cli("pipeline", config, "--run-dir", resumed, "--quiet", "--iterations", "2").exit_code == 0
    assert cli("pipeline", config, "--run-dir", resumed, "--quiet").exit_code == 0
    assert_same_metrics(resumed, run)


def test_a_run_that_retires_every_prompt_ends_checkpointed_and_a_resume_says_none_is_left(cli, tmp_path, config):
    run = tmp_path / "run"
    result = cli("pipeline", config, "--run-dir", run, "--quiet", "--set", "data.pass_threshold=0")  # every sample passes
    assert result.exit_code == 0, result.stderr
    assert ("rlctl: iteration 2: the training prompts left in play are fewer than a batch (data.retire_pass_rate = 1 retired the others: "
            "the policy passes them); the run ends here, checkpointed") in result.stderr
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2 and (run / "checkpoints" / "iter-0002" / "_manifest.json").exists()
    again = cli("pipeline", config, "--run-dir", run, "--quiet", "--set", "data.pass_threshold=0")
    assert again.exit_code == 2 and "Traceback" not in again.stderr
    assert again.stderr.strip().splitlines()[-1] == (
        "rlctl: error: every training prompt is retired by epoch 1 (data.retire_pass_rate): none is left to draw; "
        "the policy passes them all (lower data.retire_pass_rate, raise data.pass_threshold, or add harder prompts)"
    )
    assert not (run / "iter-0003" / "prompts" / "_manifest.json").exists()
