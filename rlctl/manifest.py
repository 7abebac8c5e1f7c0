"""Provenance of every output: `_manifest.json`, written last into an output folder.

A manifest records what a stage wrote (files with rows, bytes and sha256; the schema name and
version), from what (input URIs and the sha256 of each input's manifest), how (stage, resolved
config, seed, rlctl version) and when (wall-clock timings). Its presence is the commit point
of an output folder; its sha256 identifies the output to the stages that read it.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

MANIFEST_NAME = "_manifest.json"


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
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        raw = json.loads(text)
        raw["inputs"] = [InputRef(**i) for i in raw.get("inputs", [])]
        raw["files"] = [FileEntry(**f) for f in raw.get("files", [])]
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in raw.items() if k in known})


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
