"""What `rlctl eval` reports: pass@k's unbiased estimate, and the summary per data_source."""

import pyarrow as pa
import pytest

from rlctl.evaluate import as_metrics, evaluation, ks_up_to, pass_at_k


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
