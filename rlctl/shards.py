"""Arrow shard store on any fsspec URL: the storage every stage reads from and writes to.

An output is a folder of `part-<write id>-NNNNN.arrow` files (Arrow IPC file format,
memory-mapped when local; `.parquet` on request) and then `_manifest.json`, written **last**:
a folder without a manifest is not an output. Readers open exactly the parts the manifest
lists and verify each one's size and sha256; `rlctl.folders` holds the write protocol (new
names per write, lock, commit, cleanup). `-` is an Arrow IPC *stream* on stdin/stdout, with
the upstream manifest carried in the schema metadata.

Readers also take a single `.arrow` / `.parquet` / `.jsonl` file, and verl-style prompt
parquet (`prompt` as chat messages, `reward_model.ground_truth`).

    shards = read("runs/x/iter-0001/rollout", schema="rollouts")
    write(table, "memory://scores", Manifest(stage="score"), schema="scores")
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from rlctl import faults, schemas
from rlctl.errors import InputError, NotCommittedError, SchemaError
from rlctl.folders import OutputWrite, PartMissingError, PartSink, read_verified
from rlctl.manifest import MANIFEST_NAME, FileEntry, InputRef, Manifest, sha256_bytes

STDIO = "-"
STREAM_MANIFEST_KEY = b"rlctl.manifest"
DEFAULT_ROWS_PER_PART = 65536
PART_SUFFIX = {"arrow": ".arrow", "parquet": ".parquet"}
READ_ATTEMPTS = 3  # a folder replaced this many times while we read it is "changed under me"


@dataclass(frozen=True)
class Shards:
    """A table read from storage with the manifest that committed it (if any)."""

    table: pa.Table
    uri: str
    manifest: Manifest | None
    manifest_sha256: str | None

    def ref(self) -> InputRef:
        return InputRef(uri=self.uri, manifest_sha256=self.manifest_sha256)


# --- reading --------------------------------------------------------------------------------


def read(uri: str, schema: str | None = None, *, stdin: BinaryIO | None = None, verify: bool | None = None) -> Shards:
    """Read a committed output folder (every part verified against its manifest; `verify=False`
    checks sizes only), a single file, or `-`; validate against `schema`."""
    if uri == STDIO:
        if stdin is None and sys.stdin.isatty():
            raise InputError("input - reads an Arrow stream from stdin, which is a terminal: pipe one in (rlctl rollout ... --out - | rlctl score --rollouts - ...)")
        shards = _read_stream(stdin or sys.stdin.buffer)
    else:
        fs, path = filesystem(uri)
        fs.invalidate_cache(path)
        if not fs.exists(path):
            raise InputError(f"input {uri!r} does not exist")
        shards = _read_folder(fs, path, uri, verify) if fs.isdir(path) else _read_file(fs, path, uri)
    table = shards.table
    if schema == "prompts":
        table = _normalise_prompts(table)
        _check_prompt_ids(table, uri if uri != STDIO else "stdin")
    if schema is not None:
        table = schemas.validate(table, schema, source=uri if uri != STDIO else "stdin")
    return Shards(table, shards.uri, shards.manifest, shards.manifest_sha256)


def read_manifest(uri: str) -> tuple[Manifest, str]:
    """The manifest of a committed output folder and its sha256."""
    fs, path = filesystem(uri)
    fs.invalidate_cache(path)
    try:
        raw = fs.cat_file(_join(path, MANIFEST_NAME))
    except FileNotFoundError:
        if not fs.exists(path):
            raise InputError(f"input {uri!r} does not exist") from None
        raise NotCommittedError(f"{uri}: no {MANIFEST_NAME}, so this is not a committed output") from None
    except (IsADirectoryError, NotADirectoryError):
        raise InputError(f"{uri}: {MANIFEST_NAME} is not a file") from None
    try:
        manifest = Manifest.from_json(raw)
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        raise InputError(f"{uri}: unreadable {MANIFEST_NAME}: {exc}") from exc
    if manifest.schema in schemas.names() and manifest.schema_version:
        schemas.check_version({schemas.VERSION_KEY: str(manifest.schema_version).encode()}, manifest.schema, source=uri)
    return manifest, sha256_bytes(raw)


def is_committed(uri: str) -> bool:
    fs, path = filesystem(uri)
    fs.invalidate_cache(path)
    return fs.exists(_join(path, MANIFEST_NAME))


def _read_folder(fs: fsspec.AbstractFileSystem, path: str, uri: str, verify: bool | None) -> Shards:
    """The parts of the manifest as read; a part deleted by a newer write → read the new one."""
    for _ in range(READ_ATTEMPTS):
        manifest, digest = read_manifest(uri)
        try:
            tables = [_read_part(fs, path, entry, uri, manifest.format, verify) for entry in manifest.files]
        except PartMissingError:
            _, now = read_manifest(uri)
            if now == digest:
                raise
            continue  # replaced under us: start again from the new manifest
        if not tables:
            empty = schemas.load(manifest.schema) if manifest.schema else pa.schema([])
            return Shards(empty.empty_table(), uri, manifest, digest)
        return Shards(_concat_parts(tables, manifest, uri), uri, manifest, digest)
    raise InputError(f"{uri}: changed under me: replaced {READ_ATTEMPTS} times while being read; try again")


def _read_part(fs, path: str, entry: FileEntry, uri: str, fmt: str, verify: bool | None) -> pa.Table:
    buffer = read_verified(fs, path, entry, uri, verify=verify)
    is_parquet = entry.path.endswith(".parquet") or fmt == "parquet"
    try:
        if is_parquet:
            return pq.read_table(pa.BufferReader(buffer))
        return _open_ipc(buffer)
    except (pa.ArrowInvalid, OSError) as exc:
        kind = "Parquet" if is_parquet else "Arrow IPC"
        raise InputError(f"{uri}/{entry.path}: not a readable {kind} file: {exc}") from exc


def _concat_parts(tables: list[pa.Table], manifest: Manifest, uri: str) -> pa.Table:
    first = tables[0].schema.remove_metadata()
    for entry, table in zip(manifest.files[1:], tables[1:]):
        other = table.schema.remove_metadata()
        if not other.equals(first):
            raise SchemaError(f"{uri}: {entry.path} does not have the schema of {manifest.files[0].path}: {_schema_difference(first, other)}")
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def _schema_difference(a: pa.Schema, b: pa.Schema) -> str:
    for field in a:
        if field.name not in b.names:
            return f"column {field.name!r} is missing"
        other = b.field(field.name)
        if not other.type.equals(field.type):
            return f"column {field.name!r} is {schemas.type_string(other.type)}, not {schemas.type_string(field.type)}"
    extra = [n for n in b.names if n not in a.names]
    return f"extra column {extra[0]!r}" if extra else "column order differs"


def _read_file(fs: fsspec.AbstractFileSystem, path: str, uri: str) -> Shards:
    if path.endswith(".jsonl") or path.endswith(".json"):
        return Shards(_read_jsonl(fs, path, uri), uri, None, None)
    try:
        if path.endswith(".parquet"):
            with fs.open(path, "rb") as f:
                table = pq.read_table(f)
        else:
            table = _read_ipc(fs, path)
    except (pa.ArrowInvalid, OSError) as exc:
        kind = "Parquet" if path.endswith(".parquet") else "Arrow IPC"
        raise InputError(f"{uri}: not a readable {kind} file (truncated or corrupt): {exc}") from exc
    return Shards(table, uri, None, None)


def _read_ipc(fs: fsspec.AbstractFileSystem, path: str) -> pa.Table:
    buffer = pa.memory_map(path).read_buffer() if isinstance(fs, LocalFileSystem) else pa.py_buffer(fs.cat_file(path))
    return _open_ipc(buffer)


def _open_ipc(buffer: pa.Buffer) -> pa.Table:
    """An Arrow IPC file, or an IPC stream saved to a file."""
    try:
        return pa.ipc.open_file(buffer).read_all()
    except pa.ArrowInvalid:
        return pa.ipc.open_stream(buffer).read_all()


def _read_jsonl(fs: fsspec.AbstractFileSystem, path: str, uri: str) -> pa.Table:
    """JSON Lines; a `.json` file may also hold one JSON array of objects (pandas' and
    datasets' `to_json(lines=False)`)."""
    with fs.open(path, "rb") as f:
        raw = f.read()
    if path.endswith(".json") and raw.lstrip()[:1] == b"[":
        rows = _json_array_rows(raw, uri)
    else:
        rows = [row for number, line in enumerate(raw.split(b"\n"), start=1) if (row := _jsonl_row(line, number, uri)) is not None]
    if not rows:
        raise InputError(f"{uri}: no rows")
    try:
        return pa.Table.from_struct_array(pa.array(rows))  # columns from every row, not the first
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise InputError(f"{uri}: rows do not share one type per key: {exc}") from exc


def _json_array_rows(raw: bytes, uri: str) -> list[dict]:
    """A JSON array of objects; strict JSON, UTF-8."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{uri}: not UTF-8 text (byte {exc.start})") from None
    try:
        rows = json.loads(text, parse_constant=_non_finite)
    except json.JSONDecodeError as exc:
        raise InputError(f"{uri} line {exc.lineno}: invalid JSON: {exc.msg}") from exc
    except ValueError as exc:
        raise InputError(f"{uri}: {exc}") from exc
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise InputError(f"{uri} item {index}: expected a JSON object, got {type(row).__name__}")
    return rows


def _jsonl_row(raw: bytes, number: int, uri: str) -> dict | None:
    """One JSON Lines row (None for a blank line); strict JSON, UTF-8."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{uri} line {number}: not UTF-8 text (byte {exc.start})") from None
    if not line.strip():
        return None
    try:
        row = json.loads(line, parse_constant=_non_finite)
    except json.JSONDecodeError as exc:
        hint = " (JSON Lines: one object per line, or a .json file holding one array of objects)" if number == 1 and line.strip() in ("{", "[") else ""
        raise InputError(f"{uri} line {number}: invalid JSON: {exc.msg}{hint}") from exc
    except ValueError as exc:
        raise InputError(f"{uri} line {number}: {exc}") from exc
    if not isinstance(row, dict):
        raise InputError(f"{uri} line {number}: expected a JSON object, got {type(row).__name__}")
    return row


def _non_finite(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _read_stream(stream: BinaryIO) -> Shards:
    try:
        reader = pa.ipc.open_stream(stream)
        table = reader.read_all()
    except pa.ArrowInvalid as exc:
        raise InputError(f"stdin: not an Arrow IPC stream: {exc}") from exc
    metadata = dict(table.schema.metadata or {})
    raw = metadata.pop(STREAM_MANIFEST_KEY, None)
    manifest = Manifest.from_json(raw) if raw else None
    table = table.replace_schema_metadata(metadata)
    return Shards(table, STDIO, manifest, sha256_bytes(raw) if raw else None)


def _normalise_prompts(table: pa.Table) -> pa.Table:
    """Accept verl-style prompt parquet and prompt files without an `id` column."""
    names = table.column_names
    if "prompt" in names and pa.types.is_list(table.schema.field("prompt").type):
        if "messages" in names:
            raise InputError("prompts: both a chat-message 'prompt' column and 'messages'")
        table = table.rename_columns(["messages" if n == "prompt" else n for n in names])
    if "reward_model" in table.column_names and "ground_truth" not in table.column_names:
        reward_model = table.column("reward_model")
        if pa.types.is_struct(reward_model.type) and reward_model.type.get_field_index("ground_truth") >= 0:
            truth = pa.chunked_array(
                [chunk.field("ground_truth") for chunk in reward_model.chunks], reward_model.type.field("ground_truth").type
            )
            table = table.append_column("ground_truth", truth.cast(pa.string()))
    if "id" not in table.column_names:
        table = table.add_column(0, "id", pa.array([str(i) for i in range(table.num_rows)]))
    elif not pa.types.is_string(table.schema.field("id").type):
        index = table.column_names.index("id")
        table = table.set_column(index, "id", table.column("id").cast(pa.string()))
    return table


def _check_prompt_ids(table: pa.Table, source: str) -> None:
    """One id, one prompt: the same id with two different prompts would mix their groups."""
    ids = table.column("id").to_pylist()
    texts = [table.column(name).to_pylist() if name in table.column_names else [None] * len(ids) for name in ("prompt", "messages")]
    seen: dict[str, tuple[int, object]] = {}
    for row, (prompt_id, prompt, messages) in enumerate(zip(ids, *texts)):
        if prompt_id is None:
            raise InputError(f"{source}: row {row} has a null id")
        first = seen.setdefault(prompt_id, (row, (prompt, messages)))
        if first[1] != (prompt, messages):
            raise InputError(f"{source}: id {prompt_id!r} names two different prompts (rows {first[0]} and {row})")


# --- writing --------------------------------------------------------------------------------


def write(
    data: pa.Table | Iterable[pa.RecordBatch],
    uri: str,
    manifest: Manifest,
    *,
    schema: str | None = None,
    format: str = "arrow",
    rows_per_part: int = DEFAULT_ROWS_PER_PART,
    stdout: BinaryIO | None = None,
) -> Manifest:
    """Write `data` to `uri` and commit it with `manifest` (written last). Returns the manifest.

    `data` is a table or an iterable of record batches (for outputs larger than memory; each
    batch is validated as it goes). Tables are validated before anything is written.
    """
    if format not in PART_SUFFIX:
        raise InputError(f"unknown shard format {format!r}; use arrow or parquet")
    if rows_per_part < 1:
        raise InputError("rows_per_part must be at least 1")
    if schema is not None:
        spec = schemas.spec(schema)
        manifest.schema, manifest.schema_version = spec.name, spec.version
    source = "output"
    if isinstance(data, pa.Table):
        if schema is not None:
            data = schemas.validate(data, schema, source=source)
        batches: Iterable[pa.RecordBatch] = data.to_batches(max_chunksize=rows_per_part)
        first_schema = data.schema
    else:
        batches, first_schema = _peek_schema(_validated(data, schema, source))
    if uri == STDIO:
        return _write_stream(batches, first_schema, manifest, stdout or sys.stdout.buffer)
    manifest.format = format
    fs, path = filesystem(uri)
    with OutputWrite(fs, path, uri) as out:
        files: list[FileEntry] = []
        for part_batches in _group_rows(batches, rows_per_part):
            index = len(files)
            files.append(write_part(out, out.part_name(index, PART_SUFFIX[format]), part_batches, first_schema, format))
            faults.point(f"{uri}:part-{index:05d}{PART_SUFFIX[format]}")
        if not files:
            files.append(write_part(out, out.part_name(0, PART_SUFFIX[format]), [], first_schema, format))
        manifest.files = files
        faults.point(f"{uri}:before-commit")
        return out.commit(manifest)


def commit_empty(uri: str, manifest: Manifest) -> Manifest:
    """Commit a folder that holds only its manifest (a pipeline's update/ record)."""
    fs, path = filesystem(uri)
    with OutputWrite(fs, path, uri) as out:
        manifest.files = []
        return out.commit(manifest)


def write_part(out: OutputWrite | PartSink, name: str, batches, schema: pa.Schema, format: str) -> FileEntry:
    """One part file of `out` (a write, or a worker's sink into it), hashed and counted as it is written."""
    rows = 0
    with out.open(name) as raw:
        sink = _HashingWriter(raw)
        if format == "parquet":
            with pq.ParquetWriter(sink, schema) as writer:
                for batch in batches:
                    writer.write_batch(batch)
                    rows += batch.num_rows
        else:
            with pa.ipc.new_file(pa.PythonFile(sink, mode="w"), schema) as writer:
                for batch in batches:
                    writer.write_batch(batch)
                    rows += batch.num_rows
    return FileEntry(path=name, rows=rows, bytes=sink.size, sha256=sink.hexdigest())


def _write_stream(batches, schema: pa.Schema, manifest: Manifest, stdout: BinaryIO) -> Manifest:
    manifest.finish()
    metadata = dict(schema.metadata or {})
    metadata[STREAM_MANIFEST_KEY] = manifest.to_json().encode()
    rows = 0
    with pa.ipc.new_stream(stdout, schema.with_metadata(metadata)) as writer:
        for batch in batches:
            writer.write_batch(batch)
            rows += batch.num_rows
    stdout.flush()
    manifest.state = {**manifest.state, "streamed_rows": rows}  # the embedded copy predates the rows
    return manifest


def _validated(batches: Iterable[pa.RecordBatch], schema: str | None, source: str) -> Iterator[pa.RecordBatch]:
    for batch in batches:
        table = pa.Table.from_batches([batch])
        if schema is not None:
            table = schemas.validate(table, schema, source=source)
        yield from table.to_batches()


def _peek_schema(batches: Iterator[pa.RecordBatch]) -> tuple[Iterator[pa.RecordBatch], pa.Schema]:
    try:
        first = next(batches)
    except StopIteration as exc:
        raise InputError("nothing to write: no record batches") from exc

    def chained() -> Iterator[pa.RecordBatch]:
        yield first
        yield from batches

    return chained(), first.schema


def _group_rows(batches: Iterable[pa.RecordBatch], rows_per_part: int) -> Iterator[list[pa.RecordBatch]]:
    """Regroup batches into lists of exactly `rows_per_part` rows (the last may be short)."""
    group: list[pa.RecordBatch] = []
    count = 0
    for batch in batches:
        while batch.num_rows:
            take = min(rows_per_part - count, batch.num_rows)
            group.append(batch.slice(0, take))
            batch = batch.slice(take)
            count += take
            if count == rows_per_part:
                yield group
                group, count = [], 0
    if group:
        yield group


class _HashingWriter(io.RawIOBase):
    """A write-only file that hashes and counts what passes through to the real file."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self._hash = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._hash.update(view)
        self._raw.write(view)
        self.size += len(view)
        return len(view)

    def tell(self) -> int:
        return self.size

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


# --- helpers --------------------------------------------------------------------------------


def filesystem(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    try:
        return fsspec.core.url_to_fs(uri)
    except (ImportError, ValueError) as exc:
        raise InputError(f"cannot open {uri!r}: {exc}") from exc


def _join(path: str, name: str) -> str:
    return path.rstrip("/") + "/" + name


def local_path(uri: str) -> str | None:
    """The local filesystem path of `uri`, or None for remote and in-memory stores."""
    if uri == STDIO:
        return None
    fs, path = filesystem(uri)
    return path if isinstance(fs, LocalFileSystem) else None


@dataclass(frozen=True)
class OutputSpec:
    """Where and how a stage writes its output."""

    uri: str
    format: str = "arrow"
    rows_per_part: int = DEFAULT_ROWS_PER_PART
