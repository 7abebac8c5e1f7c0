"""`rlctl show --where`: the rows every condition holds for, numbers compared as numbers,
text as text, a list column by its mean; a malformed condition is one clear error."""

import pyarrow as pa
import pytest

from rlctl.errors import InputError
from rlctl.row_filter import Condition, rows_where

TABLE = pa.table({
    "id": ["p0", "p0", "p1", "p1"],
    "reward": pa.array([0.0, 1.0, 0.5, None], pa.float32()),
    "sample": pa.array([0, 1, 0, 1], pa.int32()),
    "finish_reason": ["length", "stop", "length", "length"],
    "advantages": pa.array([[-1.0, -1.0], [1.0, 3.0], [], [0.5]], pa.list_(pa.float32())),
})


def ids(table: pa.Table) -> list[tuple[str, int]]:
    return list(zip(table.column("id").to_pylist(), table.column("sample").to_pylist()))


@pytest.mark.parametrize("text,column,op,value", [
    ("reward < 0.5", "reward", "<", "0.5"),
    ("reward>=1", "reward", ">=", "1"),
    ("finish_reason = 'length'", "finish_reason", "=", "length"),
    ('id=="p1"', "id", "==", "p1"),
    ("response != a = b", "response", "!=", "a = b"),  # the value is the rest of the line
])
def test_a_condition_is_column_operator_value(text, column, op, value):
    assert Condition.parse(text) == Condition(column, op, value)


def test_every_condition_must_hold_and_the_rows_keep_their_order():
    assert ids(rows_where(TABLE, ["finish_reason=length"], "x")) == [("p0", 0), ("p1", 0), ("p1", 1)]
    assert ids(rows_where(TABLE, ["finish_reason=length", "reward < 0.5"], "x")) == [("p0", 0)]  # a null reward holds no condition
    assert ids(rows_where(TABLE, ["sample != 0", "id = p1"], "x")) == [("p1", 1)]
    assert rows_where(TABLE, [], "x") is TABLE


def test_a_list_column_compares_by_its_mean():
    assert ids(rows_where(TABLE, ["advantages > 0"], "x")) == [("p0", 1), ("p1", 1)]  # an empty list has no mean


@pytest.mark.parametrize("conditions,message", [
    (["reward"], "--where 'reward': write COLUMN OP VALUE, OP one of = == != < <= > >="),
    (["reward <"], "write COLUMN OP VALUE"),
    (["rewrd < 1"], "x: no column 'rewrd' for --where; did you mean reward?"),
    (["reward < high"], "reward holds numbers, 'high' is not one"),
])
def test_a_bad_condition_is_one_clear_error(conditions, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace("?", r"\?")):
        rows_where(TABLE, conditions, "x")
