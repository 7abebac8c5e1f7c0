"""Provenance of every output: `_manifest.json`, written last into an output folder.

A manifest records what a stage wrote (files with rows, bytes and sha256; the schema name and
version), from what (input URIs and the sha256 of each input's manifest), how (stage, resolved
config, seed, rlctl version) and when (wall-clock timings). Its presence is the commit point
of an output folder; its sha256 identifies the output to the stages that read it.

Manifests are strict JSON (no NaN or Infinity: a non-finite number is written as null) and
carry `manifest_version`; a reader refuses a newer one, and refuses file entries that leave
the folder or are listed twice (`check_files`).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

MANIFEST_NAME = "_manifest.json"
LOCK_NAME = "_lock.json"
MANIFEST_VERSION = 2  # 2: parts carry a write id in their names; checkpoints list every file
RESERVED_NAMES = (MANIFEST_NAME, LOCK_NAME)


@dataclass(frozen=True)
class InputRef:
    uri: str
    manifest_sha256: str | None


@dataclass(frozen=True)
class FileEntry:
    path: str
    rows: int
    bytes: int
    sha256: str


@dataclass
class Manifest:
    stage: str
    schema: str | None = None
    schema_version: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    inputs: list[InputRef] = field(default_factory=list)
    files: list[FileEntry] = field(default_factory=list)
    seed: int | None = None
    rlctl_version: str = ""
    key: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    format: str = "arrow"
    write_id: str = ""
    manifest_version: int = MANIFEST_VERSION

    def __post_init__(self) -> None:
        if not self.rlctl_version:
            from rlctl import __version__

            self.rlctl_version = __version__
        self.timings.setdefault("started", time.time())

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.files)

    def finish(self) -> None:
        self.timings["finished"] = time.time()
        self.timings["seconds"] = round(self.timings["finished"] - self.timings["started"], 6)

    def to_json(self) -> str:
        return json.dumps(strict_json_value(asdict(self)), indent=2, sort_keys=True, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse a manifest; ValueError for anything that is not one this rlctl can trust."""
        try:
            raw = json.loads(text, parse_constant=_refuse_constant)
        except RecursionError:
            raise ValueError("nested too deeply to be a manifest") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("stage"), str):
            raise ValueError("not an rlctl manifest (no stage)")
        version = raw.get("manifest_version", 1)
        if not isinstance(version, int) or version > MANIFEST_VERSION:
            raise ValueError(f"manifest_version {version!r} is newer than this rlctl reads ({MANIFEST_VERSION}); upgrade rlctl")
        try:
            raw["inputs"] = [InputRef(**i) for i in raw.get("inputs", [])]
            raw["files"] = [_file_entry(f) for f in raw.get("files", [])]
        except TypeError as exc:
            raise ValueError(f"malformed entry: {exc}") from exc
        for name, kind in (("config", dict), ("state", dict), ("metrics", dict), ("timings", dict), ("stage", str)):
            if not isinstance(raw.get(name, kind()), kind):
                raise ValueError(f"{name} must be a JSON {'object' if kind is dict else 'string'}")
        for name in ("schema", "schema_version", "key", "write_id", "format", "rlctl_version"):
            if raw.get(name) is not None and not isinstance(raw[name], str):
                raise ValueError(f"{name} must be a string")
        if raw.get("seed") is not None and (isinstance(raw["seed"], bool) or not isinstance(raw["seed"], int)):
            raise ValueError("seed must be an integer")
        known = cls.__dataclass_fields__
        manifest = cls(**{k: v for k, v in raw.items() if k in known})
        manifest.manifest_version = version
        check_files(manifest.files)
        return manifest


def _file_entry(raw: dict) -> FileEntry:
    entry = FileEntry(**raw)
    if not isinstance(entry.path, str) or not isinstance(entry.sha256, str):
        raise TypeError(f"file entry {raw!r}")
    for name in ("rows", "bytes"):
        value = getattr(entry, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TypeError(f"file entry {entry.path!r}: {name} must be a non-negative integer")
    return entry


def check_files(files: list[FileEntry]) -> None:
    """Every listed path stays inside the folder, is not reserved, and is listed once."""
    seen: set[str] = set()
    for entry in files:
        if not is_safe_relative(entry.path):
            raise ValueError(f"file entry {entry.path!r} leaves the folder (absolute, '..', a URL or a reserved name)")
        if entry.path in seen:
            raise ValueError(f"file {entry.path!r} is listed twice")
        seen.add(entry.path)


def is_safe_relative(path: str) -> bool:
    """A relative POSIX path inside a folder: no scheme, no root, no `.`/`..`, not reserved."""
    if not path or "://" in path or "\\" in path or path.startswith("/") or ":" in path.split("/")[0]:
        return False
    parts = path.split("/")
    return all(part not in ("", ".", "..") for part in parts) and path not in RESERVED_NAMES


def strict_json_value(value: Any) -> Any:
    """`value` with every non-finite float replaced by None, so the JSON is strict."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict_json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json_value(v) for v in value]
    return value


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not valid JSON (manifests are strict JSON)")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def stage_key(stage: str, config: dict[str, Any], input_hashes: list[str | None]) -> str:
    """A key that changes when the stage, its resolved config, its inputs or rlctl change."""
    from rlctl import __version__

    payload = json.dumps(
        {"stage": stage, "config": config, "inputs": input_hashes, "rlctl": __version__},
        sort_keys=True,
        default=str,
    )
    return sha256_bytes(payload.encode())[:32]
