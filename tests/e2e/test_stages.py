"""The five stage commands end to end on a tiny local model: determinism, log-prob agreement,
piping, skip-when-current, and bad input."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rlctl import shards
from rlctl.manifest import Manifest
from rlctl.passes import CPU_MICRO_BATCH_TOKENS
from tests.conftest import assert_not_written, one_line_error, part_files

ROLL = ("--n", "2", "--max-new-tokens", "8", "--seed", "3", "--temperature", "0.9")


def part_bytes(folder: Path) -> list[bytes]:
    """The committed parts' bytes in manifest order (names carry a per-write id)."""
    return [p.read_bytes() for p in part_files(folder)]


@pytest.fixture
def scored(cli, tmp_path, tiny_model, prompts_file):
    assert cli("rollout", "--prompts", prompts_file, "--model", tiny_model, "--out", tmp_path / "r", *ROLL).exit_code == 0
    result = cli("score", "--rollouts", tmp_path / "r", "--out", tmp_path / "s", "--reward", "builtin:length", "--ref", tiny_model, "--policy", tiny_model, "--critic", tiny_model)
    assert result.exit_code == 0, result.stderr
    return tmp_path / "s"


def test_rollout_score_advantage_are_byte_identical_for_the_same_seed(cli, tmp_path, tiny_model, prompts_file, scored):
    for name, args in [
        ("r", ["rollout", "--prompts", prompts_file, "--model", tiny_model, *ROLL]),
        ("s", ["score", "--rollouts", tmp_path / "r", "--reward", "builtin:length", "--ref", tiny_model, "--policy", tiny_model, "--critic", tiny_model]),
        ("b", ["advantage", "--scores", tmp_path / "s", "--estimator", "gae", "--kl-coef", "0.05"]),
    ]:
        for copy in ("1", "2"):
            result = cli(*args, "--out", tmp_path / f"{name}{copy}")
            assert result.exit_code == 0, result.stderr
        assert part_bytes(tmp_path / f"{name}1") == part_bytes(tmp_path / f"{name}2")
    assert part_bytes(tmp_path / "r1") == part_bytes(tmp_path / "r")


def test_rollout_rows_follow_the_contract(scored):
    table = shards.read(str(scored), "scores").table
    assert table.num_rows == 6
    assert table.column("id").to_pylist() == ["p0", "p0", "p1", "p1", "p2", "p2"]
    assert table.column("sample").to_pylist() == [0, 1] * 3
    assert set(table.column("finish_reason").to_pylist()) <= {"stop", "length"}
    assert all(len(r) <= 8 for r in table.column("response_ids").to_pylist())


def test_rollout_and_score_manifests_describe_their_samples(tmp_path, scored):
    rollouts = shards.read(str(tmp_path / "r"), "rollouts").table
    lengths = [len(r) for r in rollouts.column("response_ids").to_pylist()]
    metrics = shards.read_manifest(str(tmp_path / "r"))[0].metrics
    assert metrics["response_length"] == pytest.approx(np.mean(lengths)) and metrics["response_length/max"] == max(lengths)
    assert metrics["response_length/clip_ratio"] == pytest.approx(np.mean([r == "length" for r in rollouts.column("finish_reason").to_pylist()]))
    rewards = shards.read(str(scored), "scores").table.column("reward").to_pylist()
    metrics = shards.read_manifest(str(scored))[0].metrics
    assert metrics["reward_max"] == pytest.approx(max(rewards)) and metrics["reward_min"] == pytest.approx(min(rewards))
    assert 0.0 <= metrics["groups/equal_rewards"] <= 1.0


def test_rollout_logprobs_agree_with_scores_old_logprobs(scored):
    table = shards.read(str(scored), "scores").table
    for rollout_lp, old_lp in zip(table.column("rollout_logprobs").to_pylist(), table.column("old_logprobs").to_pylist()):
        np.testing.assert_allclose(rollout_lp, old_lp, atol=1e-4, rtol=0)
    # same weights for the reference: ref == old
    np.testing.assert_allclose(np.concatenate(table.column("ref_logprobs").to_pylist()), np.concatenate(table.column("old_logprobs").to_pylist()), atol=1e-6)


def test_chat_messages_go_through_the_chat_template(scored, tiny_model):
    from transformers import AutoTokenizer

    table = shards.read(str(scored)).table
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    text = tokenizer.decode(table.column("prompt_ids")[2].as_py())
    assert text == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(table.column("prompt_ids")[0].as_py()) == "The answer is"


def test_update_and_reshard_write_loadable_checkpoints(cli, tmp_path, tiny_model, scored):
    from transformers import AutoModelForCausalLM

    assert cli("advantage", "--scores", scored, "--out", tmp_path / "b", "--estimator", "gae", "--kl-coef", "0.05").exit_code == 0
    result = cli("update", "--batch", tmp_path / "b", "--model", tiny_model, "--critic", tiny_model, "--out", tmp_path / "c1", "--lr", "1e-3", "--json")
    assert result.exit_code == 0, result.stderr
    metrics = json.loads(result.stdout)["metrics"]
    assert json.loads(result.stdout)["config"]["update"]["micro_batch_tokens"] == str(CPU_MICRO_BATCH_TOKENS)  # auto, decided here and recorded
    assert metrics["step"] == 1 and {"pg_loss", "vf_loss", "entropy", "kl", "ppo_kl", "pg_clipfrac", "grad_norm", "lr", "tokens_per_s", "seconds"} <= set(metrics)
    AutoModelForCausalLM.from_pretrained(tmp_path / "c1")
    # a second update starts from the first one's optimizer state and step
    result = cli("update", "--batch", tmp_path / "b", "--model", tmp_path / "c1", "--critic", tmp_path / "c1" / "critic", "--out", tmp_path / "c2", "--json")
    assert json.loads(result.stdout)["metrics"]["step"] == 2
    result = cli("reshard", "--checkpoint", tmp_path / "c2", "--out", tmp_path / "w-hf", "--to", "hf", "--dtype", "bf16", "--check")
    assert result.exit_code == 0, result.stderr
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "w-hf")
    assert str(next(model.parameters()).dtype) == "torch.bfloat16"


def test_an_update_that_masks_truncated_responses_says_how_many_it_left_out(cli, tmp_path, tiny_model, prompts_file):
    """Responses that end at a stop string train; those cut at the length limit do not."""
    assert cli("rollout", "--prompts", prompts_file, "--model", tiny_model, "--out", tmp_path / "r", "--n", "4", "--max-new-tokens", "16", "--stop", "a").exit_code == 0
    assert cli("score", "--rollouts", tmp_path / "r", "--out", tmp_path / "s", "--reward", "builtin:length").exit_code == 0
    cli("advantage", "--scores", tmp_path / "s", "--out", tmp_path / "b", "--estimator", "grpo")
    cut = shards.read(str(tmp_path / "b")).table.column("finish_reason").to_pylist()
    result = cli("update", "--batch", tmp_path / "b", "--model", tiny_model, "--out", tmp_path / "u", "--set", "update.mask_truncated=true", "--json")
    assert result.exit_code == 0, result.stderr
    assert 0 < cut.count("length") < len(cut)  # the check covers rows on both sides
    assert json.loads(result.stdout)["metrics"]["truncated_masked"] == pytest.approx(cut.count("length") / len(cut))


def test_a_second_update_goes_on_with_the_first_ones_adaptive_entropy_coefficient(cli, tmp_path, tiny_model, scored):
    """update.entropy_target: the controller's state travels in the checkpoint from one `rlctl
    update` to the next (the tiny model's entropy is far below a target of 100: it rises each step)."""
    cli("advantage", "--scores", scored, "--out", tmp_path / "b", "--estimator", "grpo")
    control = ["--set", "update.entropy_target=100", "--set", "update.entropy_coef=0.01", "--set", "update.entropy_coef_delta=0.01", "--set", "update.mini_batch_size=2"]
    first = cli("update", "--batch", tmp_path / "b", "--model", tiny_model, "--out", tmp_path / "c1", *control, "--json")
    assert first.exit_code == 0, first.stderr
    steps = json.loads(first.stdout)["metrics"]["step"]
    saved = json.loads((tmp_path / "c1" / "trainer_state" / "state.json").read_text())["entropy_control"]
    assert json.loads(first.stdout)["metrics"]["entropy_coef"] == pytest.approx(0.01 + 0.01 * steps) == pytest.approx(saved["coef"])
    second = cli("update", "--batch", tmp_path / "b", "--model", tmp_path / "c1", "--out", tmp_path / "c2", *control, "--json")
    metrics = json.loads(second.stdout)["metrics"]
    assert metrics["entropy_coef"] == pytest.approx(0.01 + 0.02 * steps)  # went on from the first update's coefficient
    assert metrics["entropy_coef_applied"] == pytest.approx(np.mean([0.01 + 0.01 * (steps + k) for k in range(steps)]))  # every step applied it


def test_decoupled_gae_trains_the_critic_on_the_reward_to_go(cli, tmp_path, scored):
    """advantage.critic_lam = 1 with γ = 1 and no KL: every target of a response is its reward
    (the reward to go from any token), whatever the critic's values; the advantages stay λ's."""
    result = cli("advantage", "--scores", scored, "--out", tmp_path / "b", "--estimator", "gae", "--gamma", "1", "--lam", "0.9", "--set", "advantage.critic_lam=1.0")
    assert result.exit_code == 0, result.stderr
    batch = shards.read(str(tmp_path / "b")).table
    for reward, returns in zip(batch.column("reward").to_pylist(), batch.column("returns").to_pylist()):
        np.testing.assert_allclose(returns, [reward] * len(returns), atol=1e-5, rtol=0)
    plain = cli("advantage", "--scores", scored, "--out", tmp_path / "p", "--estimator", "gae", "--gamma", "1", "--lam", "0.9")
    assert plain.exit_code == 0
    assert shards.read(str(tmp_path / "p")).table.column("advantages").to_pylist() == batch.column("advantages").to_pylist()


def test_identical_updates_give_identical_weights(cli, tmp_path, tiny_model, scored):
    cli("advantage", "--scores", scored, "--out", tmp_path / "b", "--estimator", "grpo")
    for name in ("u1", "u2"):
        assert cli("update", "--batch", tmp_path / "b", "--model", tiny_model, "--out", tmp_path / name, "--lr", "1e-3").exit_code == 0
    assert (tmp_path / "u1" / "model.safetensors").read_bytes() == (tmp_path / "u2" / "model.safetensors").read_bytes()


def test_a_current_output_is_skipped_and_force_reruns_it(cli, tmp_path, scored):
    args = ("advantage", "--scores", scored, "--out", tmp_path / "b", "--estimator", "grpo")
    assert cli(*args).exit_code == 0
    again = cli(*args)
    assert again.exit_code == 0 and "up to date, skipped" in again.stderr
    assert "wrote" in cli(*args, "--force").stderr
    assert "wrote" in cli(*args, "--gamma", "0.5").stderr  # a config change is not current


def test_stage_commands_pipe_through_stdout(tmp_path, tiny_model, prompts_file):
    rlctl = [sys.executable, "-m", "rlctl"]
    roll = subprocess.Popen([*rlctl, "rollout", "--prompts", prompts_file, "--model", tiny_model, "--out", "-", *ROLL], stdout=subprocess.PIPE)
    score = subprocess.Popen([*rlctl, "score", "--rollouts", "-", "--out", "-", "--reward", "builtin:length"], stdin=roll.stdout, stdout=subprocess.PIPE)
    roll.stdout.close()
    adv = subprocess.run([*rlctl, "advantage", "--scores", "-", "--out", str(tmp_path / "b"), "--estimator", "grpo"], stdin=score.stdout, capture_output=True)
    assert adv.returncode == 0, adv.stderr.decode()
    assert roll.wait() == 0 and score.wait() == 0
    batch = shards.read(str(tmp_path / "b"), "batch")
    assert batch.table.num_rows == 6
    assert batch.manifest.inputs[0].uri == "-" and batch.manifest.inputs[0].manifest_sha256


def bad(result, out, *fragments):
    assert result.exit_code == 2, (result.exit_code, result.stderr)
    line = one_line_error(result)
    for fragment in fragments:
        assert fragment in line
    assert_not_written(out)


def test_reward_function_that_raises(cli, tmp_path, scored):
    fourth = shards.read(str(scored)).table.column("response")[3].as_py()
    reward = tmp_path / "r.py"
    reward.write_text(f"def reward(samples):\n    return [1 / (s != {fourth!r}) for s in samples]\n")
    bad(cli("score", "--rollouts", scored, "--out", tmp_path / "o", "--reward", f"{reward}:reward"), tmp_path / "o", "ZeroDivisionError", "at sample 3")


def test_nan_reward(cli, tmp_path, scored):
    reward = tmp_path / "r.py"
    reward.write_text("def reward(samples):\n    return [float('nan')] * len(samples)\n")
    bad(cli("score", "--rollouts", scored, "--out", tmp_path / "o", "--reward", f"{reward}:reward"), tmp_path / "o", "returned nan at sample 0")


def test_gae_without_values(cli, tmp_path, scored):
    table = shards.read(str(scored)).table.drop_columns(["values"])
    shards.write(table, str(tmp_path / "nv"), Manifest(stage="score"))
    bad(cli("advantage", "--scores", tmp_path / "nv", "--out", tmp_path / "o", "--estimator", "gae"), tmp_path / "o", "gae needs critic values")


def test_kl_coef_without_ref_logprobs(cli, tmp_path, tiny_model, prompts_file):
    cli("rollout", "--prompts", prompts_file, "--model", tiny_model, "--out", tmp_path / "r", *ROLL)
    cli("score", "--rollouts", tmp_path / "r", "--out", tmp_path / "s", "--reward", "builtin:length")
    bad(cli("advantage", "--scores", tmp_path / "s", "--out", tmp_path / "o", "--kl-coef", "0.1"), tmp_path / "o", "kl_coef > 0 needs ref_logprobs")


def test_too_long_prompt_names_its_id_unless_truncated(cli, tmp_path, tiny_model, prompts_file):
    args = ("rollout", "--prompts", prompts_file, "--model", tiny_model, "--max-prompt-tokens", "5")
    bad(cli(*args, "--out", tmp_path / "o"), tmp_path / "o", "prompt 'p1'", "max_prompt_tokens=5")
    assert cli(*args, "--out", tmp_path / "t", "--truncate", "left", *ROLL).exit_code == 0
    assert max(len(p) for p in shards.read(str(tmp_path / "t")).table.column("prompt_ids").to_pylist()) == 5


def test_drop_leaves_the_too_long_prompts_out_names_them_and_samples_the_rest_as_alone(cli, tmp_path, tiny_model, prompts_file):
    """data.truncate = drop (verl's filter_overlong_prompts): the rows of the prompts that fit
    are the rows a file of only those prompts gives (each row's random stream as there)."""
    from transformers import AutoTokenizer

    from rlctl.config import DataConfig
    from rlctl.stages.rollout import prompt_tokens

    lengths = dict(prompt_tokens(shards.read(prompts_file, "prompts").table, AutoTokenizer.from_pretrained(tiny_model), DataConfig()))
    limit = sorted(len(t) for t in lengths.values())[1]  # the longest prompt is over it, the others not
    over = [pid for pid, tokens in lengths.items() if len(tokens) > limit]
    args = ("rollout", "--model", tiny_model, "--max-prompt-tokens", str(limit), "--truncate", "drop", *ROLL)
    result = cli(*args, "--prompts", prompts_file, "--out", tmp_path / "d")
    assert result.exit_code == 0, result.stderr
    assert f"rlctl: data.truncate = drop: left out 1 of 3 prompts over max_prompt_tokens={limit}: {over[0]!r}" in result.stderr
    kept = tmp_path / "kept.jsonl"
    kept.write_text("".join(line + "\n" for line in Path(prompts_file).read_text().splitlines() if json.loads(line)["id"] not in over))
    assert cli(*args, "--prompts", kept, "--out", tmp_path / "k").exit_code == 0
    dropped, alone = shards.read(str(tmp_path / "d")).table, shards.read(str(tmp_path / "k")).table
    assert over[0] not in dropped.column("id").to_pylist() and dropped.num_rows == 4
    assert dropped.select(["id", "response_ids", "rollout_logprobs"]).equals(alone.select(["id", "response_ids", "rollout_logprobs"]))
    bad(cli(*args[:3], "--max-prompt-tokens", "1", "--truncate", "drop", "--prompts", prompts_file, "--out", tmp_path / "o"), tmp_path / "o", "every prompt (3) is over max_prompt_tokens=1")


def test_the_dropped_tp_target_says_what_to_use_instead(cli, tmp_path, tiny_model):
    bad(cli("reshard", "--checkpoint", tiny_model, "--out", tmp_path / "o", "--to", "tp=2"), tmp_path / "o", "the one target is hf", "vllm.tensor_parallel_size")


def test_score_in_bf16_stays_close_to_fp32(cli, tmp_path, tiny_model, scored):
    result = cli("score", "--rollouts", tmp_path / "r", "--out", tmp_path / "s16", "--reward", "builtin:length", "--ref", tiny_model, "--critic", tiny_model, "--dtype", "bf16")
    assert result.exit_code == 0, result.stderr
    fp32, bf16 = shards.read(str(scored)).table, shards.read(str(tmp_path / "s16")).table
    for column in ("ref_logprobs", "values"):
        np.testing.assert_allclose(np.concatenate(bf16.column(column).to_pylist()), np.concatenate(fp32.column(column).to_pylist()), atol=0.1)


def test_chat_template_flag_renders_plain_prompts(cli, tmp_path, tiny_model, prompts_file):
    from transformers import AutoTokenizer

    result = cli("rollout", "--prompts", prompts_file, "--model", tiny_model, "--out", tmp_path / "c", "--chat-template", *ROLL)
    assert result.exit_code == 0, result.stderr
    first = shards.read(str(tmp_path / "c")).table.column("prompt_ids")[0].as_py()
    assert AutoTokenizer.from_pretrained(tiny_model).decode(first) == "<|im_start|>user\nThe answer is<|im_end|>\n<|im_start|>assistant\n"


def test_a_prompt_template_and_a_system_prompt_shape_every_prompt_before_the_chat_template(cli, tmp_path, tiny_model, prompts_file):
    """A plain prompt goes into the template and becomes the user's message; a conversation
    (messages) keeps its text and gets the system message first."""
    from transformers import AutoTokenizer

    result = cli("rollout", "--prompts", prompts_file, "--model", tiny_model, "--out", tmp_path / "c", "--chat-template",
                 "--prompt-template", "Q: {prompt}\nThink step by step.", "--system-prompt", "Be brief.", *ROLL)
    assert result.exit_code == 0, result.stderr
    table = shards.read(str(tmp_path / "c")).table
    decode = AutoTokenizer.from_pretrained(tiny_model).decode
    rendered = {row_id: decode(ids) for row_id, ids in zip(table.column("id").to_pylist(), table.column("prompt_ids").to_pylist())}
    system = "<|im_start|>system\nBe brief.<|im_end|>\n"
    assert rendered["p0"] == system + "<|im_start|>user\nQ: The answer is\nThink step by step.<|im_end|>\n<|im_start|>assistant\n"
    assert rendered["p1"] == system + "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    assert table.column("prompt").to_pylist()[0] == "The answer is"  # the row keeps the prompt as the data gave it (rewards read it)
    evaluated = cli("eval", "--model", tiny_model, "--prompts", prompts_file, "--reward", "builtin:length", "--n", "1", "--max-new-tokens", "4", "--out", tmp_path / "e",
                    "--chat-template", "--prompt-template", "Q: {prompt}\nThink step by step.", "--system-prompt", "Be brief.")
    assert evaluated.exit_code == 0, evaluated.stderr
    samples = shards.read(str(tmp_path / "e")).table
    assert {row_id: decode(ids) for row_id, ids in zip(samples.column("id").to_pylist(), samples.column("prompt_ids").to_pylist())} == rendered  # eval reads prompts as the rollout does
    plain = cli("rollout", "--prompts", prompts_file, "--model", tiny_model, "--out", tmp_path / "p", "--prompt-template", "Q: {prompt} A:", "--set", "data.max_prompt_tokens=64", *ROLL)
    assert plain.exit_code == 0, plain.stderr
    first = shards.read(str(tmp_path / "p")).table.column("prompt_ids")[0].as_py()
    assert decode(first) == "Q: The answer is A:"


@pytest.mark.parametrize(("args", "fragment"), [
    (["--prompt-template", "Q: A:"], "data.prompt_template must say where the prompt goes with {prompt}"),
    (["--system-prompt", "Be brief."], "prompt 'p0' is plain text, and data.system_prompt is a chat message: set data.chat_template = true"),
])
def test_a_prompt_shape_that_cannot_apply_is_one_line_and_nothing_written(cli, tmp_path, tiny_model, prompts_file, args, fragment):
    result = cli("rollout", "--prompts", prompts_file, "--model", tiny_model, "--out", tmp_path / "bad", *args, *ROLL)
    assert result.exit_code == 2, result.stderr
    assert fragment in one_line_error(result)
    assert_not_written(tmp_path / "bad")


def test_format_parquet_writes_parquet_parts_that_read_back(cli, tmp_path, scored):
    result = cli("advantage", "--scores", scored, "--out", tmp_path / "pq", "--estimator", "grpo", "--format", "parquet", "--rows-per-part", "4")
    assert result.exit_code == 0, result.stderr
    parts = part_files(tmp_path / "pq")
    assert [p.name[-13:] for p in parts] == ["00000.parquet", "00001.parquet"] and sorted(parts) == sorted((tmp_path / "pq").glob("part-*"))
    assert shards.read(str(tmp_path / "pq"), "batch").table.num_rows == 6


def test_score_adds_the_overlong_penalty_from_the_rollouts_own_length_limit(cli, tmp_path, scored):
    result = cli("score", "--rollouts", tmp_path / "r", "--out", tmp_path / "long", "--reward", "builtin:length", "--set", "score.overlong_buffer=4", "--set", "score.overlong_penalty=0.5")
    assert result.exit_code == 0, result.stderr
    plain, shaped = shards.read(str(scored)).table, shards.read(str(tmp_path / "long")).table
    limit = json.loads(plain.schema.metadata[b"rlctl.sampling"])["max_new_tokens"]
    for base, reward, ids in zip(plain.column("reward").to_pylist(), shaped.column("reward").to_pylist(), shaped.column("response_ids").to_pylist()):
        expected = base + min(-(len(ids) - (limit - 4)) / 4 * 0.5, 0.0)
        assert reward == pytest.approx(expected, abs=1e-6)
    too_long = cli("score", "--rollouts", tmp_path / "r", "--out", tmp_path / "bad", "--reward", "builtin:length", "--set", f"score.overlong_buffer={limit}")
    bad(too_long, tmp_path / "bad", "needs rollouts that record a max_new_tokens above it")


def test_score_with_weighted_verl_and_trl_rewards_records_every_component(cli, tmp_path, scored):
    (tmp_path / "their_rewards.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': len(solution_str) / 10, 'words': len(solution_str.split())}\n\n"
        "def short(prompts, completions, **kwargs):  # a chat row's completion is a message list, as in TRL\n"
        "    texts = [c[0]['content'] if isinstance(c, list) else c for c in completions]\n"
        "    return [1.0 if len(t) < 20 else None for t in texts]\n"
    )
    (tmp_path / "score.toml").write_text(
        f'[score]\nrewards = [{{fn = "{tmp_path}/their_rewards.py:compute_score", weight = 2.0, name = "verl"}}, '
        f'{{fn = "{tmp_path}/their_rewards.py:short", weight = 0.5}}]\n'
    )
    result = cli("score", "--rollouts", tmp_path / "r", "--out", tmp_path / "multi", "--config", tmp_path / "score.toml")
    assert result.exit_code == 0, result.stderr
    table = shards.read(str(tmp_path / "multi"), "scores").table
    responses = table.column("response").to_pylist()
    assert table.column("reward/verl").to_pylist() == pytest.approx([len(r) / 10 for r in responses])
    assert table.column("reward/verl/words").to_pylist() == [float(len(r.split())) for r in responses]
    assert table.column("reward/short").to_pylist() == [1.0 if len(r) < 20 else None for r in responses]
    expected = [2 * len(r) / 10 + (0.5 if len(r) < 20 else 0.0) for r in responses]
    assert table.column("reward").to_pylist() == pytest.approx(expected, rel=1e-6)
    assert cli("advantage", "--scores", tmp_path / "multi", "--out", tmp_path / "adv").exit_code == 0


def test_eval_summarizes_samples_of_every_prompt_and_commits_them_where_asked(cli, tmp_path, tiny_model, prompts_file):
    args = ("eval", "--model", tiny_model, "--prompts", prompts_file, "--reward", "builtin:length", "--n", "4", "--max-new-tokens", "8", "--pass-threshold", "0.05")
    result = cli(*args, "--json", "--out", tmp_path / "e")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert [row["source"] for row in summary] == ["all", "count", "toy"] and summary[0]["prompts"] == 3 and summary[0]["samples"] == 4
    assert set(summary[0]["pass_at"]) == {"1", "2", "4"}
    scored = shards.read(str(tmp_path / "e"), "scores")
    rewards = scored.table.column("reward").to_pylist()
    assert scored.table.num_rows == 12 and summary[0]["mean"] == pytest.approx(sum(rewards) / 12, abs=1e-6)
    assert scored.manifest.stage == "eval" and scored.manifest.metrics["eval/mean@4"] == summary[0]["mean"]
    table = cli(*args)
    assert table.exit_code == 0 and "pass@4" in table.stdout and "toy" in table.stdout
    assert summary[0]["majority"] is None and "maj@" not in table.stdout  # the length reward reads no answer
    missing = cli("eval", "--model", tiny_model, "--prompts", tmp_path / "none.jsonl", "--reward", "builtin:length", "--out", tmp_path / "x")
    assert missing.exit_code == 2 and one_line_error(missing) and not (tmp_path / "x").exists()


def test_remax_greedy_baselines_are_greedy_rollouts_scored_as_samples_and_subtracted_from_their_rewards(cli, tmp_path, tiny_model, prompts_file, scored):
    """rollout --greedy-baseline adds each prompt's greedy response beside its samples (which
    stay the rows they are without it); score gives it the samples' reward and shaping
    (baseline_reward); advantage --estimator remax is reward − baseline_reward on every token."""
    shaping = ("--reward", "builtin:length", "--set", "score.overlong_buffer=4", "--set", "score.overlong_penalty=0.5")
    assert cli("rollout", "--prompts", prompts_file, "--model", tiny_model, "--out", tmp_path / "rb", *ROLL, "--greedy-baseline").exit_code == 0
    assert cli("rollout", "--prompts", prompts_file, "--model", tiny_model, "--out", tmp_path / "g", "--n", "1", "--max-new-tokens", "8", "--temperature", "0").exit_code == 0
    with_baseline, plain, greedy = (shards.read(str(tmp_path / name)).table for name in ("rb", "r", "g"))
    assert with_baseline.drop_columns(["baseline_response_ids", "baseline_response"]).to_pylist() == plain.to_pylist()
    greedy_ids = {row["id"]: row["response_ids"] for row in greedy.to_pylist()}
    assert [greedy_ids[i] for i in with_baseline.column("id").to_pylist()] == with_baseline.column("baseline_response_ids").to_pylist()
    for rollouts, out in (("rb", "sb"), ("g", "sg")):
        result = cli("score", "--rollouts", tmp_path / rollouts, "--out", tmp_path / out, *shaping)
        assert result.exit_code == 0, result.stderr
    greedy_reward = {row["id"]: row["reward"] for row in shards.read(str(tmp_path / "sg")).table.to_pylist()}
    scores = shards.read(str(tmp_path / "sb"), "scores").table
    assert scores.column("baseline_reward").to_pylist() == [greedy_reward[i] for i in scores.column("id").to_pylist()]
    assert len(set(greedy_reward.values())) > 1  # the prompts' baselines differ
    manifest = json.loads((tmp_path / "sb" / "_manifest.json").read_text())
    assert manifest["metrics"]["baseline_reward_mean"] == pytest.approx(np.mean(scores.column("baseline_reward").to_numpy()))
    result = cli("advantage", "--scores", tmp_path / "sb", "--out", tmp_path / "b", "--estimator", "remax")
    assert result.exit_code == 0, result.stderr
    for row in shards.read(str(tmp_path / "b"), "batch").table.to_pylist():
        assert row["advantages"] == pytest.approx([row["reward"] - row["baseline_reward"]] * len(row["response_ids"]), abs=1e-6)
        assert row["returns"] == pytest.approx([row["reward"]] * len(row["response_ids"]), abs=1e-6)
    bad(cli("advantage", "--scores", scored, "--out", tmp_path / "o", "--estimator", "remax"), tmp_path / "o", "remax needs baseline_reward", "rollout.greedy_baseline")


def test_gpg_advantages_scale_the_group_centred_rewards_by_the_batch_over_the_rows_that_compare_and_train(cli, tmp_path, tiny_model, scored):
    """advantage --estimator gpg: α·(reward − its prompt's mean) on every token, α = rows / rows
    of prompts whose rewards differ; update --set update.policy_loss=gpg trains on it unclipped."""
    reward = tmp_path / "reward.py"
    reward.write_text(
        "def length_but_flat_counting(responses, data_sources):\n"
        "    return [0.5 if source == 'count' else len(r) / 100 for r, source in zip(responses, data_sources)]\n"
    )
    result = cli("score", "--rollouts", tmp_path / "r", "--out", tmp_path / "s-gpg", "--reward", f"{reward}:length_but_flat_counting")
    assert result.exit_code == 0, result.stderr
    result = cli("advantage", "--scores", tmp_path / "s-gpg", "--out", tmp_path / "b", "--estimator", "gpg")
    assert result.exit_code == 0, result.stderr
    rows = shards.read(str(tmp_path / "b"), "batch").table.to_pylist()
    groups = {}
    for row in rows:
        groups.setdefault(row["id"], []).append(row["reward"])
    differ = {key for key, rewards in groups.items() if len(set(rewards)) > 1}
    assert differ and len(differ) < len(groups)  # both kinds of prompt, so α is neither 1 nor undefined
    alpha = len(rows) / sum(len(groups[key]) for key in differ)
    for row in rows:
        expected = alpha * (row["reward"] - np.mean(groups[row["id"]])) if row["id"] in differ else 0.0
        assert row["advantages"] == pytest.approx([expected] * len(row["response_ids"]), abs=1e-6)
    result = cli("update", "--batch", tmp_path / "b", "--model", tiny_model, "--out", tmp_path / "c", "--lr", "1e-3", "--set", "update.policy_loss=gpg", "--json")
    assert result.exit_code == 0, result.stderr
    metrics = json.loads(result.stdout)["metrics"]
    assert metrics["pg_clipfrac"] == 0 and metrics["grad_norm"] > 0


def test_the_optimal_token_baseline_weighs_each_groups_returns_by_the_policys_gradient_norms_and_trains(cli, tmp_path, tiny_model, scored):
    """score --policy --sum-pi-squared writes each token's Σπ² beside its old log-prob (so that
    1 − 2π + Σπ², a squared gradient norm, lies in [0, 2]); advantage --estimator
    optimal_token_baseline subtracts, at the first token, the group's returns weighted by it;
    update trains on it. Without the column the estimator is refused, as is --sum-pi-squared
    without a policy."""
    result = cli("score", "--rollouts", tmp_path / "r", "--out", tmp_path / "s-otb", "--reward", "builtin:length", "--policy", tiny_model, "--sum-pi-squared")
    assert result.exit_code == 0, result.stderr
    rows = shards.read(str(tmp_path / "s-otb"), "scores").table.to_pylist()
    for row in rows:
        assert len(row["sum_pi_squared"]) == len(row["old_logprobs"]) == len(row["response_ids"])
        assert all(0 <= 1 - 2 * math.exp(lp) + sq <= 2 + 1e-6 and 0 < sq <= 1 + 1e-6 for lp, sq in zip(row["old_logprobs"], row["sum_pi_squared"]))
    result = cli("advantage", "--scores", tmp_path / "s-otb", "--out", tmp_path / "b", "--estimator", "optimal_token_baseline")
    assert result.exit_code == 0, result.stderr
    batch = shards.read(str(tmp_path / "b"), "batch").table.to_pylist()
    for row in batch:
        group = [other for other in batch if other["id"] == row["id"] and other["response_ids"]]
        weights = [max(0.0, 1 - 2 * math.exp(other["old_logprobs"][0]) + other["sum_pi_squared"][0]) for other in group]
        baseline = sum(w * other["reward"] for w, other in zip(weights, group)) / (sum(weights) + 1e-8)
        if row["response_ids"]:
            assert row["advantages"][0] == pytest.approx(row["reward"] - baseline if len(group) > 1 else 0.0, abs=1e-5)
    assert any(abs(row["advantages"][0]) > 1e-3 for row in batch if row["response_ids"])
    result = cli("update", "--batch", tmp_path / "b", "--model", tiny_model, "--out", tmp_path / "c", "--lr", "1e-3", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["metrics"]["grad_norm"] > 0
    weighted = cli("advantage", "--scores", tmp_path / "s-otb", "--out", tmp_path / "b-is", "--estimator", "optimal_token_baseline", "--set", "update.rollout_is=sequence")
    assert weighted.exit_code == 0, weighted.stderr
    assert shards.read_manifest(str(tmp_path / "b-is"))[0].config["advantage"]["otb_rollout_is"] == "sequence"  # auto: the config's update
    bad(cli("advantage", "--scores", scored, "--out", tmp_path / "o", "--estimator", "optimal_token_baseline"), tmp_path / "o", "sum_pi_squared", "--sum-pi-squared")
    bad(cli("score", "--rollouts", tmp_path / "r", "--out", tmp_path / "o", "--reward", "builtin:length", "--sum-pi-squared"), tmp_path / "o", "--policy")


@pytest.mark.parametrize("flag,key,value", [("--min-p", "min_p", 0.2), ("--repetition-penalty", "repetition_penalty", 1.3)])
def test_rollout_with_min_p_or_a_repetition_penalty_records_it_with_the_sampling_and_stays_seeded(cli, tmp_path, tiny_model, prompts_file, flag, key, value):
    from rlctl.stages.rollout import sampling_of

    args = ("rollout", "--prompts", prompts_file, "--model", tiny_model, "--n", "2", "--max-new-tokens", "6", "--seed", "5", "--temperature", "1.5")
    for name, extra in (("a", (flag, str(value))), ("b", (flag, str(value))), ("plain", ())):
        assert cli(*args, *extra, "--out", tmp_path / name).exit_code == 0
    a, b, plain = (shards.read(str(tmp_path / name), "rollouts").table for name in ("a", "b", "plain"))
    assert sampling_of(a)[key] == value and a.column("response_ids").to_pylist() == b.column("response_ids").to_pylist()
    assert key not in sampling_of(plain)  # off: the sampling recorded as before the setting existed


def test_policy_filtration_trains_on_the_batch_redrawn_from_its_best_and_worst_samples(cli, tmp_path, tiny_model, scored):
    """advantage --pf-ppo max_min: as many rows as scored, each a scored row with its
    advantages, all with the batch's highest or lowest reward; the manifest says how many
    distinct rows were drawn. An unknown method is one line, exit 2."""
    result = cli("advantage", "--scores", scored, "--out", tmp_path / "b", "--estimator", "gae", "--pf-ppo", "max_min", "--json")
    assert result.exit_code == 0, result.stderr
    metrics = json.loads(result.stdout)["metrics"]
    assert cli("advantage", "--scores", scored, "--out", tmp_path / "whole", "--estimator", "gae").exit_code == 0
    whole = {(r["id"], r["sample"]): r for r in shards.read(str(tmp_path / "whole"), "batch").table.to_pylist()}
    rows = shards.read(str(tmp_path / "b"), "batch").table.to_pylist()
    rewards = [r["reward"] for r in whole.values()]
    assert len(rows) == len(whole) and all(row == whole[row["id"], row["sample"]] and row["reward"] in (max(rewards), min(rewards)) for row in rows)
    assert metrics["pf_ppo/distinct_rows"] == len({(r["id"], r["sample"]) for r in rows}) / len(rows)
    bad(cli("advantage", "--scores", scored, "--out", tmp_path / "o", "--pf-ppo", "best"), tmp_path / "o", "advantage.pf_ppo", "max_min")


def test_update_rejects_the_tokens_whose_old_policy_strays_from_the_engines_and_says_how_many(cli, tmp_path, tiny_model, scored):
    """update.rollout_rs on a batch whose old log-probs were scored in bf16 (the fp32 engine's
    differ): tight bounds reject tokens and the manifest's metrics say the share; a batch
    scored without --policy has no old log-probs to compare, and is refused."""
    result = cli("score", "--rollouts", tmp_path / "r", "--out", tmp_path / "s16", "--reward", "builtin:length", "--policy", tiny_model, "--set", "score.dtype=bf16")
    assert result.exit_code == 0, result.stderr
    assert cli("advantage", "--scores", tmp_path / "s16", "--out", tmp_path / "b").exit_code == 0
    rules = ("--set", "update.rollout_rs=token_k1,seq_max_k3", "--set", "update.rollout_rs_threshold=0.999_1.001,1")
    result = cli("update", "--batch", tmp_path / "b", "--model", tiny_model, "--out", tmp_path / "c", "--lr", "1e-3", *rules, "--json")
    assert result.exit_code == 0, result.stderr
    metrics = json.loads(result.stdout)["metrics"]
    assert 0 < metrics["rollout_rs/masked_fraction"] < 1 and metrics["rollout_rs/token_k1/masked_fraction"] == metrics["rollout_rs/masked_fraction"]
    assert metrics["rollout_rs/seq_max_k3/masked_fraction"] == 0  # a k3 of 1 is far beyond bf16's rounding
    assert cli("score", "--rollouts", tmp_path / "r", "--out", tmp_path / "s-plain", "--reward", "builtin:length").exit_code == 0
    assert cli("advantage", "--scores", tmp_path / "s-plain", "--out", tmp_path / "b-plain").exit_code == 0
    bad(cli("update", "--batch", tmp_path / "b-plain", "--model", tiny_model, "--out", tmp_path / "o", *rules), tmp_path / "o", "no old_logprobs", "score with --policy")


def test_eval_votes_on_the_answers_a_reward_reports_and_gives_the_majoritys_reward(cli, tmp_path, tiny_model, prompts_file):
    """A verl-style reward's `pred` is each sample's answer: maj@n is the mean over prompts of the
    reward of their most common answer (first given on a tie), in the table, JSON and manifest."""
    reward = tmp_path / "votes.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': len(solution_str) / 100, 'pred': str(len(solution_str) % 3)}\n"
    )
    args = ("eval", "--model", tiny_model, "--prompts", prompts_file, "--reward", f"{reward}:compute_score", "--n", "5", "--max-new-tokens", "8", "--temperature", "1.0")
    result = cli(*args, "--json", "--out", tmp_path / "e")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    rows = shards.read(str(tmp_path / "e"), "scores").table.to_pylist()
    expected = []
    for key in dict.fromkeys(row["id"] for row in rows):
        samples = [row for row in rows if row["id"] == key]
        votes = [row["reward/pred"] for row in samples]
        top = max(votes, key=lambda answer: (votes.count(answer), -votes.index(answer)))
        expected.append(next(row["reward"] for row in samples if row["reward/pred"] == top))
    assert summary[0]["majority"] == pytest.approx(sum(expected) / len(expected), abs=1e-6)
    assert shards.read(str(tmp_path / "e"), "scores").manifest.metrics["eval/maj@5"] == summary[0]["majority"]
    assert "maj@5" in cli(*args).stdout


def test_a_stage_configs_reward_and_tool_files_are_relative_to_the_config_file(cli, tmp_path, scored):
    """`--config DIR/c.toml` reads `reward = "r.py:fn"` as DIR/r.py, as a pipeline config does
    (so `rlctl eval --config examples/tool_use.toml` finds its tool and reward from anywhere)."""
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "r.py").write_text("def three(responses):\n    return [3.0 for _ in responses]\n")
    (folder / "c.toml").write_text('[score]\nreward = "r.py:three"\n')
    result = cli("score", "--rollouts", tmp_path / "r", "--out", tmp_path / "s3", "--config", folder / "c.toml")
    assert result.exit_code == 0, result.stderr
    assert set(shards.read(str(tmp_path / "s3"), "scores").table.column("reward").to_pylist()) == {3.0}
    result = cli("score", "--rollouts", tmp_path / "r", "--out", tmp_path / "s4", "--config", folder / "c.toml", "--reward", "builtin:length")
    assert result.exit_code == 0, result.stderr  # a flag is the command line's: it overrides the file's value as given


def test_online_dpo_advantages_come_from_the_policys_and_the_references_log_probs_and_need_the_reference(cli, tmp_path, tiny_model, scored):
    """advantage --estimator online_dpo: each prompt's best and worst sample get opposite
    advantages (its other samples none), scaled for the update's aggregation of the config;
    scores without the reference's log-probs are refused."""
    from rlctl.algos.advantages import ESTIMATORS, PreferencePairs, aggregation_divisors
    from rlctl.tensors import mask_from_lengths, padded

    result = cli("advantage", "--scores", scored, "--out", tmp_path / "b", "--estimator", "online_dpo", "--set", "advantage.dpo_beta=0.5", "--set", "update.loss_agg_mode=seq-mean-token-sum")
    assert result.exit_code == 0, result.stderr
    batch = shards.read(str(tmp_path / "b"), "batch").table
    lengths = np.array([len(r) for r in batch.column("response_ids").to_pylist()])
    mask = mask_from_lengths(lengths, int(lengths.max()))
    token_rewards = torch.zeros(mask.shape, dtype=torch.float64)
    token_rewards[torch.arange(len(lengths)), torch.from_numpy(lengths - 1)] = torch.tensor(batch.column("reward").to_pylist(), dtype=torch.float64)
    _, groups = np.unique(np.asarray(batch.column("id").to_pylist(), dtype=object).astype(str), return_inverse=True)
    pairs = PreferencePairs(
        padded(batch.column("old_logprobs"), width=mask.shape[1]), padded(batch.column("ref_logprobs"), width=mask.shape[1]),
        aggregation_divisors(mask, "seq-mean-token-sum", mask.shape[1]), 0.5,
    )
    want = ESTIMATORS.get("online_dpo")(
        token_rewards=token_rewards, response_mask=mask, values=None, group_index=torch.from_numpy(groups), gamma=1.0, lam=1.0, norm_by_std=True, pairs=pairs,
    ).advantages
    got = batch.column("advantages").to_pylist()
    assert all(row == pytest.approx(want[i, : len(row)].tolist(), abs=1e-6) for i, row in enumerate(got))
    assert any(any(row) for row in got)
    assert cli("score", "--rollouts", tmp_path / "r", "--out", tmp_path / "s0", "--reward", "builtin:length").exit_code == 0
    bad(cli("advantage", "--scores", tmp_path / "s0", "--out", tmp_path / "o", "--estimator", "online_dpo"), tmp_path / "o", "estimator online_dpo compares with the reference: score with --ref")


def test_gdpo_normalizes_the_rewards_the_score_stage_recorded_one_by_one(cli, tmp_path, scored):
    """A score of several rewards records which columns the total sums and their weights; the
    gdpo estimator reads those columns (each normalized in its group, weighted, summed, whitened)
    and refuses scores of one reward, and a KL penalty in the reward."""
    from rlctl.algos.advantages import ESTIMATORS, RewardComponents
    from rlctl.stages.score import reward_components
    from rlctl.tensors import list_lengths

    (tmp_path / "rewards.py").write_text("def vowels(responses):\n    return [float(sum(c in 'aeiou' for c in r)) for r in responses]\n")
    config = tmp_path / "rewards.toml"
    config.write_text(f'[score]\nrewards = [{{fn = "builtin:length", name = "len"}}, {{fn = "{tmp_path / "rewards.py"}:vowels", weight = 0.5}}]\n')
    result = cli("score", "--rollouts", tmp_path / "r", "--out", tmp_path / "s2", "--config", config)
    assert result.exit_code == 0, result.stderr
    scores = shards.read(str(tmp_path / "s2"), "scores").table
    assert reward_components(scores) == {"reward/len": 1.0, "reward/vowels": 0.5}
    result = cli("advantage", "--scores", tmp_path / "s2", "--out", tmp_path / "b", "--estimator", "gdpo")
    assert result.exit_code == 0, result.stderr
    batch = shards.read(str(tmp_path / "b")).table
    columns = torch.tensor([scores.column(c).to_pylist() for c in ("reward/len", "reward/vowels")], dtype=torch.float64).T
    lengths = list_lengths(scores.column("response_ids"))
    mask = torch.arange(int(lengths.max())).unsqueeze(0) < torch.from_numpy(lengths).unsqueeze(1)
    _, groups = np.unique(np.asarray(scores.column("id").to_pylist(), dtype=str), return_inverse=True)
    expected = ESTIMATORS.get("gdpo")(
        token_rewards=torch.zeros(mask.shape, dtype=torch.float64), response_mask=mask, values=None, group_index=torch.from_numpy(groups), gamma=1.0, lam=1.0,
        norm_by_std=True, components=RewardComponents(columns, torch.tensor([1.0, 0.5], dtype=torch.float64)),
    ).advantages
    got = batch.column("advantages").to_pylist()
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(got[i], expected[i, :n].numpy(), atol=1e-6, rtol=0)
    assert any(abs(row[0]) > 0.1 for row in got if row)  # the rewards differed within groups
    bad(cli("advantage", "--scores", scored, "--out", tmp_path / "o1", "--estimator", "gdpo"), tmp_path / "o1", "estimator gdpo normalizes each of several rewards", "score.rewards")
    bad(cli("advantage", "--scores", tmp_path / "s2", "--out", tmp_path / "o2", "--estimator", "gdpo", "--kl-coef", "0.1"), tmp_path / "o2", "advantage.kl_coef", "update.use_kl_loss")


FILTER_REWARD = '''
def reward(prompts, responses):
    """"easy" prompts always pass, "hard" ones never, "mid" ones when the response has an even length."""
    return [1.0 if "easy" in p else 0.0 if "hard" in p else float(len(r) % 2 == 0) for p, r in zip(prompts, responses)]
'''


def test_eval_keeps_the_prompts_whose_pass_rate_lies_in_range_as_they_are(cli, tmp_path, tiny_model):
    (tmp_path / "reward.py").write_text(FILTER_REWARD)
    rows = [{"id": f"{kind}-{k}", "prompt": f"{kind} question {k}", "ground_truth": str(k), "data_source": kind} for kind in ("easy", "hard", "mid") for k in range(4)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = cli("eval", "--model", tiny_model, "--prompts", tmp_path / "p.jsonl", "--reward", f"{tmp_path / 'reward.py'}:reward", "--n", "4",
                 "--max-new-tokens", "5", "--out", tmp_path / "scored", "--keep-prompts", tmp_path / "kept", "--min-pass-rate", "0.1", "--max-pass-rate", "0.9")
    assert result.exit_code == 0, result.stderr
    scored = shards.read(str(tmp_path / "scored")).table
    passed: dict[str, list[float]] = {}
    for row_id, reward in zip(scored.column("id").to_pylist(), scored.column("reward").to_pylist()):
        passed.setdefault(row_id, []).append(reward >= 1.0)
    between = {row_id for row_id, p in passed.items() if 0.1 <= sum(p) / len(p) <= 0.9}
    assert between and all(row_id.startswith("mid") for row_id in between)  # some mid prompts pass some of the time
    kept = shards.read(str(tmp_path / "kept"), "prompts")
    assert set(kept.table.column("id").to_pylist()) == between
    assert kept.table.to_pylist() == [r for r in rows if r["id"] in between]  # every column, in the file's order
    rates = {row_id: sum(p) / len(p) for row_id, p in passed.items()}
    assert kept.manifest.metrics == {
        "prompts/kept": len(between), "prompts/over": sum(r > 0.9 for r in rates.values()), "prompts/under": sum(r < 0.1 for r in rates.values()), "prompts/unscored": 0,
    }
    assert kept.manifest.metrics["prompts/over"] >= 4 and kept.manifest.metrics["prompts/under"] >= 4  # the easy ones, the hard ones
    assert f"rlctl: kept {len(between)} of 12 prompts in {tmp_path / 'kept'}: pass rate in [0.1, 0.9]" in result.stderr


@pytest.mark.parametrize(("args", "fragment"), [
    (["--min-pass-rate", "0.1"], "--min-pass-rate and --max-pass-rate choose the prompts --keep-prompts writes: give --keep-prompts OUT"),
    (["--keep-prompts", "KEPT", "--min-pass-rate", "0.8", "--max-pass-rate", "0.2"], "must satisfy 0 ≤ min ≤ max ≤ 1, got 0.8 and 0.2"),
    (["--keep-prompts", "KEPT", "--min-pass-rate", "1.5", "--max-pass-rate", "2"], "must satisfy 0 ≤ min ≤ max ≤ 1"),
    (["--keep-prompts", "KEPT", "--max-pass-rate", "0", "--min-pass-rate", "0", "--pass-threshold", "-1"], "no prompt's pass rate lies in [0, 0] (3 above, 0 below): nothing to keep"),
])
def test_a_prompt_filter_that_cannot_apply_is_one_line_and_nothing_written(cli, tmp_path, tiny_model, prompts_file, args, fragment):
    args = [str(tmp_path / "kept") if a == "KEPT" else a for a in args]
    result = cli("eval", "--model", tiny_model, "--prompts", prompts_file, "--reward", "builtin:length", "--max-new-tokens", "2", *args)
    assert result.exit_code == 2, result.stderr
    assert fragment in one_line_error(result)
    assert_not_written(tmp_path / "kept")
