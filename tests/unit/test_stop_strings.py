"""Stop strings: a response ends at the first token whose text completes one and keeps it; the
cut depends on the tokens alone, and the HF engine stops such rows early only to save work."""

import numpy as np
import pytest

from rlctl.backends import cuda_graphs
from rlctl.backends.base import Generation, SamplingParams
from rlctl.backends.hf import HFPolicy
from rlctl.backends.stop_strings import StopStrings


@pytest.fixture
def policy(tiny_model):
    return HFPolicy.load(tiny_model, "cpu")


def text(policy, ids) -> str:
    return policy.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_a_response_ends_with_the_token_that_completes_the_first_stop_string(policy):
    ids = policy.tokenizer("think first </answer> then more", add_special_tokens=False)["input_ids"]
    stops = StopStrings(policy.tokenizer, ["</answer>", "never"])
    end = stops.end(ids)
    assert text(policy, ids[:end]).endswith("</answer>") and "</answer>" not in text(policy, ids[:end - 1])
    cut = stops.cut(Generation(ids, [-0.5 - i for i in range(len(ids))], "length"))
    assert cut == Generation(ids[:end], [-0.5 - i for i in range(end)], "stop")  # the log-probs of the kept tokens, as sampled


def test_a_stop_string_the_tokens_split_is_found_where_its_last_piece_lands(policy):
    ids = policy.tokenizer("ab</answer>", add_special_tokens=False)["input_ids"]
    pieces = [text(policy, [i]) for i in ids]
    assert sum("</answer>" in piece for piece in pieces) == 0  # no single token holds it: the tokens split it
    assert StopStrings(policy.tokenizer, ["</answer>"]).end(ids) == len(ids)


def test_responses_without_a_stop_string_stay_as_they_are(policy):
    ids = policy.tokenizer("nothing to see", add_special_tokens=False)["input_ids"]
    generation = Generation(ids, [0.0] * len(ids), "length")
    assert StopStrings(policy.tokenizer, ["</answer>"]).cut(generation) is generation
    assert StopStrings(policy.tokenizer, []).end(ids) is None


def test_a_tail_that_holds_a_stop_string_ends_a_row_only_if_the_whole_row_does(policy):
    stops = StopStrings(policy.tokenizer, ["xy"])
    row = policy.tokenizer("abc xy", add_special_tokens=False)["input_ids"]
    assert stops.hits([row[-2:]], lambda i: row) == [True]
    assert stops.hits([row[-2:]], lambda i: row[:1]) == [False]  # the whole row has no "xy": the tail misled


def prompts(policy):
    texts = ["hello there", "12 + 3 =", "a", "The answer is a longer prompt"]
    return [policy.tokenizer(t)["input_ids"] for t in texts] * 3


@pytest.mark.parametrize("static", [False, True], ids=["step-by-step", "static batch"])
def test_the_engine_stops_rows_at_their_stop_string_and_generates_less(policy, monkeypatch, static):
    monkeypatch.setattr(cuda_graphs, "decode_mode", lambda model, device: "graph" if static else None)
    free = SamplingParams(max_new_tokens=40, temperature=1.0, seed=3)
    counts = {"free": [], "stopped": []}
    unstopped = policy.generate(prompts(policy), free, on_tokens=counts["free"].append, batch_size=6)
    texts = [text(policy, g.response_ids) for g in unstopped]
    stop = max(("a", "e", "s", "t"), key=lambda s: sum(s in t[len(t) // 4:] for t in texts))  # one most rows reach mid-way
    stops = StopStrings(policy.tokenizer, [stop])
    stopped = policy.generate(prompts(policy), SamplingParams(**{**free.__dict__, "stop": (stop,)}), on_tokens=counts["stopped"].append, batch_size=6)
    expected = [stops.cut(g) for g in unstopped]
    assert sum(g.finish_reason == "stop" for g in expected) >= 6
    def rows(generations):
        return [(g.response_ids, g.finish_reason) for g in generations]

    assert rows(stops.cut(g) for g in stopped) == rows(expected)  # the same rows, however early the engine stopped
    for a, b in zip(stopped, expected):  # a batch that shrank sooner rounds the last bits differently
        np.testing.assert_allclose(a.logprobs[:len(b.logprobs)], b.logprobs, atol=1e-5)
    if not static:
        assert rows(stopped) == rows(expected)  # checked every step: each row ends at its stop string
    assert sum(counts["stopped"]) < sum(counts["free"])  # tokens past a stop string were not generated
