"""Arrow shard store on any fsspec URL: the storage every stage reads from and writes to.

An output is a folder of `part-NNNNN.arrow` files (Arrow IPC file format, memory-mapped when
local; `.parquet` on request) and then `_manifest.json`, written **last**: a folder without a
manifest is not an output, readers refuse it and the next writer replaces it. Each part is
written under a `.tmp` name and renamed into place. `-` is an Arrow IPC *stream* on
stdin/stdout, with the upstream manifest carried in the schema metadata.

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
from rlctl.errors import InputError, NotCommittedError
from rlctl.manifest import MANIFEST_NAME, FileEntry, InputRef, Manifest, sha256_bytes

STDIO = "-"
STREAM_MANIFEST_KEY = b"rlctl.manifest"
DEFAULT_ROWS_PER_PART = 65536
PART_SUFFIX = {"arrow": ".arrow", "parquet": ".parquet"}


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


def read(uri: str, schema: str | None = None, *, stdin: BinaryIO | None = None) -> Shards:
    """Read a committed output folder, a single file, or `-`; validate against `schema`."""
    if uri == STDIO:
        shards = _read_stream(stdin or sys.stdin.buffer)
    else:
        fs, path = filesystem(uri)
        if not fs.exists(path):
            raise InputError(f"input {uri!r} does not exist")
        shards = _read_folder(fs, path, uri) if fs.isdir(path) else _read_file(fs, path, uri)
    table = shards.table
    if schema == "prompts":
        table = _normalise_prompts(table)
    if schema is not None:
        table = schemas.validate(table, schema, source=uri if uri != STDIO else "stdin")
    return Shards(table, shards.uri, shards.manifest, shards.manifest_sha256)


def read_manifest(uri: str) -> tuple[Manifest, str]:
    """The manifest of a committed output folder and its sha256."""
    fs, path = filesystem(uri)
    manifest_path = _join(path, MANIFEST_NAME)
    if not fs.exists(path):
        raise InputError(f"input {uri!r} does not exist")
    if not fs.exists(manifest_path):
        raise NotCommittedError(f"{uri}: no {MANIFEST_NAME}, so this is not a committed output")
    raw = fs.cat_file(manifest_path)
    try:
        return Manifest.from_json(raw), sha256_bytes(raw)
    except (ValueError, TypeError) as exc:
        raise InputError(f"{uri}: unreadable {MANIFEST_NAME}: {exc}") from exc


def is_committed(uri: str) -> bool:
    fs, path = filesystem(uri)
    return fs.exists(_join(path, MANIFEST_NAME))


def _read_folder(fs: fsspec.AbstractFileSystem, path: str, uri: str) -> Shards:
    manifest, digest = read_manifest(uri)
    tables = []
    for entry in manifest.files:
        part = _join(path, entry.path)
        if not fs.exists(part):
            raise InputError(f"{uri}: manifest lists {entry.path} but the file is missing")
        size = fs.size(part)
        if size != entry.bytes:
            raise InputError(
                f"{uri}: {entry.path} has {size} bytes but the manifest says {entry.bytes} (truncated?)"
            )
        tables.append(_read_file(fs, part, f"{uri}/{entry.path}").table)
    if not tables:
        empty = schemas.load(manifest.schema) if manifest.schema else pa.schema([])
        return Shards(empty.empty_table(), uri, manifest, digest)
    table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    return Shards(table, uri, manifest, digest)


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
    source = pa.memory_map(path) if isinstance(fs, LocalFileSystem) else pa.BufferReader(fs.cat_file(path))
    try:
        return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:
        if hasattr(source, "seek"):
            source.seek(0)
        return pa.ipc.open_stream(source).read_all()


def _read_jsonl(fs: fsspec.AbstractFileSystem, path: str, uri: str) -> pa.Table:
    rows = []
    with fs.open(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{uri} line {number}: invalid JSON: {exc.msg}") from exc
            if not isinstance(row, dict):
                raise InputError(f"{uri} line {number}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    if not rows:
        raise InputError(f"{uri}: no rows")
    try:
        return pa.Table.from_struct_array(pa.array(rows))  # columns from every row, not the first
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise InputError(f"{uri}: rows do not share one type per key: {exc}") from exc


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
    existed = fs.exists(path)
    _clear_output(fs, path, uri)
    fs.makedirs(path, exist_ok=True)
    try:
        files: list[FileEntry] = []
        for part_batches in _group_rows(batches, rows_per_part):
            name = f"part-{len(files):05d}{PART_SUFFIX[format]}"
            files.append(_write_part(fs, path, name, part_batches, first_schema, format))
            faults.point(f"{uri}:{name}")
        if not files:
            files.append(_write_part(fs, path, f"part-00000{PART_SUFFIX[format]}", [], first_schema, format))
        manifest.files = files
        faults.point(f"{uri}:before-commit")
        commit(fs, path, manifest)
    except BaseException:
        _clear_output(fs, path, uri)  # an error is not a half-written output
        if not existed and not fs.ls(path, detail=False):
            fs.rm(path, recursive=True)
        raise
    return manifest


def commit(fs: fsspec.AbstractFileSystem, path: str, manifest: Manifest) -> None:
    """Write `_manifest.json` into `path`: the commit point of an output folder."""
    manifest.finish()
    tmp = _join(path, MANIFEST_NAME + ".tmp")
    with fs.open(tmp, "wb") as f:
        f.write(manifest.to_json().encode())
    fs.mv(tmp, _join(path, MANIFEST_NAME))


def prepare_output(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """Uncommit and clear an output folder so a new write can fill it; returns (fs, path)."""
    fs, path = filesystem(uri)
    _clear_output(fs, path, uri)
    fs.makedirs(path, exist_ok=True)
    return fs, path


def _clear_output(fs: fsspec.AbstractFileSystem, path: str, uri: str) -> None:
    """Remove the manifest first (so a crash mid-way leaves an uncommitted folder), then parts."""
    if not fs.exists(path):
        return
    if not fs.isdir(path):
        raise InputError(f"output {uri!r} exists and is a file, not an output folder")
    manifest = _join(path, MANIFEST_NAME)
    if fs.exists(manifest):
        fs.rm(manifest)
    for entry in fs.ls(path, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith("part-") or name.endswith(".tmp"):
            fs.rm(entry, recursive=True)


def _write_part(fs, path, name, batches, schema, format) -> FileEntry:
    tmp = _join(path, name + ".tmp")
    rows = 0
    with fs.open(tmp, "wb") as raw:
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
    fs.mv(tmp, _join(path, name))
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
