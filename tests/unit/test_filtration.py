"""advantage.pf_ppo (policy filtration): each reweighting against its definition, the draw's
frequencies, its seeding by the batch's content, and the advantage stage's redrawn batch."""

import numpy as np
import pyarrow as pa
import pytest

from rlctl.algos.filtration import filtered_rows, filtration_weights


def test_each_method_weighs_the_rewards_as_verl_does():
    rewards = np.array([0.5, -1.0, 0.0, 2.0, 2.0, -1.0])
    np.testing.assert_allclose(filtration_weights(rewards, "pow", 2.0), [0.25, 1.0, 0.0, 4.0, 4.0, 1.0], atol=2e-8)
    np.testing.assert_allclose(filtration_weights(rewards, "pow", 1.0), np.abs(rewards), atol=2e-8)
    np.testing.assert_allclose(filtration_weights(rewards, "max_min", 2.0), [0, 1, 0, 1, 1, 1], atol=2e-8)
    np.testing.assert_allclose(filtration_weights(rewards, "max_random", 2.0), [0.1, 0.1, 0.1, 0.4, 0.4, 0.1], atol=2e-8)
    assert (filtration_weights(rewards, "pow", 2.0) > 0).all()  # 1e-8 keeps every row a chance
    with pytest.raises(ValueError, match="unknown policy filtration"):
        filtration_weights(rewards, "best", 2.0)


def test_the_draw_follows_the_weights_with_replacement_in_row_order():
    rewards = np.tile([1.0, 2.0, 3.0, 0.0], 5000)
    ids = [f"p{i}" for i in range(len(rewards))]
    rows = filtered_rows(ids, rewards, method="pow", power=2.0, seed=0)
    assert len(rows) == len(rewards) and (np.diff(rows) >= 0).all()
    drawn = np.bincount(rewards[rows].astype(int), minlength=4) / len(rows)
    np.testing.assert_allclose(drawn, [0.0, 1 / 14, 4 / 14, 9 / 14], atol=0.01)  # rewards 0, 1, 2, 3


def test_max_min_trains_only_on_the_batchs_best_and_worst_samples():
    rewards = np.array([0.2, 0.9, 0.1, 0.5, 0.9, 0.3, 0.1, 0.6])
    rows = filtered_rows([f"p{i // 2}" for i in range(8)], rewards, method="max_min", power=2.0, seed=3)
    assert set(rewards[rows]) <= {0.1, 0.9} and len(rows) == 8


def test_the_same_batch_and_seed_draw_the_same_rows_and_another_batch_or_seed_others():
    rng = np.random.default_rng(0)
    rewards = rng.random(64)
    ids = [f"p{i // 4}" for i in range(64)]
    rows = filtered_rows(ids, rewards, method="pow", power=2.0, seed=1)
    assert np.array_equal(rows, filtered_rows(ids, rewards.copy(), method="pow", power=2.0, seed=1))
    assert not np.array_equal(rows, filtered_rows(ids, rewards, method="pow", power=2.0, seed=2))
    assert not np.array_equal(rows, filtered_rows(ids[::-1], rewards, method="pow", power=2.0, seed=1))


def test_a_batch_without_weight_is_drawn_uniformly_and_an_empty_one_draws_nothing():
    rewards = np.zeros(4000)
    rows = filtered_rows([str(i) for i in range(4000)], rewards, method="pow", power=2.0, seed=0)
    assert 0.55 < len(np.unique(rows)) / 4000 < 0.7  # 1 − 1/e of the rows, as any uniform draw with replacement
    assert filtered_rows([], np.zeros(0), method="max_min", power=2.0, seed=0).size == 0


def test_the_advantage_stage_trains_on_the_redrawn_rows_and_reports_them():
    """Every output row is an input row whole (its advantages computed on the whole batch
    first), the rows drawn are max_min's, and the metrics say how many distinct rows and their
    mean reward."""
    from rlctl.algos.kl import KLControllerState
    from rlctl.config import AdvantageConfig
    from rlctl.stages.advantage import advantage_table

    rewards = [1.0, 0.0, 0.5, 0.5, 0.25, 1.0]
    table = pa.table({
        "id": ["a", "a", "b", "b", "c", "c"], "sample": [0, 1, 0, 1, 0, 1], "response_ids": [[1, 2], [3], [4, 5, 6], [7], [8, 9], [1]],
        "reward": pa.array(rewards, pa.float32()),
    })
    whole, _, _ = advantage_table(table, AdvantageConfig(estimator="grpo"), KLControllerState(0.0))
    redrawn, _, stats = advantage_table(table, AdvantageConfig(estimator="grpo", pf_ppo="max_min", pf_ppo_seed=5), KLControllerState(0.0))
    assert redrawn.num_rows == 6
    by_key = {(r["id"], r["sample"]): r for r in whole.to_pylist()}
    for row in redrawn.to_pylist():
        assert row == by_key[row["id"], row["sample"]] and row["reward"] in (0.0, 1.0)
    drawn = redrawn.column("reward").to_pylist()
    assert stats["pf_ppo/reward_mean"] == pytest.approx(np.mean(drawn))
    assert stats["pf_ppo/distinct_rows"] == len({(r["id"], r["sample"]) for r in redrawn.to_pylist()}) / 6
    assert stats["reward_mean"] == pytest.approx(np.mean(rewards))  # the scored batch's, as before
