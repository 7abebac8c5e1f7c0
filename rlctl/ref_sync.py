"""A reference that follows the policy: every `pipeline.ref_sync_every` iterations the
reference becomes α·policy + (1 − α)·reference (TRL's `sync_ref_model` with
`ref_model_mixup_alpha`, from TR-DPO; α = 1 is ProRL's reference reset), so a long run's KL
term pulls towards where the policy recently was rather than where it started.

The new reference is written as a model folder of its own, `RUN/refs/iter-NNNN` (the iteration
after whose update it was made), from that iteration's checkpoint and the reference before it,
one weights file at a time; then every worker loads it from there, as any reference. Score's
manifests name the reference they used (state `ref_source`), so a replay scores with it and a
resume picks the run up with the reference it had.
"""

from __future__ import annotations

import shutil
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from rlctl.errors import InputError
from rlctl.folders import OutputWrite, describe_files
from rlctl.manifest import RESERVED_NAMES, Manifest
from rlctl.shards import filesystem, is_committed, read_manifest

REFS_DIR = "refs"
WEIGHTS_SUFFIX = ".safetensors"


@dataclass(frozen=True)
class RefSync:
    """When the reference moves, and how far towards the policy."""

    every: int  # iterations between syncs; 0 = never (the reference stays model.ref)
    alpha: float  # 1 = the policy's weights; below, a mix with the reference before

    def due(self, iteration: int) -> bool:
        """Whether the reference moves after this iteration's update."""
        return self.every > 0 and iteration % self.every == 0


def synced_ref_dir(run_dir: Path, iteration: int) -> Path:
    return run_dir / REFS_DIR / f"iter-{iteration:04d}"


def weight_files(folder: str | Path) -> list[Path]:
    """The folder's top-level safetensors files (one, or the shards of a sharded save)."""
    return sorted(p for p in Path(folder).glob(f"*{WEIGHTS_SUFFIX}") if p.is_file())


def tensor_shapes(folder: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (file name, shape)} from the safetensors headers, no tensor read."""
    from safetensors import safe_open

    files = weight_files(folder)
    if not files:
        raise InputError(f"{folder}: holds no .safetensors weights; a reference that follows the policy is mixed from safetensors folders")
    shapes = {}
    for file in files:
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                shapes[name] = (file.name, tuple(f.get_slice(name).get_shape()))
    return shapes


def check_mixable(policy: str | Path, ref: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The two folders hold the same tensors by name and shape (exit 2 naming the first that
    differs), so that the reference can be mixed from the policy; the reference's
    `tensor_shapes`."""
    mine, theirs = tensor_shapes(policy), tensor_shapes(ref)
    for name in sorted(set(mine) | set(theirs)):
        if name not in theirs or name not in mine:
            where = ref if name not in theirs else policy
            raise InputError(f"pipeline.ref_sync_every: {where} has no tensor {name!r}: the reference must be the policy's architecture to follow it")
        if mine[name][1] != theirs[name][1]:
            raise InputError(f"pipeline.ref_sync_every: tensor {name!r} is {list(mine[name][1])} in {policy} but {list(theirs[name][1])} in {ref}")
    return theirs


def mixed(policy: torch.Tensor, ref: torch.Tensor, alpha: float) -> torch.Tensor:
    """α·policy + (1 − α)·ref, computed in float32 (float64 for float64) and stored in the
    policy's dtype; exactly the policy at α = 1."""
    if alpha == 1.0 or not policy.is_floating_point():
        return policy
    wide = torch.float64 if policy.dtype == torch.float64 else torch.float32
    return (alpha * policy.to(wide) + (1.0 - alpha) * ref.to(wide)).to(policy.dtype)


def sync_key(alpha: float, policy: str | Path, ref: str) -> dict:
    """What a synced reference is made of: reused only when all three are the same (the
    checkpoint by its manifest's digest, so a re-saved checkpoint makes it again)."""
    return {"alpha": alpha, "policy": str(policy), "policy_digest": read_manifest(str(policy))[1], "ref": ref}


def write_synced_reference(out: Path, *, policy: str | Path, ref: str, alpha: float) -> Path:
    """The reference `out` mixed from the checkpoint `policy` and the reference folder `ref`,
    committed (manifest last); an already committed one of the same making is kept."""
    key = sync_key(alpha, policy, ref)
    if is_committed(str(out)) and read_manifest(str(out))[0].config.get("ref_sync") == key:
        return out
    locations = {name: file for name, (file, _) in check_mixable(policy, ref).items()}
    fs, path = filesystem(str(out))
    with OutputWrite(fs, path, str(out), what="reference", fixed_names=True) as writing:
        for item in sorted(Path(policy).iterdir()):  # config, tokenizer, weights index: the policy's own
            if item.is_file() and item.suffix != WEIGHTS_SUFFIX and item.name not in RESERVED_NAMES:
                shutil.copyfile(item, out / item.name)
        for file in weight_files(policy):
            _write_mixed(file, Path(ref), locations, out / file.name, alpha)
        names = sorted(str(p.relative_to(out)) for p in out.iterdir() if p.is_file() and p.name not in RESERVED_NAMES)
        manifest = Manifest(stage="reference", config={"ref_sync": key})
        manifest.files = describe_files(fs, path, names)
        writing.commit(manifest)
    return out


def _write_mixed(file: Path, ref: Path, locations: dict[str, str], target: Path, alpha: float) -> None:
    """One weights file of the policy mixed with the reference's same tensors: a file at a
    time, so the memory it takes is one file's tensors, not the model's."""
    if alpha == 1.0:
        shutil.copyfile(file, target)
        return
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(file))
    with ExitStack() as stack:
        opened = {}
        for name, tensor in tensors.items():
            source = locations[name]
            if source not in opened:
                opened[source] = stack.enter_context(safe_open(str(ref / source), "pt"))
            tensors[name] = mixed(tensor, opened[source].get_tensor(name), alpha)
    save_file(tensors, str(target), metadata={"format": "pt"})


def references_in_use(run_dir: Path) -> set[str]:
    """The synced references something in the run folder still names: a checkpoint's (a
    resume scores with it) and a committed score's (a replay does)."""
    from rlctl.runinfo import iteration_folders

    named = []
    for checkpoint in iteration_folders(run_dir / "checkpoints"):
        if is_committed(str(checkpoint)):
            named.append(read_manifest(str(checkpoint))[0].state.get("pipeline", {}).get("ref_source"))
    for iteration in iteration_folders(run_dir):
        for score in iteration.glob("score*"):
            if score.is_dir() and is_committed(str(score)):
                named.append(read_manifest(str(score))[0].state.get("ref_source"))
    return {str(Path(source).resolve()) for source in named if source}


def prune_references(run_dir: Path, *, current: str) -> list[Path]:
    """Remove the RUN/refs folders neither the current reference nor the run folder's
    checkpoints and score outputs name (rlctl.pipeline keeps the last few of those)."""
    keep = references_in_use(run_dir) | {str(Path(current).resolve())}
    removed = []
    for folder in sorted((run_dir / REFS_DIR).glob("iter-*")):
        if str(folder.resolve()) not in keep:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed
