"""What a batch of samples looks like: lengths, the share cut at the length limit, and the
prompt groups whose samples all got the same reward."""

import numpy as np
import pyarrow as pa
import pytest

from rlctl.sample_stats import (
    equal_reward_share,
    merged_rollout_stats,
    reward_stats,
    rollout_stats,
    rollout_tally,
    source_stats,
    validation_metrics,
)

TOKENS = pa.list_(pa.int32())


def rollouts(prompt_ids, response_ids, finish_reasons) -> pa.Table:
    return pa.table({
        "prompt_ids": pa.array(prompt_ids, TOKENS),
        "response_ids": pa.array(response_ids, TOKENS),
        "finish_reason": finish_reasons,
    })


def scores(ids, rewards) -> pa.Table:
    return pa.table({"id": ids, "reward": pa.array(rewards, pa.float32())})


def test_rollout_stats_give_the_lengths_and_the_share_cut_at_the_length_limit():
    table = rollouts([[1, 2, 3], [1, 2, 3], [4]], [[5, 6], [7, 8, 9, 10], []], ["stop", "length", "stop"])
    assert rollout_stats(table) == {
        "response_length": 2.0,
        "response_length/max": 4.0,
        "response_length/min": 0.0,
        "response_length/clip_ratio": pytest.approx(1 / 3),
        "prompt_length": pytest.approx(7 / 3),
        "prompt_length/max": 3.0,
        "response_repetition": 0.0,  # one 4-gram among them, not repeated
    }


def test_rows_written_in_parts_give_the_stats_of_all_of_them():
    """A worker group's ranks each tally their own part; the controller merges the tallies."""
    table = rollouts([[1, 2, 3], [1, 2, 3], [4], [5, 6]], [[5, 6], [7, 8, 9, 10], [], [1]], ["stop", "length", "stop", "length"])
    parts = [table.slice(0, 1), table.slice(1, 0), table.slice(1, 3)]  # a rank can have no rows
    assert merged_rollout_stats([rollout_tally(part) for part in parts]) == rollout_stats(table)
    assert merged_rollout_stats([rollout_tally(table.slice(0, 0))]) == {}


def test_no_rows_give_no_stats():
    assert rollout_stats(rollouts([], [], pa.array([], pa.string()))) == {}
    assert reward_stats(scores(pa.array([], pa.string()), [])) == {}


def test_equal_rewards_counts_the_groups_whose_samples_all_scored_alike():
    table = scores(["a", "a", "b", "b", "c", "c", "d", "d"], [1, 1, 0, 1, 0, 0, -2, -2])
    assert equal_reward_share(table) == 0.75  # a (all 1), c (all 0), d (all -2, below zero too); b differs
    assert reward_stats(table) == {"reward_max": 1.0, "reward_min": -2.0, "groups/equal_rewards": 0.75}


def test_rewards_a_float32_rounding_apart_count_as_equal():
    assert equal_reward_share(scores(["a", "a"], [0.3, 0.3 + 1e-8])) == 1.0
    assert equal_reward_share(scores(["a", "a"], [0.3, 0.31])) == 0.0


def test_groups_of_one_sample_are_not_compared():
    assert equal_reward_share(scores(["a", "b", "c"], [1, 1, 1])) is None  # rollout.n = 1: nothing to compare
    assert equal_reward_share(scores(["a", "a", "b"], [1, 0, 1])) == 0.0  # b alone is left out
    assert equal_reward_share(pa.table({"reward": pa.array([1.0, 1.0], pa.float32())})) is None  # no id column


def test_validation_scores_the_mean_of_every_sample_and_the_mean_of_each_prompts_best():
    table = scores(["a", "a", "a", "b", "b", "b"], [0, 1, 0, 0, 0, 0]).append_column("data_source", pa.array(["x", "x", "x", "y", "y", "y"]))
    assert validation_metrics(table, 3) == {
        "val/score": pytest.approx(1 / 6), "val/best_of_3": 0.5,  # a solved by one of its three samples, b by none
        "val/score/x": pytest.approx(1 / 3), "val/best_of_3/x": 1.0,
        "val/score/y": 0.0, "val/best_of_3/y": 0.0,
    }
    assert validation_metrics(scores(["a", "b"], [1, 0]), 1) == {"val/score": 0.5}  # one greedy sample: no best of


def test_validation_reports_the_mean_of_each_numeric_reward_column_overall_and_per_source():
    table = scores(["a", "a", "b", "b"], [1.5, 0.5, 1.0, 0.0]).append_column("data_source", pa.array(["x", "x", "y", "y"]))
    table = table.append_column("reward/acc", pa.array([1.0, 0.0, 1.0, None], pa.float64()))  # a reward's reported value, absent on one row
    table = table.append_column("reward/length_penalty", pa.array([0.5, -0.5, 0.0, 0.0], pa.float64()))
    table = table.append_column("reward/note", pa.array(["ok", "", "", ""]))  # text: no mean
    metrics = validation_metrics(table, 2)
    assert metrics["val/reward/acc"] == pytest.approx(2 / 3) and metrics["val/reward/acc/x"] == 0.5 and metrics["val/reward/acc/y"] == 1.0
    assert metrics["val/reward/length_penalty"] == 0.0 and metrics["val/score"] == 0.75
    assert not any("note" in key for key in metrics)


def test_a_batch_of_several_sources_reports_each_ones_reward_and_length_and_one_source_nothing():
    table = scores(["a", "a", "b", "b"], [1.0, 0.0, 0.5, 0.5]).append_column("data_source", pa.array(["math", "math", "code", None]))
    table = table.append_column("response_ids", pa.array([[1, 2], [3], [4, 5, 6], [7]], pa.list_(pa.int32())))
    assert source_stats(table) == {
        "source/code/reward_mean": 0.5, "source/code/response_length": 3.0, "source/code/samples": 1,
        "source/math/reward_mean": 0.5, "source/math/response_length": 1.5, "source/math/samples": 2,
        "source/unknown/reward_mean": 0.5, "source/unknown/response_length": 1.0, "source/unknown/samples": 1,
    }
    assert source_stats(table.set_column(table.schema.get_field_index("data_source"), "data_source", pa.array(["m"] * 4))) == {}
    assert source_stats(scores(["a"], [1.0])) == {}


def test_validation_votes_where_the_answers_are_known():
    from rlctl.evaluate import Answers

    table = scores(["a", "a", "a", "b", "b", "b"], [0, 1, 1, 1, 0, 0]).append_column("data_source", pa.array(["x", "x", "x", "y", "y", "y"]))
    metrics = validation_metrics(table, 3, Answers(["5", "6", "6", "2", "9", "9"], str.__eq__))
    assert metrics["val/maj_of_3"] == 0.5 and metrics["val/maj_of_3/x"] == 1.0 and metrics["val/maj_of_3/y"] == 0.0  # a: 6 wins; b: 9 wins


def test_response_repetition_is_the_share_of_repeated_token_4grams_and_the_reward_length_correlation_is_pearsons():
    from rlctl.sample_stats import repeated_ngrams, reward_stats, rollout_stats

    assert repeated_ngrams([1, 2, 1, 2, 1, 2, 1, 2]) == (3, 5)  # a loop: 5 four-grams, 2 distinct
    assert repeated_ngrams([1, 2, 3, 4, 5]) == (0, 2) and repeated_ngrams([7, 7]) == (0, 0)  # too short for one
    rollouts = pa.table({
        "response_ids": pa.array([[1, 2, 1, 2, 1, 2, 1, 2], [1, 2, 3, 4, 5], [9]], pa.list_(pa.int32())),
        "prompt_ids": pa.array([[1], [1], [1]], pa.list_(pa.int32())), "finish_reason": ["stop", "stop", "length"],
    })
    assert rollout_stats(rollouts)["response_repetition"] == 3 / 7
    scored = scores(["a", "a", "b"], [0.2, 0.4, 0.9]).append_column("response_ids", rollouts.column("response_ids"))
    assert reward_stats(scored)["reward_length_corr"] == pytest.approx(float(np.corrcoef([0.2, 0.4, 0.9], [8, 5, 1])[0, 1]))
    assert reward_stats(scores(["a", "b"], [1.0, 1.0]).append_column("response_ids", pa.array([[1], [1, 2]], pa.list_(pa.int32()))))["reward_length_corr"] is None
