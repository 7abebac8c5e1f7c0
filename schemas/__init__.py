"""Versioned Arrow schemas, the public data contract of rlctl (installed as `rlctl.schemas`).

Each `<name>.json` beside this file gives a schema's columns (Arrow type, nullability, a
one-line description), its `major.minor` version and the schema it `extends`. `load(name)`
turns one into a `pyarrow.Schema` whose metadata names it; `validate(table, name)` checks a
table against it and returns the table with column types normalised and the metadata set.

    from rlctl.schemas import validate
    table = validate(table, "rollouts")
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from rlctl.errors import SchemaError, SchemaVersionError

SCHEMA_DIR = Path(__file__).parent
NAME_KEY = b"rlctl.schema"
VERSION_KEY = b"rlctl.schema_version"


@dataclass(frozen=True)
class Column:
    name: str
    type: pa.DataType
    nullable: bool
    required: bool
    per_token: bool
    description: str
    min_length: int = 0  # list columns: the fewest elements a row may hold


@dataclass(frozen=True)
class SchemaSpec:
    name: str
    version: str
    description: str
    columns: tuple[Column, ...]
    one_of: tuple[tuple[str, ...], ...]

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])

    @property
    def minor(self) -> int:
        return int(self.version.split(".")[1])

    def column(self, name: str) -> Column | None:
        return next((c for c in self.columns if c.name == name), None)


def names() -> list[str]:
    return sorted(p.stem for p in SCHEMA_DIR.glob("*.json"))


@cache
def spec(name: str) -> SchemaSpec:
    """The schema called `name`, with the columns of the schemas it extends first."""
    path = SCHEMA_DIR / f"{name}.json"
    if not path.exists():
        raise SchemaError(f"unknown schema {name!r}; known: {', '.join(names())}")
    raw = json.loads(path.read_text())
    inherited = spec(raw["extends"]) if raw.get("extends") else None
    own = tuple(
        Column(
            name=c["name"],
            type=parse_type(c["type"]),
            nullable=c.get("nullable", True),
            required=c.get("required", False),
            per_token=c.get("per_token", False),
            description=c["description"],
            min_length=c.get("min_length", 0),
        )
        for c in raw["columns"]
    )
    return SchemaSpec(
        name=raw["name"],
        version=raw["version"],
        description=raw["description"],
        columns=(inherited.columns if inherited else ()) + own,
        one_of=(inherited.one_of if inherited else ())
        + tuple(tuple(group) for group in raw.get("one_of", [])),
    )


def load(name: str) -> pa.Schema:
    """The `pyarrow.Schema` of every declared column, with name and version in the metadata."""
    s = spec(name)
    fields = [pa.field(c.name, c.type, nullable=c.nullable) for c in s.columns]
    return pa.schema(fields, metadata={NAME_KEY: s.name.encode(), VERSION_KEY: s.version.encode()})


# --- type strings -------------------------------------------------------------------------

_PRIMITIVES = {
    "string": pa.string(),
    "bool": pa.bool_(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "float32": pa.float32(),
    "float64": pa.float64(),
}


def parse_type(text: str) -> pa.DataType:
    """`"list<struct<role: string, content: string>>"` → the Arrow type."""
    text = text.strip()
    if text in _PRIMITIVES:
        return _PRIMITIVES[text]
    if text.startswith("list<") and text.endswith(">"):
        return pa.list_(parse_type(text[5:-1]))
    if text.startswith("struct<") and text.endswith(">"):
        fields = []
        for part in _split_top_level(text[7:-1]):
            field_name, _, field_type = part.partition(":")
            fields.append(pa.field(field_name.strip(), parse_type(field_type)))
        return pa.struct(fields)
    raise ValueError(f"unknown type string {text!r}")


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]


def type_string(t: pa.DataType) -> str:
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"list<{type_string(t.value_type)}>"
    if pa.types.is_struct(t):
        return "struct<" + ", ".join(f"{f.name}: {type_string(f.type)}" for f in t) + ">"
    return {pa.large_string(): "string", pa.bool_(): "bool", pa.float64(): "float64"}.get(t, str(t))


# --- validation ---------------------------------------------------------------------------


def check_version(metadata: dict[bytes, bytes] | None, name: str, source: str = "input") -> None:
    """Refuse data of a newer major version; warn on a newer minor version. The version is
    that of the schema the data was written as (scores read as prompts: the scores schema's)."""
    if not metadata or VERSION_KEY not in metadata:
        return
    found = metadata[VERSION_KEY].decode()
    written_as = metadata.get(NAME_KEY, b"").decode()
    name = written_as if written_as in names() else name
    ours = spec(name)
    try:
        major, minor = (int(x) for x in found.split(".")[:2])
    except ValueError as exc:
        raise SchemaVersionError(f"{source}: unreadable schema version {found!r}") from exc
    if major > ours.major:
        raise SchemaVersionError(
            f"{source}: {name} schema version {found} is newer than this rlctl reads "
            f"({ours.version}); upgrade rlctl"
        )
    if major == ours.major and minor > ours.minor:
        warnings.warn(
            f"{source}: {name} schema version {found} is newer than {ours.version}; "
            "unknown columns are carried through unchanged",
            stacklevel=2,
        )


def validate(table: pa.Table, name: str, source: str = "input") -> pa.Table:
    """Check `table` against schema `name`; return it with declared types and the metadata.

    Columns not in the schema are carried through untouched. A column whose type differs
    only in width or string flavour (int64 read from JSON for an int32 column, say) is cast
    safely; any other difference is a `SchemaError` naming the column.
    """
    s = spec(name)
    check_version(table.schema.metadata, name, source)
    for group in s.one_of:
        if not any(col in table.column_names for col in group):
            raise SchemaError(
                f"{source}: {name} needs one of the columns {', '.join(map(repr, group))}"
            )
    for col in s.columns:
        if col.name not in table.column_names:
            if col.required:
                raise SchemaError(f"{source}: missing required column {col.name!r} ({name} schema)")
            continue
        table = _conform_column(table, col, source)
    _check_per_token_lengths(table, s, source)
    for col in s.columns:
        if col.name in table.column_names:
            _check_values(table.column(col.name), col, source)
    metadata = dict(table.schema.metadata or {})
    metadata.update({NAME_KEY: s.name.encode(), VERSION_KEY: s.version.encode()})
    return table.replace_schema_metadata(metadata)


def _conform_column(table: pa.Table, col: Column, source: str) -> pa.Table:
    index = table.column_names.index(col.name)
    data = table.column(index)
    if data.type != col.type:
        if data.null_count == len(data) and col.nullable:
            data = pa.nulls(len(data), col.type)
        elif not _castable(data.type, col.type):
            raise SchemaError(
                f"{source}: column {col.name!r} has type {type_string(data.type)}, "
                f"expected {type_string(col.type)}"
            )
        else:
            try:
                data = data.cast(col.type, safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise SchemaError(
                    f"{source}: column {col.name!r} does not fit {type_string(col.type)}: {exc}"
                ) from exc
    if not col.nullable and data.null_count:
        first = pc.index(pc.is_null(data), True).as_py()
        raise SchemaError(
            f"{source}: column {col.name!r} has {data.null_count} null value(s), first at row {first}"
        )
    field = pa.field(col.name, col.type, nullable=col.nullable)
    return table.set_column(index, field, data)


def _kind(t: pa.DataType) -> str:
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return "list"
    if pa.types.is_struct(t):
        return "struct"
    return str(t)


def _castable(actual: pa.DataType, expected: pa.DataType) -> bool:
    a, e = _kind(actual), _kind(expected)
    if a == "list" and e == "list":
        return _castable(actual.value_type, expected.value_type)
    if a == "struct" and e == "struct":
        names = {f.name for f in actual}
        return all(f.name in names and _castable(actual.field(f.name).type, f.type) for f in expected)
    return a == e or (a == "int" and e == "float")


def _check_per_token_lengths(table: pa.Table, s: SchemaSpec, source: str) -> None:
    if "response_ids" not in table.column_names:
        return
    expected = pc.list_value_length(table.column("response_ids"))
    for col in s.columns:
        if not col.per_token or col.name not in table.column_names:
            continue
        lengths = pc.list_value_length(table.column(col.name))
        mismatch = pc.fill_null(pc.not_equal(lengths, expected), False)
        if pc.any(mismatch).as_py():
            row = pc.index(mismatch, True).as_py()
            raise SchemaError(
                f"{source}: column {col.name!r} row {row} has {lengths[row].as_py()} values "
                f"but response_ids has {expected[row].as_py()}"
            )


def _check_values(data: pa.ChunkedArray, col: Column, source: str) -> None:
    """Floats are finite; lists hold no null elements and at least `min_length` of them."""
    is_list = pa.types.is_list(col.type)
    values = pc.list_flatten(data) if is_list else data
    element = col.type.value_type if is_list else col.type
    if is_list:
        if col.min_length:
            short = pc.fill_null(pc.less(pc.list_value_length(data), col.min_length), False)
            if pc.any(short).as_py():
                row = pc.index(short, True).as_py()
                raise SchemaError(f"{source}: column {col.name!r} row {row} has {len(data[row])} values; at least {col.min_length} needed")
        if values.null_count:
            raise SchemaError(f"{source}: column {col.name!r} row {_row_of(data, pc.is_null(values))} holds a null value")
    if pa.types.is_floating(element) and len(values):
        bad = pc.invert(pc.fill_null(pc.is_finite(values), True))
        if pc.any(bad).as_py():
            row = _row_of(data, bad) if is_list else pc.index(bad, True).as_py()
            value = pc.filter(values, bad)[0].as_py()
            raise SchemaError(f"{source}: column {col.name!r} row {row} holds {value}, not a finite number")


def _row_of(lists: pa.ChunkedArray, flat_mask) -> int:
    """The row of the first flattened element where `flat_mask` is true."""
    parents = pc.list_parent_indices(lists)
    return pc.filter(parents, flat_mask)[0].as_py()
