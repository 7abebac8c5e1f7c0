"""Scored rollouts as preference data: each prompt's best and worst sample, in the tokens the
policy sampled, for `rlctl dpo` (a pair) and `rlctl kto` (a desirable and an undesirable
example)."""

import pyarrow as pa
import pytest

from rlctl.config import DataConfig, DpoConfig, KtoConfig, SftConfig
from rlctl.errors import InputError
from rlctl.scored_pairs import best_and_worst, is_scored


def scored(rewards: dict[str, list[float]], *, loss_mask: bool = False) -> pa.Table:
    """Rows of a score stage's output: prompt `p` sampled len(rewards[p]) times; sample s of
    prompt number i has response ids [100·i + s, 7] and prompt ids [i + 1, 2, 3]."""
    rows = []
    for i, (prompt, values) in enumerate(rewards.items()):
        for s, reward in enumerate(values):
            row = {"id": prompt, "data_source": f"src{i % 2}", "prompt": f"prompt {prompt}", "sample": s, "prompt_ids": [i + 1, 2, 3],
                   "response_ids": [100 * i + s, 7], "response": "text", "reward": reward}
            if loss_mask:
                row["loss_mask"] = [True, s % 2 == 0]
            rows.append(row)
    return pa.Table.from_pylist(rows)


def test_a_prompts_best_and_worst_sample_are_its_pair_in_their_sampled_tokens():
    table = scored({"a": [0.2, 0.9, 0.1, 0.9], "b": [0.5, 0.5], "c": [1.0], "d": [0.0, 0.3]})
    assert is_scored(table) and not is_scored(table.append_column("chosen", pa.array(["x"] * table.num_rows)))
    pairs = best_and_worst(table, min_gap=0.0, source="s")
    assert [p.id for p in pairs] == ["a", "d"]  # b: equal rewards; c: one sample
    a, d = pairs
    assert a.chosen == ([1, 7], [True, True]) and a.rejected == ([2, 7], [True, True])  # the first of the two 0.9s; the 0.1
    assert a.prompt_ids == [1, 2, 3] and (a.chosen_reward, a.rejected_reward) == (0.9, 0.1)
    assert d.chosen[0] == [301, 7] and d.rejected[0] == [300, 7]
    assert [p.id for p in best_and_worst(table, min_gap=0.5, source="s")] == ["a"]  # d's gap of 0.3 is not over 0.5


def test_all_pairs_are_every_two_samples_of_a_prompt_whose_rewards_differ_by_more_than_the_gap():
    table = scored({"a": [0.2, 0.9, 0.1, 0.9], "b": [0.5, 0.5], "c": [1.0], "d": [0.0, 0.3]})
    pairs = best_and_worst(table, min_gap=0.0, source="s", which="all")
    assert [(p.id, p.rows) for p in pairs] == [("a", (0, 2)), ("a", (1, 0)), ("a", (1, 2)), ("a", (3, 0)), ("a", (3, 2)), ("d", (8, 7))]
    assert all(p.chosen_reward > p.rejected_reward for p in pairs)
    assert [p.rows for p in best_and_worst(table, min_gap=0.5, source="s", which="all")] == [(1, 0), (1, 2), (3, 0), (3, 2)]  # gaps of 0.7 and 0.8 only
    from rlctl.dpo import encode_dpo_pairs

    encoded = encode_dpo_pairs(table, None, DataConfig(), DpoConfig(scored_pairs="all"), end_ids=[7], context_length=64, source="s")
    assert encoded.chosen.ids == ["a"] * 5 + ["d"] and encoded.chosen.response_ids[1] == [1, 7] and encoded.rejected.response_ids[1] == [0, 7]


def test_a_tools_tokens_stay_context_and_no_pair_at_all_is_one_error():
    pairs = best_and_worst(scored({"a": [0.0, 1.0]}, loss_mask=True), min_gap=0.0, source="s")
    assert pairs[0].chosen == ([1, 7], [True, False]) and pairs[0].rejected == ([0, 7], [True, True])
    with pytest.raises(InputError, match=r"runs/s: no prompt's samples differ in reward by more than 0.5"):
        best_and_worst(scored({"a": [0.0, 0.4], "b": [1.0, 1.0]}), min_gap=0.5, source="runs/s")


def test_dpo_reads_scored_rollouts_as_pairs_of_token_ids_held_to_its_length_limit():
    from rlctl.dpo import encode_dpo_pairs

    table = scored({"a": [0.2, 0.9], "b": [0.0, 0.3]})
    pairs = encode_dpo_pairs(table, None, DataConfig(), DpoConfig(), end_ids=[7], context_length=64, source="s")
    assert pairs.chosen.ids == ["a", "b"] and pairs.chosen.response_ids == [[1, 7], [101, 7]] and pairs.rejected.response_ids == [[0, 7], [100, 7]]
    assert pairs.chosen.prompt_ids == [[1, 2, 3], [2, 2, 3]] and pairs.chosen.trained is None
    cut = encode_dpo_pairs(table, None, DataConfig(), DpoConfig(max_tokens=4, truncate="right"), end_ids=[7], context_length=64, source="s")
    assert cut.chosen.response_ids == [[1], [101]]
    with pytest.raises(InputError, match=r"s: the chosen response of pair 'a' has 5 tokens, over 4 \(dpo.max_tokens\)"):
        encode_dpo_pairs(table, None, DataConfig(), DpoConfig(max_tokens=4), end_ids=[7], context_length=64, source="s")


def test_kto_reads_scored_rollouts_as_each_prompts_best_sample_desirable_and_worst_undesirable():
    from rlctl.kto import encode_kto_examples, example_sources

    table = scored({"a": [0.2, 0.9], "b": [0.5, 0.5], "c": [0.0, 0.3]})
    examples = encode_kto_examples(table, None, DataConfig(), KtoConfig(), end_ids=[7], context_length=64, source="s")
    assert examples.ids == ["a:chosen", "a:rejected", "c:chosen", "c:rejected"] and examples.desirable == [True, False, True, False]
    assert examples.examples.response_ids == [[1, 7], [0, 7], [201, 7], [200, 7]]
    assert example_sources(table, KtoConfig(), "s") == ["src0", "src0", "src0", "src0"]  # prompts a and c (numbers 0 and 2)


def test_sft_keeps_each_prompts_best_samples_at_or_above_the_reward_bar():
    from rlctl.scored_pairs import best_samples
    from rlctl.sft import encode_examples

    table = scored({"a": [0.2, 0.9, 0.1, 0.9], "b": [0.5, 0.05], "c": [0.0, 0.01]})
    best = best_samples(table, min_reward=0.1, per_prompt=1, source="s")
    assert [(s.id, s.response[0], s.reward) for s in best] == [("a", [1, 7], 0.9), ("b", [100, 7], 0.5)]  # RAFT: best of n; c's best is under 0.1
    every = best_samples(table, min_reward=0.1, per_prompt=0, source="s")
    assert [(s.id, s.response[0]) for s in every] == [("a", [1, 7]), ("a", [3, 7]), ("a", [0, 7]), ("a", [2, 7]), ("b", [100, 7])]  # ReST-EM: all over the bar, best first
    examples = encode_examples(table, None, DataConfig(), SftConfig(min_reward=0.1, per_prompt=2), end_ids=[7], context_length=64, source="s")
    assert examples.ids == ["a", "a", "b"] and examples.response_ids == [[1, 7], [3, 7], [100, 7]] and examples.prompt_ids[2] == [2, 2, 3]
    with pytest.raises(InputError, match=r"s: no sample is rewarded 2 or more"):
        best_samples(table, min_reward=2.0, per_prompt=1, source="s")


def test_the_reward_model_reads_scored_rollouts_as_the_text_of_each_prompts_best_and_worst_sample():
    from rlctl.scored_pairs import as_text_pairs

    table = scored({"a": [0.2, 0.9], "b": [0.5, 0.5], "c": [0.3, 0.0]})
    table = table.set_column(table.column_names.index("response"), "response", pa.array([f"reply {i}" for i in range(table.num_rows)]))
    pairs = as_text_pairs(table, min_gap=0.0, source="s")
    assert pairs.to_pylist() == [
        {"id": "a", "prompt": "prompt a", "data_source": "src0", "chosen": "reply 1", "rejected": "reply 0"},
        {"id": "c", "prompt": "prompt c", "data_source": "src0", "chosen": "reply 4", "rejected": "reply 5"},
    ]
