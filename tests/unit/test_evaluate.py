"""What `rlctl eval` reports: pass@k's unbiased estimate, maj@n's vote, and the summary per data_source."""

import pyarrow as pa
import pytest

from rlctl.evaluate import (
    Answers,
    as_metrics,
    evaluation,
    known_answers,
    ks_up_to,
    majority_reward,
    pass_at_k,
)


def test_pass_at_k_is_the_chance_that_k_of_the_n_samples_hold_a_passing_one():
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3, 2) / C(4, 2)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(5, 3, 3) == 1.0  # fewer than 3 failures: any 3 hold a pass
    assert ks_up_to(8) == [1, 2, 4, 8] and ks_up_to(6) == [1, 2, 4, 6] and ks_up_to(1) == [1]


def test_the_summary_covers_every_prompt_then_each_data_source():
    scored = pa.table({
        "id": ["a", "a", "b", "b", "c", "c"],
        "data_source": ["math", "math", "math", "math", "code", "code"],
        "reward": pa.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0], pa.float32()),
    })
    every, code, math = evaluation(scored, threshold=1.0)
    assert (every.source, every.prompts, every.samples) == ("all", 3, 2)
    assert every.mean == pytest.approx(0.5) and every.best == pytest.approx(2 / 3)
    assert every.pass_at == {1: pytest.approx((0.5 + 0 + 1) / 3), 2: pytest.approx(2 / 3)}
    assert (code.source, code.pass_at[1], math.source, math.pass_at[1]) == ("code", 1.0, "math", 0.25)
    metrics = as_metrics([every, code])
    assert metrics["eval/pass@1"] == pytest.approx(0.5) and metrics["eval/mean@2/code"] == 1.0 and metrics["eval/best@2"] == pytest.approx(2 / 3)
    assert [row.source for row in evaluation(scored.drop_columns(["data_source"]), threshold=0.5)] == ["all"]


def test_the_majority_answer_is_the_most_common_one_given_first_on_a_tie_without_the_unanswered():
    rewards = pa.array([0.0, 1.0, 1.0, 0.0, 0.5]).to_numpy()
    assert majority_reward(["7", "8", "8", None, "7"], rewards, str.__eq__) == 0.0  # 7 and 8 twice each: 7 came first
    assert majority_reward([None, "8", "8", None, "7"], rewards, str.__eq__) == 1.0
    assert majority_reward([None, None, None, "3", None], rewards, str.__eq__) == 0.0  # one answer outvotes four silences
    assert majority_reward([None] * 5, rewards[::-1].copy(), str.__eq__) == 0.5  # no answer at all: the first sample's reward


def test_math_answers_that_say_the_same_value_vote_together():
    from rlctl.math_answers import same_answer

    rewards = pa.array([0.0, 1.0, 1.0, 1.0]).to_numpy()
    assert majority_reward(["3", "\\frac{1}{2}", "0.5", "1/2"], rewards, same_answer) == 1.0
    assert majority_reward(["3", "\\frac{1}{2}", "0.5", "1/2"], rewards, str.__eq__) == 0.0  # as text: four answers, 3 first


def test_maj_at_n_per_data_source_and_in_the_metrics():
    scored = pa.table({
        "id": ["a", "a", "a", "b", "b", "b"],
        "data_source": ["x", "x", "x", "y", "y", "y"],
        "reward": pa.array([0.0, 1.0, 1.0, 1.0, 0.0, 0.0], pa.float32()),
        "response": ["#### 5", "#### 6", "#### 6", "#### 2", "none", "#### 9"],
    })
    every, x, y = evaluation(scored, threshold=1.0, answers=known_answers(scored, "builtin:gsm8k"))
    assert (every.majority, x.majority, y.majority) == (pytest.approx(1.0), 1.0, 1.0)  # b: 2 and 9 once each, 2 first
    assert as_metrics([every, x])["eval/maj@3/x"] == 1.0 and evaluation(scored, threshold=1.0)[0].majority is None


def test_answers_come_from_the_rewards_pred_column_or_a_builtin_answer_rule():
    scored = pa.table({"response": ["\\boxed{4}", "#### 12", "x"], "reward/pred": ["4", None, "x"]})
    assert known_answers(scored, "file.py:fn").values == ["4", None, "x"]
    plain = scored.drop_columns(["reward/pred"])
    assert known_answers(plain, "builtin:math").values == ["4", None, None]
    assert known_answers(plain, "builtin:gsm8k").values == [None, "12", None]
    assert known_answers(plain, "builtin:length") is None and isinstance(known_answers(plain, "builtin:math"), Answers)
    qa = pa.table({"response": ["<answer>The Paris.</answer>", "paris", "<answer> </answer>"]})
    assert known_answers(qa, "builtin:qa_em").values == ["paris", "paris", None]  # normalized, so they vote together
    choices = pa.table({"response": ["The answer is (b).", "\\boxed{B}", "no idea"]})
    assert known_answers(choices, "builtin:mcq").values == ["B", "B", None]
