"""GDPO through the whole pipeline on a mixed dataset: each reward scores only its own
data_sources (`sources`), its column is null on the others, and the advantage normalizes each
reward within its group over the samples it applies to — what the unit tests' reference gives
from the score stage's own columns."""

import json

import pytest

from rlctl import shards
from tests.unit.test_advantages import ref_gdpo

REWARDS = '''
def digits(responses):
    return [float(sum(c.isdigit() for c in r)) for r in responses]


def vowels(responses):
    return [float(sum(c in "aeiou" for c in r)) for r in responses]
'''


def test_gdpo_with_rewards_restricted_to_their_sources_trains_on_each_sources_own_ranking(cli, tmp_path):
    (tmp_path / "rewards.py").write_text(REWARDS)
    prompts = [{"id": f"{source}-{k}", "prompt": f"{source} please {k}", "data_source": source} for k in range(2) for source in ("numbers", "words")]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    (tmp_path / "gdpo.toml").write_text(
        '[model]\ninit_preset = "tiny"\npath = "model"\n'
        '[data]\nprompts = "prompts.jsonl"\nbatch_size = 4\nshuffle = false\n'
        '[rollout]\nn = 4\nmax_new_tokens = 12\n'
        '[score]\nrewards = [{fn = "rewards.py:digits", sources = ["numbers"]}, {fn = "rewards.py:vowels", weight = 0.5, sources = ["words"]}]\n'
        '[advantage]\nestimator = "gdpo"\n'
        '[update]\nlr = 1e-3\nmicro_batch_size = 16\n'
        '[pipeline]\niterations = 2\n'
    )
    run = tmp_path / "run"
    result = cli("pipeline", tmp_path / "gdpo.toml", "--run-dir", run, "--quiet")
    assert result.exit_code == 0, result.stderr
    for i in (1, 2):
        score = shards.read(str(run / f"iter-{i:04d}" / "score"), "scores").table
        sources = score.column("data_source").to_pylist()
        digit_scores, vowel_scores = score.column("reward/digits").to_pylist(), score.column("reward/vowels").to_pylist()
        assert all((d is None) == (s == "words") and (v is None) == (s == "numbers") for d, v, s in zip(digit_scores, vowel_scores, sources))
        batch = shards.read(str(run / f"iter-{i:04d}" / "advantage"), "batch").table
        assert batch.column("id").to_pylist() == score.column("id").to_pylist()
        ids = score.column("id").to_pylist()
        groups = [sorted(set(ids)).index(key) for key in ids]
        expected = ref_gdpo([[d, v] for d, v in zip(digit_scores, vowel_scores)], [1.0, 0.5], groups)
        first_token = [row[0] for row in batch.column("advantages").to_pylist()]
        assert first_token == pytest.approx(expected, abs=1e-5) and max(map(abs, expected)) > 0.5  # signal on both sources' groups
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {"reward_mean/digits", "reward_mean/vowels"} <= set(rows[0])
    assert rows[0]["source/numbers/samples"] == rows[0]["source/words/samples"] == 8  # a mixed batch: each source's own reward and length too
    assert {"source/numbers/reward_mean", "source/words/response_length"} <= set(rows[0])
