"""Checkpoint folders: a Hugging Face model folder that transformers and vLLM load as is, plus
`trainer_state/` (optimizer state, step, RNG state), `critic/` when a critic is trained, and
`_manifest.json` written last.

    OUT/config.json  OUT/model.safetensors  OUT/tokenizer.json ...
    OUT/trainer_state/state.json  OUT/trainer_state/optimizer.pt
    OUT/critic/  (HF folder + value_head.safetensors)
    OUT/_manifest.json
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from rlctl import faults
from rlctl.errors import InputError
from rlctl.manifest import MANIFEST_NAME, Manifest
from rlctl.shards import commit, local_path

STATE_DIR = "trainer_state"
CRITIC_DIR = "critic"


def local_checkpoint_dir(uri: str) -> Path:
    path = local_path(uri)
    if path is None:
        raise InputError(f"checkpoint {uri!r}: checkpoints are written to local (or mounted shared) folders")
    return Path(path)


def save_checkpoint(uri: str, *, policy, trainer_state: dict, manifest: Manifest, critic=None) -> Manifest:
    """Write the policy (and critic) weights, the trainer state, then the manifest."""
    import fsspec

    out = local_checkpoint_dir(uri)
    (out / MANIFEST_NAME).unlink(missing_ok=True)  # uncommitted from here until the end
    for stale in (out / STATE_DIR, out / CRITIC_DIR):
        shutil.rmtree(stale, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    policy.model.save_pretrained(out)
    policy.tokenizer.save_pretrained(out)
    state_dir = out / STATE_DIR
    state_dir.mkdir()
    torch.save({"optimizer": trainer_state["optimizer"], "critic_optimizer": trainer_state.get("critic_optimizer")}, state_dir / "optimizer.pt")
    rng = {"torch": torch.get_rng_state()}
    torch.save(rng, state_dir / "rng.pt")
    (state_dir / "state.json").write_text(json.dumps({"step": trainer_state["step"]}, indent=2) + "\n")
    if critic is not None:
        critic.save(out / CRITIC_DIR)
    faults.point(f"{uri}:before-commit")
    commit(fsspec.filesystem("file"), str(out), manifest)
    return manifest


def load_trainer_state(uri: str) -> dict | None:
    """{"step", "optimizer", "critic_optimizer"} of an rlctl checkpoint, None for a plain HF folder."""
    state_dir = Path(uri) / STATE_DIR
    if not (state_dir / "state.json").exists():
        return None
    state = json.loads((state_dir / "state.json").read_text())
    optim = torch.load(state_dir / "optimizer.pt", weights_only=False) if (state_dir / "optimizer.pt").exists() else {}
    return {"step": state["step"], **optim}
