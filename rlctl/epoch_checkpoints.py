"""Epoch checkpoints of the supervised commands (`rlctl sft`, `dpo`, `reward-model`, and a
pipeline's warm starts), so that a run stopped part-way (a crash, a kill, a lost machine)
resumes where it stopped instead of from the start.

After every epoch but the last, and every `save_steps` optimizer steps within an epoch, the
command commits a checkpoint in `OUT.progress/` beside OUT (`epoch-NNNN` after epoch N,
`epoch-NNNN-step-SSSSSS` S steps into the next; the one before is removed once it is whole, so a
crash while one is written leaves the last one): the weights as they are (a LoRA run's
adapter), the optimizer's state (`progress_state/`, a trainer_state folder that nothing else
loads), anything the command keeps beside them (DPO's reference log-probabilities), and in its
manifest the final output's key, the epochs' rows so far and the sums of the unfinished epoch's
steps. A rerun whose manifest has the same key (the same inputs and settings) starts from the
last one; an epoch's order is seeded by its number and the learning rate follows the
optimizer's step, so it ends at the weights an uninterrupted run ends at. Once OUT is committed
the folder is removed; `--force` starts over.
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


def result_settings(settings: dict) -> dict:
    """A command's settings as its output's key takes them: without `save_steps`, which changes
    how often the run is saved, not what it computes (a rerun saving more or less often resumes)."""
    return {k: v for k, v in settings.items() if k != "save_steps"}


def checkpoint_dir(out: str, epoch: int, step: int = 0) -> Path:
    """The checkpoint after `epoch` epochs and `step` steps of the next (names sort in run order)."""
    return progress_dir(out) / (f"epoch-{epoch:04d}" + (f"-step-{step:06d}" if step else ""))


def _latest_committed(out: str) -> Path | None:
    folders = sorted(progress_dir(out).glob("epoch-*")) if progress_dir(out).is_dir() else []
    return next((f for f in reversed(folders) if is_committed(str(f))), None)


@dataclass(frozen=True)
class Progress:
    """A committed epoch checkpoint of the same run: its folder (the weights to load), the
    epochs done, their rows (epoch 0's held-out figures too), the optimizer's step and state,
    and the tensors kept beside them."""

    folder: str
    epoch: int  # epochs finished
    step: int  # optimizer steps of the next epoch done
    tally: dict  # their sums (rlctl.supervised.Tally)
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
    epoch, step = int(recorded.state["epoch"]), int(recorded.state.get("step", 0))
    where = f"after epoch {epoch}" if not step else f"{step} steps into epoch {epoch + 1}"
    print(f"rlctl: resuming {manifest.stage} {where} from {folder}", file=sys.stderr, flush=True)
    return Progress(str(folder), epoch, step, dict(recorded.state.get("tally") or {}), list(recorded.state["epochs"]), state, kept)


def progress_manifest(manifest: Manifest, epoch: int, rows: list[dict], step: int = 0, tally: dict | None = None) -> Manifest:
    """A checkpoint's manifest: the final output's key, the epochs done and their rows, the
    steps of the next one done and their sums."""
    return Manifest(stage=f"{manifest.stage}-progress", config=manifest.config, inputs=manifest.inputs, seed=manifest.seed, key=manifest.key,
                    state={"epoch": epoch, "step": step, "tally": dict(tally or {}), "epochs": list(rows)})


def run_epochs(
    out: str, manifest: Manifest, *, epochs: int, steps_per_epoch: int, save_steps: int, progress: Progress | None, before: Callable[[], dict] | None,
    steps: Callable[[int, int, int], dict], row: Callable[[int, dict], dict], save: Callable[[Path, Manifest], object],
    report: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Every epoch's row: `before()` (the held-out figures before training, not on a resume),
    then for each epoch after the resumed point `steps(epoch, first, last)` over its optimizer
    steps (in runs of `save_steps`, 0: all at once) and `row(epoch, tally)`; a checkpoint is
    committed (`save(folder, manifest)`) after each run of steps that does not end the training.
    `report(row)` as each row comes."""
    from rlctl.supervised import merged

    rows = list(progress.rows) if progress is not None else []

    def add(row: dict) -> None:
        rows.append(row)
        if report is not None:
            report(row)

    def commit(epoch: int, step: int, tally: dict) -> None:
        folder = checkpoint_dir(out, epoch, step)
        save(folder, progress_manifest(manifest, epoch, rows, step, tally))
        for older in progress_dir(out).glob("epoch-*"):  # the one just committed is the run's point to resume from
            if older.name < folder.name:
                shutil.rmtree(older, ignore_errors=True)
        faults.point(f"{out}:epoch-{epoch + 1 if step else epoch}{f'-step-{step}' if step else ''}-saved")

    if progress is None and before is not None:
        add(before())
    start = progress.epoch + 1 if progress is not None else 1
    for n in range(start, epochs + 1):
        first, tally = (progress.step, dict(progress.tally)) if progress is not None and n == start else (0, {})
        while first < steps_per_epoch:
            last = min(first + save_steps, steps_per_epoch) if save_steps else steps_per_epoch
            tally, first = merged(tally, steps(n, first, last)), last
            if first < steps_per_epoch:
                commit(n - 1, first, tally)
        add(row(n, tally))
        if n < epochs:
            commit(n, 0, {})
    return rows


def clear(out: str) -> None:
    """Remove the output's epoch checkpoint (the run finished, or starts over)."""
    shutil.rmtree(progress_dir(out), ignore_errors=True)


def clear_finished(out: str, manifest: Manifest) -> None:
    """Remove the epoch checkpoint of a run whose output is committed already (a crash between
    the output's commit and the removal left it behind); another run's (other settings) stays."""
    folder = _latest_committed(out)
    if folder is not None and read_manifest(str(folder))[0].key == manifest.key:
        clear(out)
