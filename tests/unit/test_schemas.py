"""The schema files are the public contract: loadable, versioned, and strictly checked."""

import warnings

import pyarrow as pa
import pytest

from rlctl import schemas
from rlctl.errors import SchemaError, SchemaVersionError


def rollouts_table(**overrides):
    columns = {
        "id": ["a", "a"],
        "prompt": ["hi", "hi"],
        "sample": pa.array([0, 1], pa.int32()),
        "prompt_ids": pa.array([[1, 2], [1, 2]], pa.list_(pa.int32())),
        "response_ids": pa.array([[3, 4, 5], [6]], pa.list_(pa.int32())),
        "response": ["abc", "d"],
        "rollout_logprobs": pa.array([[-1.0, -2.0, -3.0], [-0.5]], pa.list_(pa.float32())),
        "finish_reason": ["length", "stop"],
        "policy_version": pa.array([0, 0], pa.int64()),
    }
    columns.update(overrides)
    return pa.table(columns)


@pytest.mark.parametrize("name", ["prompts", "rollouts", "scores", "batch", "metrics"])
def test_every_schema_loads_with_name_and_version_in_metadata(name):
    schema = schemas.load(name)
    assert schema.metadata[b"rlctl.schema"] == name.encode()
    assert schema.metadata[b"rlctl.schema_version"] == schemas.spec(name).version.encode()
    assert schemas.spec(name).major == 1
    assert all(schemas.spec(name).column(f.name).description for f in schema)


def test_schemas_extend_their_input_schema():
    assert {"id", "prompt_ids", "reward", "advantages"} <= set(schemas.load("batch").names)


def test_a_valid_table_passes_and_gets_metadata():
    table = schemas.validate(rollouts_table(), "rollouts")
    assert table.schema.metadata[b"rlctl.schema"] == b"rollouts"


def test_integer_width_is_normalised_not_rejected():
    table = schemas.validate(rollouts_table(sample=pa.array([0, 1], pa.int64())), "rollouts")
    assert table.schema.field("sample").type == pa.int32()


def test_missing_required_column_is_named():
    with pytest.raises(SchemaError, match="missing required column 'response_ids'"):
        schemas.validate(rollouts_table().drop_columns(["response_ids"]), "rollouts")


def test_wrong_type_names_column_and_types():
    with pytest.raises(SchemaError, match=r"column 'response' has type int64, expected string"):
        schemas.validate(rollouts_table(response=[1, 2]), "rollouts")


def test_null_where_not_allowed_names_the_row():
    with pytest.raises(SchemaError, match=r"'finish_reason' has 1 null value\(s\), first at row 1"):
        schemas.validate(rollouts_table(finish_reason=["stop", None]), "rollouts")


def test_per_token_length_must_match_response_ids():
    bad = pa.array([[-1.0, -2.0, -3.0], [-0.5, -0.1]], pa.list_(pa.float32()))
    with pytest.raises(SchemaError, match=r"'rollout_logprobs' row 1 has 2 values but response_ids has 1"):
        schemas.validate(rollouts_table(rollout_logprobs=bad), "rollouts")


def test_prompts_need_prompt_or_messages():
    with pytest.raises(SchemaError, match="one of the columns 'prompt', 'messages'"):
        schemas.validate(pa.table({"id": ["a"]}), "prompts")


def test_newer_major_version_is_refused_with_both_versions():
    table = rollouts_table().replace_schema_metadata({b"rlctl.schema": b"rollouts", b"rlctl.schema_version": b"2.0"})
    with pytest.raises(SchemaVersionError, match=r"version 2\.0 is newer than this rlctl reads \(1\.2\)"):
        schemas.validate(table, "rollouts")


def test_newer_minor_version_warns_and_passes():
    table = rollouts_table().replace_schema_metadata({b"rlctl.schema": b"rollouts", b"rlctl.schema_version": b"1.3"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        schemas.validate(table, "rollouts")
    assert any("1.3 is newer" in str(w.message) for w in caught)


def test_type_strings_round_trip():
    for text in ["string", "list<int32>", "list<struct<role: string, content: string>>"]:
        assert schemas.type_string(schemas.parse_type(text)) == text


def test_data_read_as_a_schema_it_extends_is_versioned_by_the_schema_it_was_written_as():
    """Scores read as prompts (sft on a score stage's output) compare their version with the
    scores schema's, not the prompts schema's: no warning for data this rlctl wrote."""
    table = rollouts_table().replace_schema_metadata({b"rlctl.schema": b"rollouts", b"rlctl.schema_version": schemas.spec("rollouts").version.encode()})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        schemas.validate(table, "prompts")
    newer = table.replace_schema_metadata({b"rlctl.schema": b"rollouts", b"rlctl.schema_version": b"9.0"})
    with pytest.raises(SchemaVersionError, match=r"rollouts schema version 9\.0 is newer than this rlctl reads"):
        schemas.validate(newer, "prompts")
