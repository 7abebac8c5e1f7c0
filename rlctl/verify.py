"""`rlctl verify PATH`: everything committed under PATH checked against its manifest, and what
was left half-written found, before a run is trusted, shared or resumed on another machine.

Each committed folder (stage outputs, checkpoints, synced references, reward models, epoch
checkpoints: a folder with `_manifest.json`) must hold every file its manifest lists, of the
listed size and sha256 (`--sizes-only`: sizes), and a model folder nothing it does not list
(loading refuses one). An input a manifest names by digest that is still there must still
have that digest: else the output is stale, made from data that has since been rewritten.
Folders with parts but no manifest are writes that never committed (safe to delete, and
ignored by every reader); a `_lock.json` names the writer that holds a folder, or one that
died holding it.

    rlctl verify runs/grpo             # exit 0: all intact; 1: something damaged or stale
"""

from __future__ import annotations

import hashlib
import posixpath
from dataclasses import asdict, dataclass, replace

import fsspec

from rlctl.errors import InputError
from rlctl.folders import verify_files
from rlctl.locks import describe, is_stale, read_holder
from rlctl.manifest import LOCK_NAME, MANIFEST_NAME, RESERVED_NAMES, InputRef, Manifest
from rlctl.shards import filesystem, read_manifest

FAILING = ("damaged", "stale")  # statuses that make `rlctl verify` exit 1
MODEL_FILES = ("config.json", "adapter_config.json")  # a committed model folder: loading refuses unlisted files


@dataclass(frozen=True)
class Finding:
    """One folder's verdict: ok | damaged | stale | extra | uncommitted | locked."""

    folder: str  # relative to the verified path ("." for the path itself)
    status: str
    stage: str = ""
    files: int = 0
    bytes: int = 0
    detail: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def verify_tree(uri: str, *, digests: bool = True) -> list[Finding]:
    """The findings of every committed, uncommitted and locked folder under `uri`, in path order."""
    fs, root = filesystem(uri)
    root = root.rstrip("/") or "/"
    fs.invalidate_cache(root)
    if not fs.exists(root):
        raise InputError(f"{uri!r} does not exist")
    if not fs.isdir(root):
        raise InputError(f"{uri}: a file, not a folder; rlctl verify checks a committed folder or a tree of them")
    tree = {path.rstrip("/") or "/": (list(dirs), list(files)) for path, dirs, files in fs.walk(root)}
    committed = {path for path, (_, files) in tree.items() if MANIFEST_NAME in files}
    children = subfolders(tree, root)
    owners = committed_above(root, children, committed)
    findings = []
    for path in sorted(tree):
        dirs, files = tree[path]
        name = relative(path, root)
        owner = owners.get(path)
        if path in committed:
            findings.append(check_committed(fs, path, name, tree, children, committed, digests))
        elif owner is None and any(is_part(f) for f in files):
            parts = [f for f in files if is_part(f)]
            findings.append(Finding(name, "uncommitted", files=len(parts), detail="parts without a manifest: a write that never committed (no reader uses them; safe to delete)"))
        if LOCK_NAME in files:
            findings.append(lock_finding(fs, path, name))
    return findings


def check_committed(fs: fsspec.AbstractFileSystem, path: str, name: str, tree: dict, children: dict, committed: set[str], digests: bool) -> Finding:
    """A committed folder: its manifest readable, its files intact, nothing unlisted in a model
    folder, its inputs as they were."""
    uri = protocol_path(fs, path)
    try:
        manifest, _ = read_manifest(uri)
    except InputError as exc:
        return Finding(name, "damaged", detail=without_prefix(str(exc), uri))
    found = Finding(name, "ok", stage=manifest.stage, files=len(manifest.files), bytes=sum(entry.bytes for entry in manifest.files))
    try:
        verify_files(fs, path, manifest, uri, verify=digests)
    except InputError as exc:
        return replace(found, status="damaged", detail=without_prefix(str(exc), uri))
    listed = {entry.path for entry in manifest.files}
    unlisted = sorted(set(files_under(path, tree, children, committed)) - listed)
    if unlisted and any(model in listed for model in MODEL_FILES):
        return replace(found, status="damaged", detail=f"holds {unlisted[0]!r}, which its manifest does not list (added after commit); loading refuses it")
    changed = changed_inputs(manifest, digests)
    if changed:
        return replace(found, status="stale", detail=changed)
    if unlisted:
        return replace(found, status="extra", detail=f"{len(unlisted)} file(s) its manifest does not list, e.g. {unlisted[0]!r} (no reader uses them)")
    return found


def changed_inputs(manifest: Manifest, digests: bool) -> str:
    """Which recorded input (a committed folder, or a file) no longer has the digest the
    manifest names; "" when none did. Inputs that are gone (pruned), models held in memory and
    model folders without a manifest (digesting their weights is a checkpoint's read) are not
    checked."""
    for ref in manifest.inputs:
        if not ref.manifest_sha256 or ref.manifest_sha256 == "frozen" or "/" not in ref.uri or ref.uri.startswith("ref@"):
            continue  # a model a pipeline held in memory ("policy", "critic", "ref@FOLDER"), not a path
        current = current_digest(ref, digests)
        if current is not None and current != ref.manifest_sha256:
            return f"its input {ref.uri} changed after it was made (digest {current[:12]}…, recorded {ref.manifest_sha256[:12]}…): re-run it, or replay it"
    return ""


def current_digest(ref: InputRef, digests: bool) -> str | None:
    """An input's digest now, as lineage records it: a committed folder's manifest sha256, a
    plain file's bytes' sha256 (only with `digests`); None where it cannot be told cheaply."""
    try:
        fs, path = filesystem(ref.uri)
        if not fs.exists(path):
            return None
        if fs.isdir(path):
            return read_manifest(ref.uri)[1] if fs.exists(posixpath.join(path, MANIFEST_NAME)) else None
        if not digests:
            return None
        digest = hashlib.sha256()
        with fs.open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        return digest.hexdigest()
    except (InputError, OSError, ValueError):
        return None  # not a path (a model held in memory: "policy", "ref@..."), or unreadable now


def lock_finding(fs: fsspec.AbstractFileSystem, path: str, name: str) -> Finding:
    holder = read_holder(fs, posixpath.join(path, LOCK_NAME))
    if holder is None:
        return Finding(name, "locked", detail="the lock went while it was read")
    state = "a writer that is gone (the next write takes it over)" if is_stale(holder) else "a live writer"
    return Finding(name, "locked", detail=f"held by {describe(holder)}: {state}")


def subfolders(tree: dict, root: str) -> dict[str, list[str]]:
    """Each walked folder's folders one level down, by the walk's own paths."""
    children: dict[str, list[str]] = {}
    for folder in tree:
        if folder != root:
            children.setdefault(posixpath.dirname(folder) or "/", []).append(folder)
    return children


def committed_above(root: str, children: dict, committed: set[str]) -> dict[str, str]:
    """Each folder inside a committed one: the nearest committed folder above it (one pass down
    the tree, so a run of thousands of folders costs what it holds)."""
    owners, stack = {}, [(root, None)]
    while stack:
        folder, above = stack.pop()
        if above is not None:
            owners[folder] = above
        below = folder if folder in committed else above
        stack += [(child, below) for child in children.get(folder, [])]
    return owners


def files_under(path: str, tree: dict, children: dict, committed: set[str]) -> list[str]:
    """The files of `path`'s subtree, relative to it, leaving out reserved names (and a
    manifest's temporary name) and folders committed in their own right."""
    found, stack = [], [path]
    while stack:
        folder = stack.pop()
        prefix = relative(folder, path)
        found += [name if prefix == "." else f"{prefix}/{name}" for name in tree[folder][1] if name not in RESERVED_NAMES and not name.startswith(MANIFEST_NAME)]
        stack += [child for child in children.get(folder, []) if child not in committed]
    return found


def is_part(name: str) -> bool:
    """A file an output write puts before its commit: parts, their temporary names."""
    return name.startswith("part-") or name.endswith(".tmp")


def relative(path: str, root: str) -> str:
    return "." if path == root else path[len(root.rstrip("/")) + 1 :]


def protocol_path(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """The URI rlctl's readers take for a path of `fs`."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return path if protocol in ("file", "local") else f"{protocol}://{path}"


def without_prefix(message: str, uri: str) -> str:
    return message[len(uri) + 2 :] if message.startswith(uri + ": ") else message


def summary(findings: list[Finding], digests: bool) -> str:
    """One line: how much was verified, and how it stands."""
    committed = [f for f in findings if f.status not in ("uncommitted", "locked")]
    size = sum(f.bytes for f in committed)
    counts = {status: sum(1 for f in findings if f.status == status) for status in ("ok", "damaged", "stale", "extra", "uncommitted", "locked")}
    said = ", ".join(f"{n} {status}" for status, n in counts.items() if n or status == "ok")
    how = "sizes and sha256" if digests else "sizes only"
    return f"{len(committed)} committed folder(s), {sum(f.files for f in committed)} files, {size / 1e6:.1f} MB ({how}): {said}"
