"""Bad input: exit code 2, exactly one stderr line naming the file / column / key / line,
and no output folder left behind."""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pytest

from rlctl import shards
from rlctl.manifest import MANIFEST_NAME, Manifest
from tests.conftest import assert_not_written, one_line_error, part_files
from tests.unit.test_shards import ROLLOUT_VALUES


def rollouts(tmp_path, **overrides) -> str:
    """A committed rollouts folder, optionally with columns replaced (validation bypassed)."""
    table = pa.table({**ROLLOUT_VALUES, **overrides})
    uri = str(tmp_path / "in")
    shards.write(table, uri, Manifest(stage="rollout"))
    return uri


def advantage(cli, source, out, *extra):
    return cli("advantage", "--scores", source, "--out", out, "--estimator", "grpo", *extra)


def score(cli, source, out):
    return cli("score", "--rollouts", source, "--out", out, "--reward", "builtin:length")


def check(result, out, *fragments):
    assert result.exit_code == 2, (result.exit_code, result.stderr)
    line = one_line_error(result)
    for fragment in fragments:
        assert fragment in line, line
    assert_not_written(out)


def test_truncated_arrow_file(cli, tmp_path):
    rollouts(tmp_path)
    bad = tmp_path / "bad.arrow"
    bad.write_bytes(part_files(tmp_path / "in")[0].read_bytes()[:200])
    check(score(cli, bad, tmp_path / "out"), tmp_path / "out", "bad.arrow", "truncated")


def test_folder_without_manifest(cli, tmp_path):
    source = rollouts(tmp_path)
    (tmp_path / "in" / MANIFEST_NAME).unlink()
    check(score(cli, source, tmp_path / "out"), tmp_path / "out", source, "no _manifest.json")


def test_missing_required_column(cli, tmp_path):
    source = str(tmp_path / "in")
    shards.write(pa.table(ROLLOUT_VALUES).drop_columns(["response_ids"]), source, Manifest(stage="rollout"))
    check(score(cli, source, tmp_path / "out"), tmp_path / "out", "missing required column 'response_ids'")


def test_column_of_the_wrong_type(cli, tmp_path):
    source = rollouts(tmp_path, finish_reason=[1, 2, 3])
    check(score(cli, source, tmp_path / "out"), tmp_path / "out", "column 'finish_reason'", "expected string")


def test_schema_of_a_newer_major_version(cli, tmp_path):
    table = pa.table(ROLLOUT_VALUES).replace_schema_metadata({b"rlctl.schema": b"rollouts", b"rlctl.schema_version": b"9.0"})
    source = str(tmp_path / "in")
    shards.write(table, source, Manifest(stage="rollout"))
    check(score(cli, source, tmp_path / "out"), tmp_path / "out", "9.0 is newer than this rlctl reads (1.2)")


def test_per_token_list_length_differs_from_response_ids(cli, tmp_path):
    bad = pa.array([[-1.0], [-0.5], [-0.25, -1.0]], pa.list_(pa.float32()))
    source = rollouts(tmp_path, rollout_logprobs=bad)
    check(score(cli, source, tmp_path / "out"), tmp_path / "out", "'rollout_logprobs' row 0 has 1 values but response_ids has 3")


def test_malformed_jsonl_line(cli, tmp_path, tiny_model):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b"\n')
    result = cli("rollout", "--prompts", prompts, "--model", tiny_model, "--out", tmp_path / "out")
    check(result, tmp_path / "out", "p.jsonl line 2")


def test_unknown_toml_key(cli, tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("[advantage]\nestimatr = 'grpo'\n")
    result = advantage(cli, rollouts(tmp_path), tmp_path / "out", "--config", config)
    check(result, tmp_path / "out", "advantage.estimatr", "did you mean advantage.estimator")


def test_toml_syntax_error(cli, tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("[advantage]\n\ngamma = = 1\n")
    check(advantage(cli, rollouts(tmp_path), tmp_path / "out", "--config", config), tmp_path / "out", "c.toml", "line 3")


def test_set_of_an_unknown_key(cli, tmp_path):
    result = advantage(cli, rollouts(tmp_path), tmp_path / "out", "--set", "advantage.gama=0.9")
    check(result, tmp_path / "out", "advantage.gama", "did you mean advantage.gamma")


def test_input_url_that_does_not_exist(cli, tmp_path):
    check(score(cli, tmp_path / "nowhere", tmp_path / "out"), tmp_path / "out", "nowhere", "does not exist")
    check(score(cli, "memory://nowhere-at-all", tmp_path / "out"), tmp_path / "out", "memory://nowhere-at-all")


def test_json_with_stdout_output_is_refused(cli, tmp_path):
    result = cli("score", "--rollouts", rollouts(tmp_path), "--out", "-", "--reward", "builtin:length", "--json")
    check(result, tmp_path / "out", "--json")


def test_show_json_of_a_shard(cli, tmp_path):
    source = rollouts(tmp_path)
    result = cli("show", source, "--json", "--rows", "1")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert data["rows"] == 3 and len(data["head"]) == 1 and data["manifest"]["stage"] == "rollout"


# --- values out of range: refused by the config types, before any input or model is read -----

RANGE_CASES = [
    (["rollout", "--n", "0"], "rollout.n must be ≥ 1, got 0"),
    (["rollout", "--max-new-tokens", "0"], "rollout.max_new_tokens must be ≥ 1"),
    (["rollout", "--temperature", "-0.5"], "rollout.temperature must be ≥ 0.0"),
    (["rollout", "--top-p", "0"], "rollout.top_p must be in (0, 1]"),
    (["rollout", "--top-p", "1.5"], "rollout.top_p must be in (0, 1]"),
    (["rollout", "--top-k", "-1"], "rollout.top_k must be ≥ 0"),
    (["rollout", "--min-p", "1.0"], "rollout.min_p must be in [0, 1)"),
    (["rollout", "--repetition-penalty", "0"], "rollout.repetition_penalty must be > 0"),
    (["rollout", "--stop", "</answer>", "--stop", ""], "rollout.stop must not hold an empty string"),
    (["rollout", "--set", "rollout.batch_size=0"], "rollout.batch_size must be ≥ 1"),
    (["rollout", "--set", "rollout.dtype=fp8"], "rollout.dtype must be one of auto, fp32, bf16"),
    (["rollout", "--set", "data.truncate=right"], "data.truncate must be one of error, left"),
    (["rollout", "--set", "data.retire_pass_rate=1.5"], "data.retire_pass_rate must be in [0, 1] (0 = off), got 1.5"),
    (["score", "--batch-size", "0"], "score.batch_size must be ≥ 1"),
    (["score", "--reward-timeout", "-1"], "score.reward_timeout must be ≥ 0.0"),
    (["advantage", "--gamma", "1.5"], "advantage.gamma must be between 0.0 and 1.0"),
    (["advantage", "--lam", "-0.1"], "advantage.lam must be between 0.0 and 1.0"),
    (["advantage", "--kl-coef", "-1"], "advantage.kl_coef must be ≥ 0.0"),
    (["advantage", "--set", "advantage.critic_lam=1.5"], "advantage.critic_lam must be -1 (lam) or between 0.0 and 1.0"),
    (["advantage", "--set", "advantage.critic_lam=1.0"], "advantage.critic_lam and length_adaptive_alpha set GAE's λs: estimator grpo has none (use gae)"),
    (["update", "--lr", "0"], "update.lr must be > 0.0"),
    (["update", "--set", "update.lr=nan"], "update.lr must be a finite number"),
    (["update", "--set", "update.critic_lr=inf"], "update.critic_lr must be a finite number"),
    (["update", "--epochs", "0"], "update.epochs must be ≥ 1"),
    (["update", "--micro-batch-size", "0"], "update.micro_batch_size must be ≥ 1"),
    (["update", "--mini-batch-size", "-2"], "update.mini_batch_size must be ≥ 0"),
    (["update", "--set", "update.clip_ratio_c=0.5"], "update.clip_ratio_c must be 0 (off) or > 1"),
    (["update", "--set", "update.max_grad_norm=-1"], "update.max_grad_norm must be ≥ 0.0"),
    (["update", "--set", "update.vespo_lambda_neg=0"], "update.vespo_lambda_neg must be > 0.0"),
    (["update", "--set", "update.off_policy_mask=-0.5"], "update.off_policy_mask must be ≥ 0.0"),
    (["update", "--set", "update.kl_loss_unbiased=true"], "update.kl_loss_unbiased weighs the KL loss's terms: set update.use_kl_loss = true too"),
    (["update", "--set", "update.rollout_rs=token_k7"], "update.rollout_rs must be off or rules from token_k1, token_k2"),
    (["update", "--set", "update.rollout_rs=token_k1"], "update.rollout_rs needs update.rollout_rs_threshold"),
    (["update", "--set", "update.rollout_rs=seq_max_k2", "--set", "update.rollout_rs_threshold=0.5_2"], "k2 and k3 take one upper bound"),
    (["reshard", "--dtype", "int8"], "reshard.dtype must be one of bf16, fp16, fp32"),
    (["update", "--workers", "0"], "workers.num_workers must be ≥ 1"),
    (["rollout", "--workers-backend", "spark"], "workers.backend must be one of local, ray"),
    (["score", "--set", "workers.cpus_per_worker=0"], "workers.cpus_per_worker must be ≥ 1"),
    (["update", "--set", "workers.gpus_per_worker=-1"], "workers.gpus_per_worker must be ≥ 0.0"),
    (["rollout", "--set", "workers.threads=-1"], "workers.threads must be ≥ 0"),
]
REQUIRED = {
    "rollout": ["--prompts", "p.jsonl", "--model", "no-model"],
    "score": ["--rollouts", "r", "--reward", "builtin:length"],
    "advantage": ["--scores", "s"],
    "update": ["--batch", "b", "--model", "no-model"],
    "reshard": ["--checkpoint", "no-model"],
}


@pytest.mark.parametrize("args,message", RANGE_CASES, ids=[" ".join(a) for a, _ in RANGE_CASES])
def test_a_value_out_of_range_is_refused_before_any_work(cli, tmp_path, args, message):
    command = args[0]
    result = cli(command, *REQUIRED[command], "--out", tmp_path / "out", *args[1:])
    check(result, tmp_path / "out", message)


def test_a_toml_value_out_of_range_names_the_file(cli, tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("[rollout]\nn = 0\n")
    result = cli("rollout", *REQUIRED["rollout"], "--out", tmp_path / "out", "--config", config)
    check(result, tmp_path / "out", "c.toml", "rollout.n must be ≥ 1")


def test_pipeline_rejection_with_the_engines_own_log_probs_as_the_old_policys(cli, tmp_path):
    config = tmp_path / "c.toml"
    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt": "x"}\n')
    config.write_text('[data]\nprompts = "p.jsonl"\n[update]\nrollout_rs = "token_k1"\nrollout_rs_threshold = 2.0\n[score]\nold_logprobs = "rollout"\n')
    check(cli("pipeline", config, "--run-dir", tmp_path / "out"), tmp_path / "out", "update.rollout_rs compares", "score.old_logprobs = rollout", "recompute")


def test_pipeline_optimal_token_baseline_with_the_engines_own_log_probs(cli, tmp_path):
    """The estimator's Σπ² comes from score's policy forward: the engine's log-probs have none."""
    config = tmp_path / "c.toml"
    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt": "x"}\n')
    config.write_text('[data]\nprompts = "p.jsonl"\n[advantage]\nestimator = "optimal_token_baseline"\n[score]\nold_logprobs = "rollout"\n')
    check(cli("pipeline", config, "--run-dir", tmp_path / "out"), tmp_path / "out", "estimator optimal_token_baseline reads each token's Σπ² from the policy's forward", "score.old_logprobs = rollout", "recompute")


def test_pipeline_normalized_importance_weights_with_the_updates_own_old_log_probs(cli, tmp_path):
    config = tmp_path / "c.toml"
    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt": "x"}\n')
    config.write_text('[data]\nprompts = "p.jsonl"\n[update]\nrollout_is = "token"\nrollout_is_batch_normalize = true\n[score]\nold_logprobs = "update"\n')
    check(cli("pipeline", config, "--run-dir", tmp_path / "out"), tmp_path / "out", "rollout_is_batch_normalize needs the whole batch's weights", "not update")


def test_pipeline_gdpo_with_one_reward(cli, tmp_path):
    config = tmp_path / "c.toml"
    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt": "x"}\n')
    config.write_text('[data]\nprompts = "p.jsonl"\n[advantage]\nestimator = "gdpo"\n')
    check(cli("pipeline", config, "--run-dir", tmp_path / "out"), tmp_path / "out", "estimator gdpo normalizes each of several rewards on its own: set score.rewards to two or more")


def test_pipeline_iterations_below_one(cli, tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("[pipeline]\niterations = 0\n")
    check(cli("pipeline", config, "--run-dir", tmp_path / "out"), tmp_path / "out", "pipeline.iterations must be ≥ 1")


# --- bad values inside the data ----------------------------------------------------------------


@pytest.mark.parametrize("column,values,message", [
    ("rollout_logprobs", [[-1.0, float("nan"), -3.5], [-0.5], [-0.25, -1e-7]], "column 'rollout_logprobs' row 0 holds nan"),
    ("rollout_logprobs", [[-1.0, -2.0, -3.5], [float("-inf")], [-0.25, -1e-7]], "column 'rollout_logprobs' row 1 holds -inf"),
    ("rollout_logprobs", [[-1.0, -2.0, -3.5], [-0.5], [-0.25, None]], "column 'rollout_logprobs' row 2 holds a null value"),
    ("prompt_ids", [[1, 2], [], [7]], "column 'prompt_ids' row 1 has 0 values; at least 1 needed"),
    ("response_ids", [[3, None, 5], [6], [8, 9]], "column 'response_ids' row 0 holds a null value"),
])
def test_non_finite_null_and_empty_values_are_refused_naming_column_and_row(cli, tmp_path, column, values, message):
    element = pa.float32() if column == "rollout_logprobs" else pa.int32()
    source = rollouts(tmp_path, **{column: pa.array(values, pa.list_(element))})
    check(score(cli, source, tmp_path / "out"), tmp_path / "out", message)


def test_a_nan_reward_is_refused_by_the_next_stage(cli, tmp_path):
    source = str(tmp_path / "scores")
    shards.write(pa.table({**ROLLOUT_VALUES, "reward": pa.array([1.0, float("nan"), 0.0], pa.float32())}), source, Manifest(stage="score"))
    check(advantage(cli, source, tmp_path / "out"), tmp_path / "out", "column 'reward' row 1 holds nan")


def test_token_ids_outside_the_vocabulary(cli, tmp_path, tiny_model):
    source = rollouts(tmp_path, prompt_ids=pa.array([[1, 2], [1, 2], [99999]], pa.list_(pa.int32())))
    result = cli("score", "--rollouts", source, "--out", tmp_path / "out", "--reward", "builtin:length", "--ref", tiny_model)
    check(result, tmp_path / "out", "column 'prompt_ids' row 2 holds token id 99999, outside the model's vocabulary")


def test_one_id_with_two_different_prompts(cli, tmp_path, tiny_model):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "one"}\n{"id": "b", "prompt": "two"}\n{"id": "a", "prompt": "three"}\n')
    result = cli("rollout", "--prompts", prompts, "--model", tiny_model, "--out", tmp_path / "out")
    check(result, tmp_path / "out", "id 'a' names two different prompts (rows 0 and 2)")


def test_a_prompt_longer_than_the_models_context(cli, tmp_path, tiny_model, prompts_file):
    result = cli("rollout", "--prompts", prompts_file, "--model", tiny_model, "--out", tmp_path / "out", "--max-new-tokens", "1022")
    check(result, tmp_path / "out", "over the model's context of 1024 tokens less max_new_tokens=1022", "--truncate left")
    result = cli("rollout", "--prompts", prompts_file, "--model", tiny_model, "--out", tmp_path / "out", "--max-new-tokens", "1024")
    check(result, tmp_path / "out", "leaves no room for a prompt in the model's context of 1024 tokens")


def test_left_truncation_fits_a_prompt_into_the_context():
    from rlctl.config import DataConfig
    from rlctl.stages.rollout import encode_prompts

    class Words:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": list(range(len(text.split())))}

    table = pa.table({"id": ["a"], "prompt": ["one two three four five six"]})
    assert encode_prompts(table, Words(), DataConfig(truncate="left"), context_length=10, max_new_tokens=6) == [[2, 3, 4, 5]]


def test_drop_leaves_out_the_prompts_over_the_context_less_the_response_and_keeps_the_rest_whole(capsys):
    from rlctl.config import DataConfig
    from rlctl.stages.rollout import fitting_prompts

    class Words:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": list(range(len(text.split())))}

    table = pa.table({"id": ["a", "b", "c"], "prompt": ["one two three four five", "one two", "one two three four"]})
    kept, dropped = fitting_prompts(table, Words(), DataConfig(truncate="drop"), context_length=10, max_new_tokens=6)
    assert kept.column("id").to_pylist() == ["b", "c"] and dropped == ["a"]
    assert "left out 1 of 3 prompts over the model's context of 10 tokens less max_new_tokens=6: 'a'" in capsys.readouterr().err
    for mode in ("error", "left"):  # they cut or refuse later, in encode_prompts
        assert fitting_prompts(table, Words(), DataConfig(truncate=mode), context_length=10, max_new_tokens=6) == (table, [])
    from rlctl.errors import InputError
    from rlctl.stages.rollout import encode_prompts

    with pytest.raises(InputError, match="prompt 'a' has 5 tokens, over .*: data.truncate = drop leaves out only prompts to sample from; cut it with left"):
        encode_prompts(table, Words(), DataConfig(truncate="drop"), context_length=10, max_new_tokens=6)  # an SFT example's prompt, say



def test_a_rollout_that_drops_prompts_tokenizes_each_prompt_once_and_samples_the_kept_ones_tokens():
    from rlctl.config import DataConfig
    from rlctl.stages.rollout import encode_prompts, fitting_prompt_tokens

    calls = []

    class Words:
        def __call__(self, text, add_special_tokens=False):
            calls.append(text)
            return {"input_ids": list(range(len(text.split())))}

    table = pa.table({"id": ["a", "b", "c"], "prompt": ["one two three four five", "one two", "one two three four"]})
    data = DataConfig(truncate="drop")
    kept, dropped, tokenized = fitting_prompt_tokens(table, Words(), data, context_length=10, max_new_tokens=6)
    ids = encode_prompts(kept, Words(), data, context_length=10, max_new_tokens=6, tokenized=tokenized)
    assert dropped == ["a"] and ids == [[0, 1], [0, 1, 2, 3]] and len(calls) == 3  # one call per prompt, none again for the kept ones
    assert fitting_prompt_tokens(table, Words(), DataConfig(truncate="left"), context_length=10, max_new_tokens=6) == (table, [], None) and len(calls) == 3


def test_files_that_are_not_utf8(cli, tmp_path, tiny_model):
    prompts = tmp_path / "latin1.jsonl"
    prompts.write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    check(cli("rollout", "--prompts", prompts, "--model", tiny_model, "--out", tmp_path / "out"), tmp_path / "out", "latin1.jsonl line 1: not UTF-8")
    config = tmp_path / "c.toml"
    config.write_bytes("[rollout]\n# caf\u00e9\n".encode("latin-1"))
    check(advantage(cli, rollouts(tmp_path), tmp_path / "out", "--config", config), tmp_path / "out", "c.toml: not UTF-8")


def test_a_config_path_that_is_a_folder(cli, tmp_path):
    check(advantage(cli, rollouts(tmp_path), tmp_path / "out", "--config", tmp_path), tmp_path / "out", "is a folder, not a TOML file")


def test_a_folder_with_a_config_json_that_is_not_a_model(cli, tmp_path, prompts_file, tiny_model):
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "config.json").write_text('{"hello": "world"}')
    check(cli("rollout", "--prompts", prompts_file, "--model", fake, "--out", tmp_path / "out"), tmp_path / "out", "names no model_type")
    (fake / "config.json").write_text('{"model_type": "qwen2"}')
    check(cli("rollout", "--prompts", prompts_file, "--model", fake, "--out", tmp_path / "out"), tmp_path / "out", "cannot be loaded as a causal LM")


def test_a_manifest_of_a_newer_schema_version(cli, tmp_path):
    source = rollouts(tmp_path)
    path = tmp_path / "in" / MANIFEST_NAME
    path.write_text(path.read_text().replace('"schema_version": null', '"schema_version": "3.1"').replace('"schema": null', '"schema": "rollouts"'))
    check(score(cli, source, tmp_path / "out"), tmp_path / "out", "rollouts schema version 3.1 is newer than this rlctl reads (1.2)")


def test_an_output_that_is_also_the_input(cli, tmp_path):
    source = rollouts(tmp_path)
    before = (tmp_path / "in" / MANIFEST_NAME).read_bytes()
    result = score(cli, source, str(tmp_path / "in" / ".." / "in"))
    assert result.exit_code == 2 and "is also an input of this score" in one_line_error(result)
    assert (tmp_path / "in" / MANIFEST_NAME).read_bytes() == before


def run_on_a_terminal(*args: str, stream: str) -> subprocess.CompletedProcess[str]:
    """`rlctl ARGS` in a child whose stdin or stdout (`stream`) is a pseudo-terminal."""
    leader, follower = os.openpty()
    try:
        attached = {"stdin": follower} if stream == "stdin" else {"stdout": follower, "stdin": subprocess.DEVNULL}
        return subprocess.run([sys.executable, "-m", "rlctl", *args], stderr=subprocess.PIPE, text=True, timeout=120, **attached)
    finally:
        os.close(leader)
        os.close(follower)


def test_reading_dash_from_a_terminal_is_refused_not_a_hang(tmp_path):
    result = run_on_a_terminal("score", "--rollouts", "-", "--out", str(tmp_path / "out"), "--reward", "builtin:length", stream="stdin")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "stdin, which is a terminal" in result.stderr
    assert_not_written(tmp_path / "out")


def test_writing_an_arrow_stream_to_a_terminal_is_refused(tmp_path):
    source = rollouts(tmp_path)
    result = run_on_a_terminal("score", "--rollouts", source, "--out", "-", "--reward", "builtin:length", stream="stdout")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "stdout, which is a terminal" in result.stderr


def test_show_where_names_the_column_it_does_not_know(cli, tmp_path):
    result = cli("show", rollouts(tmp_path), "--where", "rewrd < 0.5")
    assert result.exit_code == 2 and "no column 'rewrd' for --where" in one_line_error(result)


def test_config_diff_of_a_folder_that_is_not_a_run(cli, tmp_path):
    (tmp_path / "a.toml").write_text("[rollout]\nn = 2\n")
    result = cli("config", "diff", tmp_path / "a.toml", tmp_path)
    assert result.exit_code == 2 and "a folder without config.resolved.toml" in one_line_error(result)
