"""Reward code written for verl or TRL runs unchanged; several rewards combine with weights."""

import textwrap

import pytest

from rlctl.config import RewardTerm, ScoreConfig, load_config
from rlctl.errors import ConfigError, InputError, RewardError
from rlctl.rewards import (
    RewardSamples,
    RewardSet,
    WeightedReward,
    compute_rewards,
    from_callable,
    load_rewards,
)


def samples(responses, truths=None, *, extras=None, messages=None):
    n = len(responses)
    return RewardSamples(
        [f"prompt {i}" for i in range(n)], list(responses), list(truths or [None] * n), ["gsm8k"] * n,
        extras or [{} for _ in range(n)], messages or [],
    )


def write_reward(tmp_path, body: str, name: str = "user_reward.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


# --- verl ------------------------------------------------------------------------------------


def test_verls_compute_score_is_called_per_sample_with_verls_names(tmp_path):
    path = write_reward(tmp_path, """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            assert isinstance(solution_str, str) and data_source == "gsm8k"
            return 1.0 if solution_str.endswith(ground_truth) else 0.0
    """)
    s = samples(["#### 42", "#### 7"], ["42", "8"])
    assert compute_rewards(load_rewards(ScoreConfig(reward=f"{path}:compute_score")).terms[0].reward, s, timeout=10) == [1.0, 0.0]


def test_a_verl_dict_gives_the_score_and_reports_the_rest_as_columns(tmp_path):
    path = write_reward(tmp_path, """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
            correct = solution_str == ground_truth
            return {"score": float(correct), "acc": correct, "pred": solution_str, "index": extra_info["index"]}
    """)
    rewards = load_rewards(ScoreConfig(reward=f"{path}:compute_score"))
    scores = rewards.score(samples(["4", "5"], ["4", "4"], extras=[{"index": 0}, {"index": 1}]), timeout=10)
    assert scores.total == [1.0, 0.0]
    assert scores.columns == {"reward/acc": [1.0, 0.0], "reward/pred": ["4", "5"], "reward/index": [0.0, 1.0]}


def test_a_dict_without_score_is_an_error_naming_the_sample():
    reward = RewardSet.of(from_callable(lambda data_source, solution_str, ground_truth: {"acc": 1.0}))
    with pytest.raises(RewardError, match="a dict without a 'score' key at sample 0 \\(keys: acc\\)"):
        reward.score(samples(["a"]), timeout=5)


# --- TRL ---------------------------------------------------------------------------------------


def test_trls_signature_gets_prompts_completions_and_every_column(tmp_path):
    path = write_reward(tmp_path, """
        def accuracy(prompts, completions, ground_truth, **kwargs):
            assert set(kwargs) == {"data_source", "level"}, kwargs
            return [float(c == t) + kwargs["level"][i] for i, (c, t) in enumerate(zip(completions, ground_truth))]
    """)
    s = samples(["4", "5"], ["4", "4"], extras=[{"level": 0.5}, {"level": 0.25}])
    assert compute_rewards(load_rewards(ScoreConfig(reward=f"{path}:accuracy")).terms[0].reward, s, timeout=10) == [1.5, 0.25]


def test_trl_gets_chat_prompts_and_completions_as_messages():
    seen = {}

    def format_reward(completions, **kwargs):
        seen["prompts"] = kwargs["prompts"]
        return [1.0 if c[0]["content"].startswith("<think>") else 0.0 for c in completions]

    chat = [[{"role": "user", "content": "2+2?"}], [{"role": "user", "content": "3+3?"}]]
    reward = from_callable(format_reward)
    assert compute_rewards(reward, samples(["<think>4", "6"], messages=chat), timeout=5) == [1.0, 0.0]
    assert seen["prompts"] == chat


def test_a_trl_function_asking_for_a_missing_column_names_what_there_is():
    reward = from_callable(lambda completions, solution: [0.0] * len(completions))
    with pytest.raises(RewardError, match="asks for column\\(s\\) solution; the rollouts have prompts, completions, ground_truth, data_source"):
        compute_rewards(reward, samples(["a"]), timeout=5)


def test_none_means_not_applicable_and_a_sample_no_reward_applies_to_is_an_error():
    only_even = from_callable(lambda completions, **kw: [1.0 if i % 2 == 0 else None for i in range(len(completions))])
    with pytest.raises(RewardError, match="no reward applies to sample 1"):
        RewardSet.of(only_even).score(samples(["a", "b"]), timeout=5)


# --- deciding the form ---------------------------------------------------------------------------


@pytest.mark.parametrize("fn, form", [
    (lambda responses, completions: None, "mix the trl and rlctl forms"),
    (lambda solution_str, responses: None, "mix the verl and rlctl forms"),
    (lambda a, b: None, "no form supplies its parameter\\(s\\) b"),
    (lambda *, score_me: None, "no form supplies its parameter\\(s\\) score_me"),
    (lambda solution_str, answer: None, "the verl form supplies no answer"),
])
def test_an_ambiguous_or_unknown_signature_is_refused_naming_the_forms(fn, form):
    with pytest.raises(InputError, match=f"{form}; accepted: fn\\(responses\\);.*verl's compute_score.*TRL's fn\\(prompts, completions"):
        from_callable(fn, "f.py:fn")


def test_an_ambiguous_signature_in_a_reward_file_is_exit_2_at_load(tmp_path):
    path = write_reward(tmp_path, "def reward(responses, completions):\n    return [0.0] * len(responses)\n")
    with pytest.raises(InputError, match="mix the trl and rlctl forms"):
        load_rewards(ScoreConfig(reward=f"{path}:reward"))


# --- several rewards -------------------------------------------------------------------------------


def test_weighted_rewards_record_the_total_and_each_component(tmp_path):
    path = write_reward(tmp_path, """
        def format_ok(completions, **kwargs):
            return [1.0 if c.startswith("####") else 0.0 for c in completions]
    """)
    cfg = ScoreConfig(rewards=(RewardTerm("builtin:gsm8k", 2.0), RewardTerm(f"{path}:format_ok", 0.5, "format")))
    rewards = load_rewards(cfg)
    scores = rewards.score(samples(["#### 4", "#### 5", "4"], ["4", "4", "4"]), timeout=10)
    assert scores.total == [2.5, 0.5, 0.0]
    assert scores.columns == {"reward/gsm8k": [1.0, 0.0, 0.0], "reward/format": [1.0, 1.0, 0.0]}
    assert rewards.spec == f"2*builtin:gsm8k + 0.5*{path}:format_ok"
    assert scores.components == {"reward/gsm8k": 2.0, "reward/format": 0.5}  # what GDPO normalizes one by one
    assert load_rewards(ScoreConfig(reward="builtin:gsm8k")).score(samples(["#### 4"], ["4"]), timeout=10).components == {}


def test_a_component_that_does_not_apply_leaves_the_others():
    second_only = from_callable(lambda completions, **kw: [None, 1.0])
    quarter = from_callable(lambda responses: [0.25, 0.25])
    rewards = RewardSet([WeightedReward("second", second_only, 1.0), WeightedReward("quarter", quarter, 2.0)])
    scores = rewards.score(samples(["a", "b"]), timeout=5)
    assert scores.total == [0.5, 1.5]
    assert scores.columns == {"reward/second": [None, 1.0], "reward/quarter": [0.25, 0.25]}


def test_rewards_in_toml_and_set(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[score]\nrewards = [{fn = "builtin:gsm8k", weight = 1.0}, {fn = "builtin:length", weight = 0.1, name = "len"}]\n')
    cfg = load_config(path)
    assert cfg.score.rewards == (RewardTerm("builtin:gsm8k", 1.0), RewardTerm("builtin:length", 0.1, "len"))
    again = load_config(None, ['score.rewards=[{fn = "builtin:countdown"}]'])
    assert again.score.rewards == (RewardTerm("builtin:countdown"),)
    with pytest.raises(ConfigError, match="score.rewards: unknown key 'weigth'; did you mean weight"):
        load_config(None, ['score.rewards=[{fn = "builtin:gsm8k", weigth = 2}]'])
    with pytest.raises(ConfigError, match="score.rewards: every entry needs fn"):
        load_config(None, ["score.rewards=[{weight = 2}]"])
    with pytest.raises(ConfigError, match="score.reward \\(builtin:gsm8k\\) and score.rewards are both set"):
        load_config(None, ["score.reward=builtin:gsm8k", 'score.rewards=[{fn = "builtin:length"}]'])


def test_the_trl_comparisons_reward_runs_unchanged_in_rlctl():
    """bench/trl_bench.py gives TRL and rlctl the very same function (TRL's calling form)."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "addition_reward.py"
    reward = load_rewards(ScoreConfig(reward=f"{path}:addition_reward")).terms[0].reward
    s = samples(["19 it is", "twenty", "1 9"], ["19", "19", "19"])
    assert compute_rewards(reward, s, timeout=10) == pytest.approx([1.0, 0.0, 0.1 * 2 / 3])


def test_each_data_source_is_scored_by_the_rewards_named_for_it():
    """verl's reward by data_source: a term with `sources` is called on those samples alone and
    is not applicable (None) to the others; a sample that no term scores is an error."""
    calls = []

    def length_seen(responses):
        calls.append(list(responses))
        return [float(len(r)) for r in responses]

    rewards = load_rewards(ScoreConfig(rewards=(RewardTerm("builtin:gsm8k", sources=("gsm8k",)), RewardTerm("builtin:math", sources=("math", "aime")))))
    rewards.terms.append(WeightedReward("len", from_callable(length_seen), 0.5, ("aime",)))
    mixed = RewardSamples(
        ["p"] * 4, ["#### 4", "\\boxed{4}", "#### 4", "\\boxed{7}"], ["4", "4", "5", "7"], ["gsm8k", "math", "gsm8k", "aime"],
    )
    scores = rewards.score(mixed, timeout=5)
    assert scores.total == [1.0, 1.0, 0.0, 1.0 + 0.5 * len("\\boxed{7}")]
    assert scores.columns["reward/gsm8k"] == [1.0, None, 0.0, None] and scores.columns["reward/math"] == [None, 1.0, None, 1.0]
    assert calls == [["\\boxed{7}"]]  # called on its data_source's samples only
    assert rewards.spec == "1*builtin:gsm8k on gsm8k + 1*builtin:math on math|aime + 0.5*<callable> on aime"
    unknown = RewardSamples(["p"], ["#### 4"], ["4"], ["countdown"])
    with pytest.raises(RewardError, match="no reward applies to sample 0 \\(data_source 'countdown'\\)"):
        rewards.score(unknown, timeout=5)
