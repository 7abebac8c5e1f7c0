"""Bad input: exit code 2, exactly one stderr line naming the file / column / key / line,
and no output folder left behind."""

import json

import pyarrow as pa

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
    check(score(cli, source, tmp_path / "out"), tmp_path / "out", "9.0 is newer than this rlctl reads (1.0)")


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
