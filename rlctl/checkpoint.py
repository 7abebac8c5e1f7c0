"""Checkpoint folders: a Hugging Face model folder that transformers and vLLM load as is (or,
for a LoRA run, peft's adapter folder over the base it names: `rlctl reshard --merge-lora`), plus
`trainer_state/` (optimizer state, step, RNG state: safetensors + JSON, never pickle),
`critic/` when a critic is trained, and `_manifest.json` written last, listing every file with
its size and sha256.

    OUT/config.json  OUT/model.safetensors  OUT/tokenizer.json ...
    OUT/trainer_state/{state.json, optimizer.safetensors, rng.safetensors}
    OUT/critic/  (HF folder + value_head.safetensors)
    OUT/_manifest.json

Every load verifies the folder against its manifest (`verify_checkpoint`): a missing, changed
or unlisted file is exit 2. A plain HF folder without a manifest is a user's model and loads
as it is.
"""

from __future__ import annotations

import os
from pathlib import Path

from rlctl import faults, trainer_state
from rlctl.errors import InputError
from rlctl.folders import OutputWrite, describe_files, verify_files
from rlctl.manifest import MANIFEST_NAME, RESERVED_NAMES, Manifest
from rlctl.shards import filesystem, local_path, read_manifest

STATE_DIR = "trainer_state"
CRITIC_DIR = "critic"


def local_checkpoint_dir(uri: str) -> Path:
    path = local_path(uri)
    if path is None:
        raise InputError(f"checkpoint {uri!r}: checkpoints are written to local (or mounted shared) folders")
    return Path(path)


def save_checkpoint(
    uri: str, *, policy, trainer_state: dict | None, manifest: Manifest, critic=None, critic_files: dict[str, bytes] | None = None,
    state_dir: str = STATE_DIR, files: dict[str, bytes] | None = None,
) -> Manifest:
    """Write the policy (and critic) weights and the trainer state (into `state_dir`), then the
    manifest. `critic_files`: the critic's folder as another process saved it (a critic pool of
    its own); `files`: more files by name, listed in the manifest as the rest."""
    out = local_checkpoint_dir(uri)
    fs, path = filesystem(str(out))
    with OutputWrite(fs, path, uri, what="checkpoint", fixed_names=True) as writing:
        policy.model.save_pretrained(out)
        policy.tokenizer.save_pretrained(out)
        if trainer_state is not None:  # None: weights to start from, not a run to resume (rlctl sft)
            save_trainer_state(out / state_dir, trainer_state)
        for name, data in (files or {}).items():
            (out / name).write_bytes(data)
        if critic is not None:
            critic.save(out / CRITIC_DIR)
        for name, data in (critic_files or {}).items():
            (out / CRITIC_DIR / name).parent.mkdir(parents=True, exist_ok=True)
            (out / CRITIC_DIR / name).write_bytes(data)
        names = [str(p.relative_to(out)) for p in sorted(out.rglob("*")) if p.is_file() and p.name not in RESERVED_NAMES]
        manifest.files = describe_files(fs, path, names)
        faults.point(f"{uri}:before-commit")
        return writing.commit(manifest)


def save_trainer_state(state_dir: Path, state: dict) -> None:
    trainer_state.save(state_dir, step=state["step"], optimizers={n: state.get(n) for n in trainer_state.OPTIMIZER_NAMES}, entropy_control=state.get("entropy_control"))


def load_trainer_state(uri: str) -> dict | None:
    """{"step", "optimizer", "critic_optimizer", "rng", "entropy_control"} of an rlctl checkpoint, None for a plain HF folder."""
    state_dir = Path(uri) / STATE_DIR
    if not state_dir.is_dir():
        return None
    verify_checkpoint(uri)
    return trainer_state.load(state_dir)


def checkpoint_root(uri: str) -> Path | None:
    """The committed checkpoint a model folder belongs to: itself, or for CKPT/critic, CKPT."""
    path = Path(uri)
    if (path / MANIFEST_NAME).exists():
        return path
    if path.name == CRITIC_DIR and (path.parent / MANIFEST_NAME).exists():
        return path.parent
    return None


_verified: dict[str, tuple] = {}


def verify_checkpoint(uri: str) -> None:
    """Every file of the checkpoint `uri` belongs to is listed, present and intact (exit 2 if not).

    Verified once per process for an unchanged folder (the key is the manifest's bytes and
    every file's size and mtime), since a run loads the same checkpoint more than once."""
    root = checkpoint_root(uri)
    if root is None:
        return
    manifest, digest = read_manifest(str(root))
    if not manifest.files:
        raise InputError(f"{root}: its manifest lists no files (an older rlctl wrote it), so it cannot be verified; start from its weights as a plain model folder")
    present = {str(p.relative_to(root)): p.stat() for p in root.rglob("*") if p.is_file() and p.name not in RESERVED_NAMES}
    unlisted = sorted(set(present) - {f.path for f in manifest.files})
    if unlisted:
        raise InputError(f"{root}: holds {unlisted[0]!r}, which its manifest does not list (added after commit)")
    key = (digest, tuple(sorted((n, s.st_size, s.st_mtime_ns) for n, s in present.items())))
    if _verified.get(str(root.resolve())) == key:
        return
    fs, path = filesystem(str(root))
    verify_files(fs, path, manifest, str(root))
    _verified[str(root.resolve())] = key


def is_intact(uri: str) -> str | None:
    """None when the checkpoint verifies, else the reason it does not."""
    try:
        verify_checkpoint(uri)
        if not (Path(uri) / "config.json").exists() and not (Path(uri) / "adapter_config.json").exists():
            return "no config.json (nor a LoRA adapter_config.json)"
    except InputError as exc:
        return str(exc)
    return None


def same_folder(a: str, b: str) -> bool:
    """Whether two local paths name one folder (symlinks and `..` resolved)."""
    return os.path.realpath(a) == os.path.realpath(b)
