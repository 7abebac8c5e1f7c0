"""What an output was made from: digests of inputs and models, and the stage key that lets a
stage whose output is already up to date do nothing."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Any

from rlctl.errors import InputError
from rlctl.folders import verify_files
from rlctl.manifest import MANIFEST_NAME, InputRef, Manifest, stage_key
from rlctl.shards import STDIO, Shards, filesystem, is_committed, read_manifest


def shards_ref(shards: Shards) -> InputRef:
    """The input's manifest sha256, or for a bare file the sha256 of its bytes."""
    if shards.manifest_sha256 or shards.uri == STDIO:
        return shards.ref()
    fs, path = filesystem(shards.uri)
    digest = hashlib.sha256()
    with fs.open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return InputRef(shards.uri, digest.hexdigest())


def model_ref(uri: str) -> InputRef:
    """A checkpoint's manifest sha256, or for a plain HF folder a hash of its weights + config."""
    path = Path(uri)
    if (path / MANIFEST_NAME).exists():
        return InputRef(uri, read_manifest(uri)[1])
    digest = hashlib.sha256()
    for file in sorted(path.glob("*.json")) + sorted(path.glob("*.safetensors")):
        digest.update(file.name.encode())
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return InputRef(uri, digest.hexdigest())


def make_manifest(stage: str, config: dict[str, Any], inputs: list[InputRef], seed: int | None = None) -> Manifest:
    key = stage_key(stage, config, [i.manifest_sha256 for i in inputs])
    return Manifest(stage=stage, config=config, inputs=inputs, seed=seed, key=key)


def up_to_date(out_uri: str, manifest: Manifest, force: bool) -> Manifest | None:
    """The existing output's manifest (marked skipped) when it has the same key and is intact.
    An output that is one of the stage's own inputs is refused: the write would replace it."""
    if out_uri != STDIO:
        target = _location(out_uri)
        for ref in manifest.inputs:
            if ref.uri != STDIO and _location(ref.uri) == target:
                raise InputError(f"--out {out_uri} is also an input of this {manifest.stage}: write the output elsewhere")
    if force or out_uri == STDIO or any(i.manifest_sha256 is None for i in manifest.inputs):
        return None
    if not is_committed(out_uri):
        return None
    existing, _ = read_manifest(out_uri)
    if existing.key != manifest.key:
        return None
    fs, path = filesystem(out_uri)
    try:
        verify_files(fs, path, existing, out_uri)
    except InputError as exc:
        print(f"rlctl: {out_uri} is up to date but damaged ({exc}); re-running", file=sys.stderr, flush=True)
        return None
    existing.state = {**existing.state, "skipped": True}
    return existing


def _location(uri: str) -> tuple[str, str]:
    """(protocol, absolute path) of a URI, to tell two spellings of one folder."""
    fs, path = filesystem(uri)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol, os.path.realpath(path) if protocol in ("file", "local") else path.rstrip("/")
