"""The prompt stream: epochs of seeded permutations of the prompts in play, and data.retire_pass_rate's
retirements, which shorten only the epochs that begin after them."""

import numpy as np
import pyarrow as pa
import pytest

from rlctl.errors import InputError
from rlctl.pipeline import select_prompts
from rlctl.prompt_stream import (
    IN_PLAY,
    PromptStream,
    newly_retired,
    pass_rates,
    retired_digest,
    retirement_epochs,
)

PROMPTS = pa.table({"id": [f"p{k}" for k in range(5)], "prompt": [f"prompt {k}" for k in range(5)]})


def drawn(iteration, retired=None, shuffle=False, batch_size=2):
    table = select_prompts(PROMPTS, iteration=iteration, batch_size=batch_size, shuffle=shuffle, seed=3, retired=retired)
    return table.column("id").to_pylist()


def test_with_nothing_retired_each_epoch_is_the_seeded_permutation_of_every_prompt():
    stream = PromptStream(np.full(5, IN_PLAY), seed=3, shuffle=True)
    for epoch in range(3):
        assert stream.epoch_rows(epoch).tolist() == np.random.default_rng([3, epoch]).permutation(5).tolist()
    assert stream.rows(4, 3) == [*stream.epoch_rows(0)[4:].tolist(), *stream.epoch_rows(1)[:2].tolist()]  # a batch across epochs
    assert drawn(1) == ["p0", "p1"] and drawn(3) == ["p4", "p0"]


def test_a_retired_prompt_is_left_out_of_the_epochs_from_its_retirement_on_and_earlier_ones_keep_their_length():
    retired = {"p1": 1, "p3": 2}
    until = retirement_epochs(PROMPTS.column("id"), retired)
    assert until.tolist() == [IN_PLAY, 1, IN_PLAY, 2, IN_PLAY]
    stream = PromptStream(until, seed=3, shuffle=False)
    assert [stream.epoch_length(e) for e in range(4)] == [5, 4, 3, 3]
    assert stream.rows(0, 15) == [0, 1, 2, 3, 4] + [0, 2, 3, 4] + [0, 2, 4] + [0, 2, 4]
    assert stream.locate(9) == (2, 0) and stream.locate(4) == (0, 4)
    # a shuffled epoch is a permutation of its prompts in play, seeded by the epoch
    shuffled = PromptStream(until, seed=3, shuffle=True)
    assert sorted(shuffled.epoch_rows(1).tolist()) == [0, 2, 3, 4]
    assert shuffled.epoch_rows(1).tolist() == [[0, 2, 3, 4][k] for k in np.random.default_rng([3, 1]).permutation(4)]


def test_select_prompts_draws_around_the_retired_ids_and_ignores_ids_the_prompts_do_not_hold():
    assert drawn(3, {"p0": 1, "p2": 1, "gone": 1}) == ["p4", "p1"]
    assert drawn(4, {"p0": 1, "p2": 1}) == ["p3", "p4"]


def test_when_every_prompt_is_retired_the_draw_is_refused_in_one_line():
    stream = PromptStream(np.array([1, 1], dtype=np.int64), seed=0, shuffle=True)
    assert sorted(stream.rows(0, 2)) == [0, 1]  # epoch 0 holds both
    with pytest.raises(InputError, match=r"every training prompt is retired by epoch 1 \(data.retire_pass_rate\)"):
        stream.rows(1, 2)


def test_pass_rates_count_every_round_of_a_prompt_and_retire_only_prompts_not_yet_retired():
    first = pa.table({"id": ["a", "a", "b", "b"], "reward": [1.0, 1.0, 1.0, 0.0]})
    second = pa.table({"id": ["b", "b", "c", "c"], "reward": [1.0, 1.0, 0.5, 2.0]})
    rates = pass_rates([first, second], pass_threshold=1.0)
    assert rates == {"a": 1.0, "b": 0.75, "c": 0.5}
    assert newly_retired({}, rates, pass_rate=1.0, from_epoch=2) == {"a": 2}
    assert newly_retired({"a": 1}, rates, pass_rate=0.5, from_epoch=2) == {"b": 2, "c": 2}
    assert retired_digest({"a": 1, "b": 2}) == retired_digest({"b": 2, "a": 1}) != retired_digest({"a": 2, "b": 2})
