"""Rollouts with a tool, end to end on a tiny model: the tool's text lands in the response as
tokens the policy did not sample, later turns are sampled in the context of all that came
before (the trainer's log-probs agree), and the rows do not depend on how they are split."""

import itertools
import json
import re

import numpy as np
import pytest
from transformers import AutoTokenizer

from rlctl import shards

TOOL = '''
def echo(responses):
    """Answer a response that ends at the stop string with its length; one ending "aa" gets no answer."""
    return [None if r.endswith("aa") else f"<r>{len(r)}</r>" for r in responses]
'''


@pytest.fixture
def tool_file(tmp_path):
    path = tmp_path / "tools.py"
    path.write_text(TOOL)
    return str(path)


def rollout_args(prompts_file, tiny_model, tool_file, out):
    return [
        "rollout", "--prompts", prompts_file, "--model", tiny_model, "--out", out, "--n", "4", "--max-new-tokens", "24", "--seed", "3",
        "--stop", "a", "--set", f"rollout.tool={tool_file}:echo", "--set", "rollout.max_tool_calls=2",
    ]


def test_a_tools_text_is_in_the_response_as_tokens_the_policy_did_not_sample(cli, tmp_path, tiny_model, prompts_file, tool_file):
    for out in ("a", "b"):
        result = cli(*rollout_args(prompts_file, tiny_model, tool_file, tmp_path / out))
        assert result.exit_code == 0, result.stderr
    table = shards.read(str(tmp_path / "a"), "rollouts").table
    assert table.equals(shards.read(str(tmp_path / "b"), "rollouts").table)  # the same seed, the same exchanges
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    calls = table.column("tool_calls").to_pylist()
    assert max(calls) == 2 and sum(c > 0 for c in calls) >= 4
    columns = ("response_ids", "loss_mask", "rollout_logprobs", "tool_calls", "response", "finish_reason")
    for ids, mask, logprobs, called, response, finish in zip(*(table.column(c).to_pylist() for c in columns)):
        runs = [[t for t, _ in group] for tool, group in itertools.groupby(zip(ids, mask), key=lambda p: not p[1]) if tool]
        assert len(runs) == called  # one stretch of the tool's tokens per call
        for k, run in enumerate(runs):
            text = tokenizer.decode(run)
            cut_at_the_end = k == len(runs) - 1 and not mask[-1] and finish == "length"  # the tool's text filled the budget
            assert re.fullmatch(r"<r>\d+</r>", text) or (cut_at_the_end and re.fullmatch(r"<(r(>(\d+(<(/(r>?)?)?)?)?)?)?", text)), text
            assert text in response
        assert all(lp == 0.0 for lp, m in zip(logprobs, mask) if not m)
        assert mask[0]  # a response begins with the policy's tokens


def test_a_chat_formatted_tool_answer_is_the_templates_tool_turn(cli, tmp_path, tiny_model, prompts_file, tool_file):
    args = rollout_args(prompts_file, tiny_model, tool_file, tmp_path / "r")
    result = cli(*args, "--chat-template", "--set", "rollout.tool_format=chat", "--set", "rollout.max_tool_calls=1")
    assert result.exit_code == 0, result.stderr
    table = shards.read(str(tmp_path / "r"), "rollouts").table
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    runs = 0
    for ids, mask in zip(*(table.column(c).to_pylist() for c in ("response_ids", "loss_mask"))):
        for tool, group in itertools.groupby(zip(ids, mask), key=lambda p: not p[1]):
            text = tokenizer.decode([t for t, _ in group], skip_special_tokens=False)
            if tool and text.endswith("<|im_start|>assistant\n"):  # a whole turn (one cut by the length limit is its prefix)
                runs += 1
                assert re.fullmatch(r"<\|im_end\|>\n<\|im_start\|>tool\n<r>\d+</r><\|im_end\|>\n<\|im_start\|>assistant\n", text), text
    assert runs >= 3


def test_later_turns_are_sampled_in_the_context_of_everything_before(cli, tmp_path, tiny_model, prompts_file, tool_file):
    """The engine's log-prob of each token it sampled in any turn is the trainer's recomputed
    one over the whole exchange: the context of turn 2 holds the tool's answer."""
    assert cli(*rollout_args(prompts_file, tiny_model, tool_file, tmp_path / "r")).exit_code == 0
    result = cli("score", "--rollouts", tmp_path / "r", "--out", tmp_path / "s", "--reward", "builtin:length", "--policy", tiny_model)
    assert result.exit_code == 0, result.stderr
    scores = shards.read(str(tmp_path / "s"), "scores").table
    mask = np.concatenate([np.asarray(m, dtype=bool) for m in scores.column("loss_mask").to_pylist()])
    engine = np.concatenate([np.asarray(x) for x in scores.column("rollout_logprobs").to_pylist()])[mask]
    trainer = np.concatenate([np.asarray(x) for x in scores.column("old_logprobs").to_pylist()])[mask]
    assert (~mask).sum() > 20 and np.abs(engine - trainer).max() < 1e-4
    assert cli("advantage", "--scores", tmp_path / "s", "--out", tmp_path / "b", "--estimator", "grpo").exit_code == 0
    batch = shards.read(str(tmp_path / "b"), "batch").table
    for advantages, m in zip(batch.column("advantages").to_pylist(), batch.column("loss_mask").to_pylist()):
        assert all(a == 0.0 for a, keep in zip(advantages, m) if not keep)
    result = cli("update", "--batch", tmp_path / "b", "--model", tiny_model, "--out", tmp_path / "c", "--lr", "1e-3", "--json")
    assert result.exit_code == 0, result.stderr


def test_a_tool_that_answers_a_number_is_one_error_line(cli, tmp_path, tiny_model, prompts_file):
    (tmp_path / "bad.py").write_text("def answer(responses):\n    return [3] * len(responses)\n")
    args = rollout_args(prompts_file, tiny_model, "unused", tmp_path / "r")
    args[args.index("rollout.tool=unused:echo")] = f"rollout.tool={tmp_path / 'bad.py'}:answer"
    result = cli(*args)
    assert result.exit_code == 2
    assert "tool" in result.stderr and "returned int for response 0: expected a text or None" in result.stderr
    assert not (tmp_path / "r").exists()


def test_rows_with_tool_turns_spread_over_ranks_come_back_as_one_process_writes_them(ray_session, cli, tmp_path, tiny_model, prompts_file, tool_file):
    for name, extra in (("local", []), ("ray", ["--workers-backend", "ray", "--workers", "2"])):
        result = cli(*rollout_args(prompts_file, tiny_model, tool_file, tmp_path / name), *extra)
        assert result.exit_code == 0, result.stderr
    local, ray = (shards.read(str(tmp_path / name), "rollouts").table for name in ("local", "ray"))
    for column in ("response_ids", "loss_mask", "tool_calls", "finish_reason"):
        assert local.column(column).to_pylist() == ray.column(column).to_pylist(), column


def test_a_pipeline_with_a_tool_replays_its_rollout_only_when_its_code_is_trusted(cli, tmp_path, tiny_model, prompts_file, tool_file):
    config = tmp_path / "run.toml"
    config.write_text(
        f'[model]\npath = "{tiny_model}"\n[data]\nprompts = "{prompts_file}"\nbatch_size = 3\n'
        f'[rollout]\nn = 2\nmax_new_tokens = 16\nstop = ["a"]\ntool = "{tool_file}:echo"\n'
        '[score]\nreward = "builtin:length"\n[update]\nlr = 1e-3\nmini_batch_size = 6\nmicro_batch_size = 6\n'
        '[pipeline]\niterations = 2\nkeep_checkpoints = 0\n[workers]\nthreads = 1\n'
    )
    result = cli("pipeline", config, "--run-dir", tmp_path / "run", "--quiet")
    assert result.exit_code == 0, result.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(row["tool_calls"] > 0 for row in rows)
    refused = cli("replay", tmp_path / "run" / "iter-0002" / "rollout", "--check")
    assert refused.exit_code == 2 and "would run the tool code the run folder names" in refused.stderr
    replayed = cli("replay", tmp_path / "run" / "iter-0002" / "rollout", "--check", "--trust-run-code")
    assert replayed.exit_code == 0 and "identical" in replayed.stdout, replayed.stderr
