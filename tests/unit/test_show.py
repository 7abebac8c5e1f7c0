"""`rlctl show` of a shard: a table while its columns stay readable, records otherwise."""

import json

import pyarrow as pa
import pytest

from rlctl import shards
from rlctl.errors import InputError
from rlctl.manifest import Manifest
from rlctl.show import show

RESPONSE = "The sum of 17 and 25 is 42, because 17 + 25 = 42."
ROLLOUTS = {
    "id": ["q1", "q1"],
    "prompt": ["What is 17 + 25? Answer with the number.", "What is 17 + 25? Answer with the number."],
    "sample": pa.array([0, 1], pa.int32()),
    "prompt_ids": pa.array([[1, 2], [1, 2]], pa.list_(pa.int32())),
    "response_ids": pa.array([[3, 4], [5]], pa.list_(pa.int32())),
    "response": [RESPONSE, "42"],
    "rollout_logprobs": pa.array([[-1.0, -2.0], [-0.5]], pa.list_(pa.float32())),
    "finish_reason": ["stop", "stop"],
    "policy_version": pa.array([0, 0], pa.int64()),
}


@pytest.fixture
def rollouts(tmp_path):
    uri = str(tmp_path / "rollouts")
    shards.write(pa.table(ROLLOUTS), uri, Manifest(stage="rollout"), schema="rollouts")
    return uri


def shown(capsys, monkeypatch, columns: int, uri: str, **options) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))
    show(uri, **options)
    return capsys.readouterr().out


def test_a_narrow_terminal_shows_each_row_as_records_with_its_text_whole(rollouts, capsys, monkeypatch):
    out = shown(capsys, monkeypatch, 80, rollouts)
    assert RESPONSE in out and ROLLOUTS["prompt"][0] in out
    assert "│ row " in out and "│ finish_reason " in out  # a line per column
    assert all(len(line) <= 80 for line in out.splitlines())
    assert "prompt_ids" not in out  # token ids stay for --columns and --json


def test_a_wide_terminal_keeps_the_table(rollouts, capsys, monkeypatch):
    out = shown(capsys, monkeypatch, 200, rollouts)
    header = next(line for line in out.splitlines() if "finish_reason" in line)
    assert "response" in header and "sample" in header  # the columns side by side
    assert "│ row " not in out


def test_the_layout_can_be_chosen(rollouts, capsys, monkeypatch):
    assert "│ finish_reason " in shown(capsys, monkeypatch, 200, rollouts, layout="records")
    table = shown(capsys, monkeypatch, 80, rollouts, layout="table")
    assert RESPONSE not in table and "│ row " not in table
    with pytest.raises(InputError, match="unknown layout 'wide'"):
        show(rollouts, layout="wide")


def test_width_caps_the_records_cells(rollouts, capsys, monkeypatch):
    out = shown(capsys, monkeypatch, 80, rollouts, layout="records", width=12)
    assert RESPONSE[:11] + "…" in out and RESPONSE not in out


def test_no_rows_shows_the_columns(rollouts, capsys, monkeypatch):
    out = shown(capsys, monkeypatch, 80, rollouts, rows=0)
    assert "2 rows" in out and "│ row " not in out and "id" in out


def test_json_is_the_same_whatever_the_layout(rollouts, capsys, monkeypatch):
    outputs = {json.dumps(json.loads(shown(capsys, monkeypatch, 80, rollouts, as_json=True, layout=layout))) for layout in ("table", "records")}
    (single,) = outputs
    assert json.loads(single)["head"][0]["response"] == RESPONSE


def test_sort_orders_the_rows_by_a_column_or_a_list_columns_mean(tmp_path, capsys):
    table = pa.table({
        "id": ["a", "b", "c"],
        "reward": pa.array([0.5, None, 0.9], pa.float32()),
        "advantages": pa.array([[1.0, -3.0], [0.5], []], pa.list_(pa.float32())),
    })
    uri = str(tmp_path / "batch")
    shards.write(table, uri, Manifest(stage="advantage"))

    def ids(sort: str) -> list[str]:
        show(uri, as_json=True, sort=sort)
        return [row["id"] for row in json.loads(capsys.readouterr().out)["head"]]

    assert ids("reward") == ["a", "c", "b"]  # nulls last either way
    assert ids("-reward") == ["c", "a", "b"]
    assert ids("-advantages") == ["b", "a", "c"]  # means 0.5, -1.0; no tokens last
    with pytest.raises(InputError, match="no column 'rewards' to sort by; columns: id, reward, advantages"):
        show(uri, sort="rewards")
