"""Committed folders: how an output (a shard folder or a checkpoint) is written and verified.

The write protocol holds on a local disk and on object stores alike (a PUT of one object is
atomic there; a rename is not):

1. take the folder's lock (`rlctl.locks`); refuse a folder holding files that no rlctl write
   made ("not an rlctl output folder");
2. write new parts under names no earlier write used: `part-<write id>-NNNNN.arrow` (a local
   part goes to a `.tmp` name first and is renamed);
3. commit by putting `_manifest.json` (one PUT, or write + rename locally), which lists every
   file with its size and sha256;
4. only then delete the previous write's files and the leftovers of crashed writes.

A reader that holds the old manifest therefore finds the old parts, or finds one missing and
re-reads the manifest: it never mixes two writes. Checkpoints (`fixed_names`) must keep the
file names transformers and vLLM look for, so they are uncommitted (manifest removed) before
they are rewritten in place; readers of an uncommitted folder get a clean error.

Reads verify each file against its manifest entry: present, the same size, the same sha256.
`RLCTL_NO_VERIFY=1` (`rlctl --no-verify ...`) skips the sha256 for very large trusted data.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import BinaryIO

import fsspec
import pyarrow as pa
from fsspec.implementations.local import LocalFileSystem

from rlctl.errors import InputError
from rlctl.locks import FolderLock
from rlctl.manifest import MANIFEST_NAME, RESERVED_NAMES, FileEntry, Manifest, check_files
from rlctl.threads import available_cpus

NO_VERIFY_ENV = "RLCTL_NO_VERIFY"
PART_NAME = re.compile(r"^part-(?:[0-9a-f]{6,32}-)?\d{5}\.(?:arrow|parquet)(?:\.tmp)?$")
TMP_MANIFEST = re.compile(r"^_manifest\.json\.[0-9a-f]+\.tmp$")
HASH_BLOCK = 1 << 22


class PartMissingError(InputError):
    """A file the manifest lists is gone: deleted by a newer write after we read the manifest."""


def new_write_id() -> str:
    return os.urandom(6).hex()


def join(path: str, name: str) -> str:
    return path.rstrip("/") + "/" + name


def verify_enabled() -> bool:
    return os.environ.get(NO_VERIFY_ENV, "") in ("", "0")


class OutputWrite:
    """One write of a committed folder: lock, new names, commit, then clean up.

        with OutputWrite(fs, path, uri) as out:
            with out.open(out.part_name(0, ".arrow")) as f: ...
            out.commit(manifest)
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, uri: str, *, what: str = "output", fixed_names: bool = False) -> None:
        self.fs, self.path, self.uri, self.what, self.fixed_names = fs, path.rstrip("/"), uri, what, fixed_names
        self.write_id = new_write_id()
        self.created: list[str] = []
        self.committed = False
        self.previous: Manifest | None = None
        self.lock: FolderLock | None = None
        self._made_folder = False

    @property
    def local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def __enter__(self) -> OutputWrite:
        fs, path = self.fs, self.path
        fs.invalidate_cache(path)
        if fs.exists(path) and not fs.isdir(path):
            raise InputError(f"output {self.uri!r} exists and is a file, not an output folder")
        self._made_folder = not fs.exists(path)
        fs.makedirs(path, exist_ok=True)
        self.lock = FolderLock.acquire(fs, path, what=self.what, write_id=self.write_id)
        try:
            self.previous = _readable_manifest(fs, path)
            self._refuse_foreign_files()
            if self.fixed_names and self.previous is not None:
                fs.rm(join(path, MANIFEST_NAME))  # uncommitted from here: the names are about to be reused
        except BaseException:
            self._release()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if not self.committed:
                self._remove_own_files()
        finally:
            self._release()

    # -- writing -----------------------------------------------------------------------

    def part_name(self, index: int, suffix: str) -> str:
        return f"part-{self.write_id}-{index:05d}{suffix}"

    def open(self, name: str):
        """A file of this write; local files appear under their name only when complete."""
        return PartSink(self.fs, self.path, self.created).open(name)

    def expect(self, name: str) -> str:
        """A part another process (a worker) writes for this write: removed if we never commit."""
        final = join(self.path, name)
        self.created += [final, final + ".tmp"]
        return name

    def commit(self, manifest: Manifest) -> Manifest:
        """Put the manifest (the commit point), then delete what the previous write left."""
        check_files(manifest.files)
        manifest.write_id = self.write_id
        manifest.finish()
        data = manifest.to_json().encode()
        target = join(self.path, MANIFEST_NAME)
        if self.local:
            tmp = join(self.path, f"{MANIFEST_NAME}.{self.write_id}.tmp")
            self.created.append(tmp)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        else:
            self.fs.pipe_file(target, data)
        self.committed = True
        self._remove_superseded({entry.path for entry in manifest.files})
        return manifest

    # -- what may be in the folder, and what goes -------------------------------------

    def _listing(self) -> list[str]:
        """Every file under the folder, relative to it."""
        self.fs.invalidate_cache(self.path)
        prefix = self.fs._strip_protocol(self.path).rstrip("/") + "/"
        files = []
        for found in self.fs.find(self.path):
            stripped = self.fs._strip_protocol(found)
            if stripped.startswith(prefix):
                files.append(stripped[len(prefix) :])
        return files

    def _is_ours(self, name: str) -> bool:
        listed = {f.path for f in self.previous.files} if self.previous else set()
        return name in RESERVED_NAMES or name in listed or bool(PART_NAME.match(name) or TMP_MANIFEST.match(name))

    def _refuse_foreign_files(self) -> None:
        interrupted = self.lock is not None and self.lock.broke_stale is not None and self.previous is None
        if self.fixed_names and interrupted:
            return  # an rlctl write of this folder died before its commit: its files may go
        if self.previous is not None and self.previous.files:
            holds_shards = all(PART_NAME.match(f.path) for f in self.previous.files)
            if holds_shards == self.fixed_names:
                kind = "shard output" if holds_shards else f"{self.previous.stage} output (a model folder)"
                raise InputError(f"{self.uri} holds a committed {kind}; a {self.what} does not replace it: choose another output")
        for name in self._listing():
            if not self._is_ours(name):
                raise InputError(
                    f"{self.uri} is not an rlctl output folder: it holds {name!r}, which no committed rlctl write lists; "
                    "choose another output or remove that file"
                )

    def _remove_superseded(self, keep: set[str]) -> None:
        for name in self._listing():
            if name in keep or name in RESERVED_NAMES:
                continue
            if self._is_ours(name) or self.fixed_names:
                _remove(self.fs, join(self.path, name))

    def _remove_own_files(self) -> None:
        if self.fixed_names:  # the folder was uncommitted for this write: nothing in it is readable now
            for name in self._listing():
                if name not in RESERVED_NAMES:
                    _remove(self.fs, join(self.path, name))
        for path in self.created:
            _remove(self.fs, path)

    def _release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        if self._made_folder and not self.committed:
            with contextlib.suppress(FileNotFoundError):  # gone already: nothing to tidy
                if not self.fs.ls(self.path, detail=False):
                    self.fs.rm(self.path, recursive=True)


class PartSink:
    """Writes part files into a folder (what a worker of a group holds instead of the lock):
    a local file is written under `.tmp` and renamed when complete; `created` lists the paths."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, created: list[str] | None = None) -> None:
        self.fs, self.path = fs, path.rstrip("/")
        self.created = created if created is not None else []

    @contextmanager
    def open(self, name: str) -> Iterator[BinaryIO]:
        final = join(self.path, name)
        self.created.append(final)
        if not isinstance(self.fs, LocalFileSystem):
            with self.fs.open(final, "wb") as f:
                yield f
            return
        tmp = final + ".tmp"
        self.created.append(tmp)
        with self.fs.open(tmp, "wb") as f:
            yield f
        self.fs.mv(tmp, final)


def _readable_manifest(fs: fsspec.AbstractFileSystem, path: str) -> Manifest | None:
    try:
        return Manifest.from_json(fs.cat_file(join(path, MANIFEST_NAME)))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError):
        return None  # damaged: its files are unknown, so only rlctl-named leftovers may go


def _remove(fs: fsspec.AbstractFileSystem, path: str) -> None:
    with contextlib.suppress(FileNotFoundError):  # removed by someone else first: the goal holds
        if fs.isdir(path):
            fs.rm(path, recursive=True)
        else:
            fs.rm(path)


# --- verified reads -------------------------------------------------------------------------


def read_verified(fs: fsspec.AbstractFileSystem, folder: str, entry: FileEntry, uri: str, *, verify: bool | None = None) -> pa.Buffer:
    """The bytes of one listed file (memory-mapped when local), checked against its entry."""
    path = join(folder, entry.path)
    check_inside(fs, folder, path, entry, uri)
    try:
        if isinstance(fs, LocalFileSystem):
            buffer = pa.memory_map(path).read_buffer()
        else:
            buffer = pa.py_buffer(fs.cat_file(path))
    except (FileNotFoundError, IsADirectoryError):
        raise PartMissingError(f"{uri}: the manifest lists {entry.path} but the file is missing") from None
    check_entry(entry, buffer.size, lambda: hashlib.sha256(memoryview(buffer)).hexdigest(), uri, verify)
    return buffer


def verify_files(fs: fsspec.AbstractFileSystem, folder: str, manifest: Manifest, uri: str, *, verify: bool | None = None) -> None:
    """Every file the manifest lists is present and intact (streamed; nothing kept): every size
    first, then the digests, several files at once (`files_sha256`)."""
    sized = []
    for entry in manifest.files:
        path = join(folder, entry.path)
        check_inside(fs, folder, path, entry, uri)
        try:
            size = fs.size(path)
        except FileNotFoundError:
            raise PartMissingError(f"{uri}: the manifest lists {entry.path} but the file is missing") from None
        check_size(entry, size, uri)
        sized.append((entry, path, size))
    if not (verify_enabled() if verify is None else verify):
        return
    digests = files_sha256(fs, [path for _, path, _ in sized], [size for _, _, size in sized])
    for (entry, _, size), digest in zip(sized, digests):
        check_entry(entry, size, lambda digest=digest: digest, uri, verify=True)


def check_inside(fs: fsspec.AbstractFileSystem, folder: str, path: str, entry: FileEntry, uri: str) -> None:
    """A local listed file must not be a link out of its folder (the path checks cover the rest)."""
    if isinstance(fs, LocalFileSystem) and os.path.lexists(path):
        root = os.path.realpath(folder)
        if os.path.commonpath([root, os.path.realpath(path)]) != root:
            raise InputError(f"{uri}: {entry.path} is a link that leaves the folder")


def check_size(entry: FileEntry, size: int, uri: str) -> None:
    if size != entry.bytes:
        raise InputError(f"{uri}: {entry.path} has {size} bytes but the manifest says {entry.bytes} (truncated or changed after commit)")


def check_entry(entry: FileEntry, size: int, sha256, uri: str, verify: bool | None) -> None:
    check_size(entry, size, uri)
    if verify is None:
        verify = verify_enabled()
    if verify:
        digest = sha256()
        if digest != entry.sha256:
            raise InputError(f"{uri}: {entry.path} does not match its manifest (sha256 {digest[:12]}…, committed {entry.sha256[:12]}…): changed after commit")


def _stream_sha256(fs: fsspec.AbstractFileSystem, path: str) -> str:
    digest = hashlib.sha256()
    with fs.open(path, "rb") as f:
        for block in iter(lambda: f.read(HASH_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def files_sha256(fs: fsspec.AbstractFileSystem, paths: list[str], sizes: list[int]) -> list[str]:
    """Each file's sha256 (in `paths`' order), as many files at once as this process has CPUs,
    the largest started first: hashlib leaves the GIL while it hashes, and a checkpoint is a few
    large files (Qwen2.5-0.5B's shape: weights 2 GB, AdamW's state 4 GB; one stream 3.8 s)."""
    workers = min(len(paths), available_cpus())
    if workers <= 1:
        return [_stream_sha256(fs, path) for path in paths]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {i: pool.submit(_stream_sha256, fs, paths[i]) for i in sorted(range(len(paths)), key=lambda i: -sizes[i])}
        return [futures[i].result() for i in range(len(paths))]


def describe_files(fs: fsspec.AbstractFileSystem, folder: str, names: list[str]) -> list[FileEntry]:
    """Entries (rows 0) for files written outside `OutputWrite.open`, e.g. by save_pretrained."""
    names = sorted(names)
    paths = [join(folder, name) for name in names]
    sizes = [fs.size(path) for path in paths]
    return [FileEntry(path=name, rows=0, bytes=size, sha256=digest) for name, size, digest in zip(names, sizes, files_sha256(fs, paths, sizes))]
