"""`rlctl show SHARD --where "reward < 0.5"`: the rows a condition holds for, to look at the
samples that matter (the cut-off ones, one prompt's group, the failures) without a notebook.

A condition is `COLUMN OP VALUE`, OP one of = == != < <= > >=; several conditions must all
hold. VALUE is a number for a number column and text for a text column (quotes optional); a
list column (per-token log-probs, advantages) compares by its mean, as `--sort` orders it."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from rlctl.config import suggest
from rlctl.errors import InputError

OPERATORS = {"=": "equal", "==": "equal", "!=": "not_equal", "<": "less", "<=": "less_equal", ">": "greater", ">=": "greater_equal"}
CONDITION = re.compile(r"^\s*(?P<column>[^<>=!]+?)\s*(?P<op>==|!=|<=|>=|=|<|>)\s*(?P<value>.*?)\s*$")


@dataclass(frozen=True)
class Condition:
    column: str
    op: str
    value: str

    @classmethod
    def parse(cls, text: str) -> Condition:
        match = CONDITION.match(text)
        if match is None or not match["value"]:
            raise InputError(f"--where {text!r}: write COLUMN OP VALUE, OP one of {' '.join(OPERATORS)} (e.g. --where 'reward < 0.5')")
        return cls(match["column"], match["op"], match["value"].strip("\"'"))


def rows_where(table: pa.Table, conditions: list[str], uri: str) -> pa.Table:
    """The rows of `table` for which every condition holds, in their order."""
    keep = None
    for text in conditions:
        condition = Condition.parse(text)
        holds = _holds(table, condition, uri)
        keep = holds if keep is None else pc.and_(keep, holds)
    return table if keep is None else table.filter(pc.fill_null(keep, False))


def _holds(table: pa.Table, condition: Condition, uri: str) -> pa.ChunkedArray:
    if condition.column not in table.column_names:
        raise InputError(f"{uri}: no column {condition.column!r} for --where{suggest(condition.column, table.column_names)}")
    column = table.column(condition.column)
    kind = column.type.value_type if pa.types.is_list(column.type) or pa.types.is_large_list(column.type) else column.type
    if kind != column.type:  # a list column: its mean
        column = list_means(column)
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        try:
            value = pa.scalar(float(condition.value))
        except ValueError:
            raise InputError(f"--where {condition.column}{condition.op}{condition.value}: {condition.column} holds numbers, {condition.value!r} is not one") from None
    elif pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_boolean(kind):
        value = pa.scalar(condition.value.lower() == "true") if pa.types.is_boolean(kind) else pa.scalar(condition.value)
    else:
        raise InputError(f"--where: column {condition.column!r} holds {kind}; compare a number or text column")
    return getattr(pc, OPERATORS[condition.op])(column, value)


def list_means(column: pa.ChunkedArray) -> pa.Array:
    """A list column's rows by their means (null for an empty list): how --sort and --where
    read per-token values."""
    return pa.array([sum(v) / len(v) if v else None for v in column.to_pylist()], pa.float64())
