"""Reward functions: built-ins, calling conventions, and failures that name the sample."""

import json
import textwrap

import pytest
import torch

from rlctl.errors import InputError, RewardError
from rlctl.rewards import (
    RewardSamples,
    compute_rewards,
    countdown_reward,
    evaluate_arithmetic,
    from_callable,
    gsm8k_flexible_reward,
    gsm8k_reward,
    length_reward,
    load_reward,
    normalize_answer,
    qa_exact_match_reward,
    qa_f1_reward,
    think_format_reward,
)


def samples(responses, truths=None):
    n = len(responses)
    return RewardSamples(["p"] * n, list(responses), list(truths or [None] * n), ["src"] * n, [{} for _ in range(n)])


def test_length_reward_is_the_seed_articles():
    assert length_reward(["x" * 50, "x" * 150, ""]) == [0.5, 1.0, 0.0]


def test_gsm8k_is_verls_strict_rule():
    responses = ["#### 1 then #### 1,234", "no answer", "#### 72", "#### 5" + " " * 400, "#### $18", "#### 42.", "#### -3"]
    truths = ["1234", "1", "72.0", "5", "18", "42", "-3"]
    # the last "#### n" in the tail, commas removed; "$18" and "42." are format errors there
    assert gsm8k_reward(responses=responses, ground_truths=truths) == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_gsm8k_flexible_takes_the_last_number_wherever_it_stands():
    responses = ["so the total is $1,234.", "#### $18", "#### 42.", "no number", "it is 7, not 8", "-5 degrees"]
    truths = ["1234", "18", "42", "1", "7", "-5"]
    assert gsm8k_flexible_reward(responses=responses, ground_truths=truths) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]


def test_think_format_wants_one_closed_think_block_first_as_trls():
    responses = [
        "<think>\nadd them\n</think>\nThe answer is 4.",  # a block, then the answer
        "<think>add</think>",  # nothing after the block is fine
        "The answer is 4.",  # no block
        " <think>add</think> 4",  # not at the start
        "<think>add them, then check",  # never closed
        "<think>a</think><think>b</think>",  # a second block
        "<think>a <think>b</think>",  # opened twice
    ]
    assert think_format_reward(responses) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert load_reward("builtin:think_format")(samples(responses[:3])) == [1.0, 1.0, 0.0]


def test_qa_answers_are_compared_as_squad_normalizes_them():
    assert normalize_answer("  The  Eiffel-Tower, in PARIS! ") == "eiffeltower in paris"
    assert normalize_answer("an apple a day") == "apple day"


def test_qa_exact_match_takes_the_last_answer_tag_or_the_response_against_any_golden_answer():
    truths = ['["Paris", "City of Light"]', "Paris", "Paris", "Paris", "[not json", None, "Paris"]
    responses = [
        "<think>France's capital</think><answer>the city of light</answer>",  # one of the aliases
        "<answer>Lyon</answer> wait <answer>Paris.</answer>",  # the last tag counts
        "Paris",  # no tag: the whole response
        "<answer>Paris, France</answer>",  # more than the answer
        "[not json",  # a truth that is not a JSON list is one answer
        "anything",  # no ground truth
        "<answer>  </answer>",
    ]
    assert qa_exact_match_reward(responses=responses, ground_truths=truths) == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    assert load_reward("builtin:qa_em")(samples(responses[:2], truths[:2])) == [1.0, 1.0]


def test_multiple_choice_takes_the_boxed_or_stated_option_letter_and_never_guesses():
    from rlctl.rewards import mcq_answer, multiple_choice_reward

    cases = {
        "Let me think. The answer is (C).": "C",
        "Answer: b": "B",
        "first A, then B... so \\boxed{D}": "D",  # a box wins over any statement
        "\\boxed{\\text{(b)}}": "B",
        "answer: (E) because the others fail": "E",
        "<think>C or D</think><answer>d</answer>": "D",
        "the answer is a cat": None,  # an article, not option A
        "answer: because it is D": None,  # the first letter of a word is no option
        "<answer>C) 42</answer>": None,  # a tag with more than the letter
        "A and B look wrong, C looks right": None,  # no statement, no box: no guess
    }
    assert {response: mcq_answer(response) for response in cases} == cases
    truths = ["C", "(b)", "D", "B.", "E", "D", "A", "D", "C", "C"]
    assert multiple_choice_reward(responses=list(cases), ground_truths=truths) == [1.0] * 6 + [0.0] * 4
    assert load_reward("builtin:mcq")(samples(["The answer is (C)."], ["C"])) == [1.0]
    with pytest.raises(InputError, match="mcq ground_truth must be one option letter such as B or \\(B\\), got 'Paris'"):
        multiple_choice_reward(responses=["Answer: A"], ground_truths=["Paris"])


def test_qa_f1_gives_partial_credit_for_shared_words():
    f1 = qa_f1_reward(
        responses=["<answer>Paris, France</answer>", "Barack Obama", "no", "the united states of america"],
        ground_truths=["Paris", '["Obama", "Barack Hussein Obama"]', "yes", "United States"],
    )
    assert f1 == pytest.approx([2 * 0.5 * 1 / 1.5, max(2 * 0.5 * 1 / 1.5, 2 * 1 * (2 / 3) / (1 + 2 / 3)), 0.0, 2 * 0.5 * 1 / 1.5])


def test_countdown_scores_correct_wellformed_and_garbage():
    truth = json.dumps({"target": 24, "numbers": [3, 5, 8, 1]})
    cases = {
        "think... <answer>(5 * 3 + 8 + 1)</answer>": 1.0,  # each number once, hits 24
        "<answer>8 * 3 * (5 - 1)</answer>": 0.1,  # well-formed, misses the target
        "<answer>(5 - 1 - 3 + 8) * 3</answer>": 0.1,  # hits 24 but uses 3 twice
        "<answer>__import__('os')</answer>": 0.0,  # not arithmetic
        "<answer>3 * 8 * 1 ** 5</answer>": 0.0,  # powers are not allowed
        "no tags at all": 0.0,
    }
    scores = countdown_reward(responses=list(cases), ground_truths=[truth] * len(cases))
    assert scores == list(cases.values())


def test_arithmetic_evaluator_allows_only_arithmetic():
    assert evaluate_arithmetic("(1 + 2) * 3 / 4") == (2.25, [1, 2, 3, 4])
    for bad in ["a + 1", "2 ** 3", "-1 + 2", "1.5 + 1", "(lambda: 1)()", "1 / 0"]:
        with pytest.raises((ValueError, SyntaxError, ZeroDivisionError)):
            evaluate_arithmetic(bad)


def test_signature_decides_how_a_function_is_called():
    positional = from_callable(lambda samples: [len(s) for s in samples])
    keywords = from_callable(lambda *, responses, ground_truths: [float(r == t) for r, t in zip(responses, ground_truths)])
    kwargs = from_callable(lambda **kw: [len(kw["extras"])] * len(kw["responses"]))
    s = samples(["ab", "c"], ["ab", "x"])
    assert compute_rewards(positional, s, timeout=5) == [2.0, 1.0]
    assert compute_rewards(keywords, s, timeout=5) == [1.0, 0.0]
    assert compute_rewards(kwargs, s, timeout=5) == [2.0, 2.0]


def test_tensors_are_accepted():
    reward = from_callable(lambda samples: torch.tensor([0.5] * len(samples)))
    assert compute_rewards(reward, samples(["a", "b"]), timeout=5) == [0.5, 0.5]


def test_a_raising_function_names_the_sample():
    def picky(samples):
        return [1.0 / (len(s) - 3) for s in samples]

    with pytest.raises(RewardError, match=r"raised ZeroDivisionError.* at sample 2"):
        compute_rewards(from_callable(picky), samples(["a", "bb", "ccc", "dddd"]), timeout=5)


def test_nan_wrong_count_and_timeout_are_errors():
    with pytest.raises(RewardError, match="returned nan at sample 1"):
        compute_rewards(from_callable(lambda s: [0.0, float("nan")]), samples(["a", "b"]), timeout=5)
    with pytest.raises(RewardError, match="returned 1 values for 2 samples"):
        compute_rewards(from_callable(lambda s: [0.0]), samples(["a", "b"]), timeout=5)

    def slow(samples):
        import time

        if any(s == "slow" for s in samples):
            time.sleep(5)
        return [0.0] * len(samples)

    with pytest.raises(RewardError, match=r"ran past the 0.2s timeout at sample 1"):
        compute_rewards(from_callable(slow), samples(["fast", "slow"]), timeout=0.2)


def test_specs_load_files_modules_and_builtins(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent("""
        def reward(samples):
            return [1.0 for _ in samples]
    """))
    assert compute_rewards(load_reward(f"{path}:reward"), samples(["a"]), timeout=5) == [1.0]
    module = load_reward("rlctl.rewards:length_reward")  # code: loaded in a child process
    assert module.keywords == ("responses",)
    assert compute_rewards(module, samples(["x" * 50]), timeout=5) == length_reward(["x" * 50])
    assert load_reward("builtin:gsm8k").keywords == ("responses", "ground_truths")
    with pytest.raises(InputError, match="available: countdown, gsm8k, gsm8k_flexible, length"):
        load_reward("builtin:nope")
    with pytest.raises(InputError, match="has no function 'missing'"):
        load_reward(f"{path}:missing")


def test_a_reward_file_imports_the_modules_beside_it(tmp_path):
    (tmp_path / "helpers_for_reward.py").write_text("def score(text):\n    return float(len(text))\n")
    path = tmp_path / "uses_helper.py"
    path.write_text(textwrap.dedent("""
        import helpers_for_reward

        def reward(samples):
            return [helpers_for_reward.score(s) for s in samples]
    """))
    assert compute_rewards(load_reward(f"{path}:reward"), samples(["abc", "de"]), timeout=10) == [3.0, 2.0]


def test_reward_model_scores_in_batches(tmp_path, tiny_model):
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model, num_labels=1)
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_config(config)
    rm.config.pad_token_id = config.pad_token_id
    rm.save_pretrained(tmp_path / "rm")
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(tmp_path / "rm")
    reward = load_reward(f"rm:{tmp_path / 'rm'}", batch_size=2)
    scores = compute_rewards(reward, samples(["hello", "a longer response here", "x"]), timeout=30)
    single = compute_rewards(reward, samples(["a longer response here"]), timeout=30)
    assert len(scores) == 3 and scores[1] == pytest.approx(single[0], abs=1e-4)


def test_a_plain_causal_lm_as_reward_model_is_refused_not_scored_at_random(tiny_model):
    with pytest.raises(InputError, match="not a trained reward model: its classification head or weights \\(score.weight"):
        load_reward(f"rm:{tiny_model}")


def test_the_overlong_penalty_is_dapos_soft_punishment():
    from rlctl.rewards import overlong_penalty

    # max 20 tokens, buffer 8: free up to 12, then -1/8 per token, -penalty at 20
    assert overlong_penalty([5, 12, 13, 16, 20], max_new_tokens=20, buffer=8, penalty=0.5) == [0.0, 0.0, -0.0625, -0.25, -0.5]
    assert overlong_penalty([20], max_new_tokens=20, buffer=0, penalty=1.0) == [0.0]


def test_the_length_penalty_is_kimi_k15s_length_reward_within_each_prompts_samples():
    from rlctl.rewards import length_penalty

    # prompt a: lengths 10..30 → λ = 0.5, 0, -0.5; prompt b: one length → 0
    ids, lengths = ["a", "a", "a", "b", "b"], [10, 20, 30, 7, 7]
    assert length_penalty(ids, lengths, [True, True, True, True, False], weight=1.0) == [0.5, 0.0, -0.5, 0.0, 0.0]
    # a wrong sample never gains for being short, and loses for being long; the weight scales
    assert length_penalty(ids, lengths, [False, False, False, True, True], weight=0.2) == [0.0, 0.0, -0.1, 0.0, 0.0]


def test_score_adds_the_length_penalty_as_a_column_judging_correctness_on_the_reward_as_given():
    import pyarrow as pa

    from rlctl.config import ScoreConfig
    from rlctl.prompt_stream import pass_rates
    from rlctl.rewards import RewardSet, from_callable
    from rlctl.stages.score import shaped_rewards, with_reward_columns

    def correct_when_short(responses):  # a response with "ok" is right
        return [1.0 if "ok" in r else 0.0 for r in responses]

    table = pa.table({
        "id": ["a", "a", "a", "a"], "response": ["ok", "ok ok ok", "no", "no no no"],
        "response_ids": [[1], [1, 2, 3], [4], [4, 5, 6]],
    })
    reward = RewardSet.of(from_callable(correct_when_short, "callable:correct_when_short"))
    scores = shaped_rewards(table, reward, ScoreConfig(length_penalty=0.5))
    assert scores.columns["reward/length_penalty"] == [0.25, -0.25, 0.0, -0.25]
    assert scores.total == [1.25, 0.75, 0.0, -0.25]
    scored = with_reward_columns(table, scores).append_column("reward", pa.array(scores.total, pa.float32()))
    assert scored.column("reward/length_penalty").to_pylist() == [0.25, -0.25, 0.0, -0.25]
    # data.retire_pass_rate judges the reward as given: both "ok" samples pass at 1.0
    assert pass_rates([scored], pass_threshold=1.0) == {"a": 0.5}
    assert shaped_rewards(table, reward, ScoreConfig()).columns == {}  # off by default
    thirds = pa.table({"id": ["b"] * 4, "response": ["ok", "ok ok", "ok ok ok", "ok ok ok ok"], "response_ids": [[1], [1, 2], [1, 2, 3], [1, 2, 3, 4]]})
    shaped = shaped_rewards(thirds, reward, ScoreConfig(length_penalty=1.0))  # λ = 1/2, 1/6, −1/6, −1/2: float32 totals
    table32 = with_reward_columns(thirds, shaped).append_column("reward", pa.array(shaped.total, pa.float32()))
    assert pass_rates([table32], pass_threshold=1.0) == {"b": 1.0}  # every one passed, as given, despite float32's rounding
