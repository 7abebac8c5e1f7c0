"""Multi-turn rollouts with a tool: who gets the next word, where a response ends, whose
tokens are whose, and which random stream each turn draws from."""

import pytest

from rlctl.backends.base import Generation
from rlctl.config import ConfigError
from rlctl.tool_turns import check_tool, first_turn, take_turns, turn_seed


def model_turn(tokens, hit=True, reason="stop"):
    return Generation(list(tokens), [-0.5] * len(tokens), reason), hit


class FakeModel:
    """Answers each continuation with the turns scripted for its row, recording the calls."""

    def __init__(self, script):
        self.script, self.calls = script, []

    def __call__(self, prompts, limit, row_ids, turn):
        self.calls.append((len(prompts), limit, list(row_ids), turn))
        out = [self.script[row].pop(0) for row in row_ids]
        return [g for g, _ in out], [hit for _, hit in out]


def run(first, script, answers, *, max_new_tokens=20, max_tool_calls=3, rows=(0, 1, 2)):
    model = FakeModel(script)
    asked = []

    def call_tool(indices, transcripts):
        asked.append(list(indices))
        return [answers[i].pop(0) for i in indices]

    transcripts = take_turns(
        first_turn([g for g, _ in first], [h for _, h in first], max_new_tokens), [[1, 2]] * len(first), list(rows),
        call_tool=call_tool, tokenize=lambda text: [900 + ord(c) % 50 for c in text], generate=model,
        max_new_tokens=max_new_tokens, max_tool_calls=max_tool_calls,
    )
    return transcripts, model.calls, asked


def test_a_response_that_stops_at_a_stop_string_gets_the_tools_text_and_goes_on():
    first = [model_turn([5, 6]), model_turn([7], hit=False), model_turn([8, 9, 10])]  # row 1 ended at a stop token
    script = {0: [model_turn([11, 12], hit=False)], 2: [model_turn([13], hit=False)]}
    transcripts, calls, asked = run(first, script, {0: ["ab"], 2: [None]})
    assert asked == [[0, 2]]  # only the rows that stopped at a stop string
    a, b, c = transcripts
    assert a.response_ids == [5, 6, 900 + ord("a") % 50, 900 + ord("b") % 50, 11, 12]
    assert a.loss_mask == [True, True, False, False, True, True] and a.logprobs[2:4] == [0.0, 0.0]
    assert (a.tool_calls, a.finish_reason) == (1, "stop")
    assert (b.response_ids, b.tool_calls) == ([7], 0)
    assert (c.response_ids, c.tool_calls, c.finish_reason) == ([8, 9, 10], 0, "stop")  # None: no call, the response ends
    assert calls == [(1, 16, [0], 1)]  # the continuing row alone, its room left, its own stream, turn 1


def test_the_calls_stop_at_max_tool_calls_and_the_tokens_at_max_new_tokens():
    first = [model_turn([5]), model_turn([6]), model_turn([7])]
    script = {0: [model_turn([1]), model_turn([2])], 1: [model_turn([3] * 30)], 2: []}
    transcripts, calls, _ = run(first, script, {0: ["x", "y"], 1: ["z"], 2: ["w" * 40]}, max_new_tokens=12, max_tool_calls=2)
    a, b, c = transcripts
    assert a.tool_calls == 2 and a.response_ids[-1] == 2 and a.finish_reason == "stop"  # ends at its stop string: no third call
    assert len(b.response_ids) == 12 and b.finish_reason == "length" and b.loss_mask == [True, False] + [True] * 10  # the model's turn cut
    assert len(c.response_ids) == 12 and c.finish_reason == "length" and c.loss_mask == [True] + [False] * 11  # the tool's text cut
    assert [call[3] for call in calls] == [1, 2]  # two continuations: turns 1 and 2
    assert calls[0][2] == [0, 1] and calls[1][2] == [0]


def test_a_response_that_stops_at_a_stop_string_on_its_last_token_allowed_ends_there():
    first = [model_turn([5] * 12), model_turn([6])]
    transcripts, calls, asked = run(first, {1: [model_turn([7], hit=False)]}, {1: ["x"]}, max_new_tokens=12, rows=(0, 1))
    assert asked == [[1]] and (transcripts[0].tool_calls, transcripts[0].finish_reason) == (0, "stop")


def test_each_turn_draws_from_its_own_seed_and_the_first_from_the_rollouts():
    assert turn_seed(7, 0) == 7
    assert len({turn_seed(7, t) for t in range(5)}) == 5 and turn_seed(7, 1) != turn_seed(8, 1)


def test_a_tool_needs_a_stop_string_and_must_be_code_or_a_builtin():
    check_tool("", ())
    check_tool("tools.py:calc", ("</calc>",))
    check_tool("builtin:calculator", ("</calc>",))
    with pytest.raises(ConfigError, match="set rollout.stop"):
        check_tool("tools.py:calc", ())
    with pytest.raises(ConfigError, match="no such builtin tool; the builtin tools: calculator"):
        check_tool("builtin:gsm8k", ("</calc>",))
    with pytest.raises(ConfigError, match="expected file.py:function, module:function or builtin:NAME"):
        check_tool("rm:models/x", ("</calc>",))


def test_the_builtin_calculator_answers_a_call_at_the_end_of_a_response_and_runs_nothing():
    from rlctl.calculator import calculate
    from rlctl.rewards import RewardSamples
    from rlctl.tool_turns import Tool

    responses = ["so <calc>23*17</calc>", "<calc>(1 + 2) / 4</calc> ", "<calc>1/0</calc>", "no call here", "<calc>2</calc> then more"]
    samples = RewardSamples([""] * 5, responses, [None] * 5, [None] * 5)
    with Tool.load("builtin:calculator", timeout=5) as tool:
        assert tool(samples) == ["<result>391</result>", "<result>0.75</result>", "<result>error: division by zero</result>", None, None]
    for attack in ("__import__('os').system('true')", "().__class__", "x", "9**9**9", "'a' * 3", "[1, 2]"):
        with pytest.raises(ValueError):
            calculate(attack)
    assert calculate("-2 ** 2") == -4.0 and calculate("7 // 2 + 7 % 2") == 4.0


def test_a_chat_tool_answer_closes_the_assistants_turn_and_opens_the_next(tiny_model):
    from transformers import AutoTokenizer

    from rlctl.tool_turns import chat_turn_text

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    text = chat_turn_text(tokenizer, "<r>42</r>", "tool")
    assert text == "<|im_end|>\n<|im_start|>tool\n<r>42</r><|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids[0]) == "<|im_end|>"  # the template's special tokens, as the model saw them in its prompt
    tokenizer.chat_template = "{% for m in messages %}{% if m['role'] not in ('user', 'assistant') %}{{ raise_exception('roles must alternate') }}{% endif %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ConfigError, match="cannot render a 'tool' message after the assistant's .*roles must alternate.*set rollout.tool_role"):
        chat_turn_text(tokenizer, "x", "tool")
    assert chat_turn_text(tokenizer, "x", "user") == "x"
