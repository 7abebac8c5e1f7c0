"""Epoch checkpoints of the supervised commands (`rlctl sft`, `dpo`, `reward-model`, and a
pipeline's warm starts), so that a run stopped part-way (a crash, a kill, a lost machine)
resumes after its last finished epoch instead of from the start.

After every epoch but the last, the command commits `OUT.progress/epoch-NNNN` beside OUT (and
then removes the one before, so a crash while one is written leaves the last one whole): the
weights as they are (a LoRA run's adapter), the optimizer's state (`progress_state/`, a trainer_state
folder that nothing else loads), anything the command keeps beside them (DPO's reference
log-probabilities), and in its manifest the final output's key and the epochs' figures so far.
A rerun whose manifest has the same key (the same inputs and settings) starts from that folder
at the next epoch; the epochs' order is seeded by their number and the learning rate follows
the optimizer's step, so it ends at the weights an uninterrupted run ends at. Once OUT is
committed the folder is removed; `--force` starts over.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlctl import faults
from rlctl.checkpoint import local_checkpoint_dir, verify_checkpoint
from rlctl.errors import InputError
from rlctl.manifest import Manifest
from rlctl.shards import is_committed, read_manifest

SUFFIX = ".progress"
STATE_DIR = "progress_state"  # the optimizer's state: not `trainer_state/`, which a pipeline's workers load as their own
KEPT_FILE = "kept.safetensors"  # tensors the command keeps beside the weights (DPO: the reference's log-probs)


def progress_dir(out: str) -> Path:
    """Where the epoch checkpoints of the output `out` are kept: a sibling folder."""
    folder = local_checkpoint_dir(out)
    return folder.parent / (folder.name + SUFFIX)


def epoch_dir(out: str, epoch: int) -> Path:
    return progress_dir(out) / f"epoch-{epoch:04d}"


def _latest_committed(out: str) -> Path | None:
    folders = sorted(progress_dir(out).glob("epoch-*")) if progress_dir(out).is_dir() else []
    return next((f for f in reversed(folders) if is_committed(str(f))), None)


@dataclass(frozen=True)
class Progress:
    """A committed epoch checkpoint of the same run: its folder (the weights to load), the
    epochs done, their rows (epoch 0's held-out figures too), the optimizer's step and state,
    and the tensors kept beside them."""

    folder: str
    epoch: int
    rows: list[dict]
    state: dict = field(repr=False)
    kept: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)


def resume_point(out: str, manifest: Manifest, force: bool) -> Progress | None:
    """The epoch checkpoint this run resumes from: one committed with the same key; None to
    start (and any other one removed, as `--force` removes it)."""
    from safetensors.torch import load_file

    from rlctl import trainer_state

    if force or manifest.key is None or any(i.manifest_sha256 is None for i in manifest.inputs):
        clear(out)
        return None
    folder = _latest_committed(out)
    if folder is None:
        clear(out)
        return None
    recorded, _ = read_manifest(str(folder))
    if recorded.key != manifest.key:
        clear(out)
        return None
    try:
        verify_checkpoint(str(folder))
        state = trainer_state.load(folder / STATE_DIR)
        kept = load_file(str(folder / KEPT_FILE)) if (folder / KEPT_FILE).exists() else {}
    except InputError as exc:
        print(f"rlctl: {folder} cannot be resumed from ({exc}); starting over", file=sys.stderr, flush=True)
        clear(out)
        return None
    epoch = int(recorded.state["epoch"])
    print(f"rlctl: resuming {manifest.stage} after epoch {epoch} from {folder}", file=sys.stderr, flush=True)
    return Progress(str(folder), epoch, list(recorded.state["epochs"]), state, kept)


def progress_manifest(manifest: Manifest, epoch: int, rows: list[dict]) -> Manifest:
    """The epoch checkpoint's manifest: the final output's key, the epochs done and their rows."""
    return Manifest(stage=f"{manifest.stage}-progress", config=manifest.config, inputs=manifest.inputs, seed=manifest.seed, key=manifest.key,
                    state={"epoch": epoch, "epochs": list(rows)})


def run_epochs(
    out: str, manifest: Manifest, *, epochs: int, progress: Progress | None, before: Callable[[], dict] | None, epoch: Callable[[int], dict],
    save: Callable[[Path, Manifest], object], report: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Every epoch's row: `before()` (the held-out figures before training, not on a resume),
    then `epoch(n)` for each epoch after the resumed one; after each but the last,
    `save(folder, manifest)` commits the epoch checkpoint. `report(row)` as each row comes."""
    rows = list(progress.rows) if progress is not None else []

    def add(row: dict) -> None:
        rows.append(row)
        if report is not None:
            report(row)

    if progress is None and before is not None:
        add(before())
    for n in range((progress.epoch if progress is not None else 0) + 1, epochs + 1):
        add(epoch(n))
        if n < epochs:
            save(epoch_dir(out, n), progress_manifest(manifest, n, rows))
            for older in progress_dir(out).glob("epoch-*"):  # the one just committed is the run's point to resume from
                if older.name < epoch_dir(out, n).name:
                    shutil.rmtree(older, ignore_errors=True)
            faults.point(f"{out}:epoch-{n}-saved")
    return rows


def clear(out: str) -> None:
    """Remove the output's epoch checkpoint (the run finished, or starts over)."""
    shutil.rmtree(progress_dir(out), ignore_errors=True)
