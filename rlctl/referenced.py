"""Training against the starting weights as the reference (`rlctl dpo`, `rlctl kto`): the
reference's log-probabilities of every row are computed once, before the first step, by the
weights about to be trained (no second model held), kept in the epoch checkpoints (a resumed
run's weights are no longer the reference), and the command runs in this process or on a Ray
group of FSDP2 ranks. What the two commands differ in is a `ReferencedCommand`. Where the
reference moves during the run (`dpo.ref_sync_every`: rlctl.moving_reference), the checkpoints
keep its log-probabilities as of their step, and the weights of a mixed one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from rlctl.config import Config, to_dict
from rlctl.errors import InputError
from rlctl.manifest import Manifest
from rlctl.sft import LocalPolicy, RayPolicy


def reference_tensors(rows, held_out) -> dict[str, torch.Tensor]:
    """The reference's log-probabilities as an epoch checkpoint keeps them: the rows' and the
    held-out rows' `reference_values()`, [2, rows] each."""
    kept = {"train": rows.reference_values()}
    if held_out is not None:
        kept["held_out"] = held_out.reference_values()
    return kept


def kept_tensors(trainer, rows, held_out) -> dict[str, torch.Tensor]:
    """What an epoch checkpoint keeps beside the weights, as of now: the reference's
    log-probabilities (`reference_tensors`) and, where the reference moves and a copy of it is
    held (rlctl.moving_reference), its weights. On FSDP2 ranks a collective."""
    moving = trainer.moving_reference
    return {**reference_tensors(rows, held_out), **(moving.kept() if moving is not None else {})}


def kept_file(tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    """`kept_tensors` as the epoch checkpoint's file."""
    from safetensors.torch import save as save_tensors

    from rlctl.epoch_checkpoints import KEPT_FILE

    return {KEPT_FILE: save_tensors(tensors)}


def restore_moving_reference(trainer, kept: dict[str, torch.Tensor]) -> None:
    """A resumed run's moving reference as its epoch checkpoint kept it (nothing where the
    reference stays or no copy is held)."""
    moving = trainer.moving_reference
    if moving is not None:
        moving.restore(kept)


def with_kept_reference(rows, values: torch.Tensor | None):
    """`rows` with the reference's log-probabilities an epoch checkpoint kept (a resumed run:
    its weights are no longer the reference)."""
    if values is None or values.shape != (2, len(rows)):
        raise InputError("the epoch checkpoint's reference log-probabilities do not match the data")
    return rows.with_reference_values(values)


class LocalReferenced(LocalPolicy):
    """The command's trainer (`trainer_class`) in this process."""

    trainer_class: type

    def start(self, rows, held_out, total_steps: int, progress=None) -> tuple:
        """The trainer made, and the reference's log-probabilities of every row computed (or
        kept: a resumed run's); the rows with them."""
        self.trainer = self.trainer_class(self.policy, self.cfg, total_steps=total_steps)
        if progress is not None:
            restore_moving_reference(self.trainer, progress.kept)
        self.rows = self.trainer.with_reference(rows)
        self.held_out = self.trainer.with_reference(held_out) if held_out is not None else None
        self.resume(progress)
        return self.rows, self.held_out

    def save_progress(self, folder, manifest: Manifest, files: dict[str, bytes] | None = None) -> Manifest:
        """The epoch checkpoint, with the reference's log-probabilities (and a moving reference's weights) as they are now."""
        return super().save_progress(folder, manifest, {**(files or {}), **kept_file(kept_tensors(self.trainer, self.rows, self.held_out))})

    def steps(self, epoch: int, first: int, last: int) -> dict:
        return self.trainer.train_steps(self.rows, epoch, first, last)

    def evaluate(self) -> tuple:
        return self.trainer.evaluate(self.held_out)


class RayReferenced(RayPolicy):
    """The same on a Ray group of FSDP2 ranks (`command` names the trainer the ranks make)."""

    command: str

    def start(self, rows, held_out, total_steps: int, progress=None) -> tuple:
        import ray

        shared = ray.put((rows, held_out))  # one copy, read by every rank
        kept_in = progress.folder if progress is not None else None  # a moving reference's weights, read by each rank
        referenced = self.group.call_ranks("referenced_start", lambda rank: (self.command, shared, self.cfg, total_steps, kept_in))[0]
        self.resume(progress)
        return referenced

    def save_progress(self, folder, manifest: Manifest, files: dict[str, bytes] | None = None) -> Manifest:
        """The epoch checkpoint: the ranks gather the weights, the optimizer's state and what is kept beside them; rank 0 writes it."""
        return Manifest.from_json(self.group.call_ranks("referenced_save_progress", lambda rank: (str(folder), manifest.to_json(), files))[0])

    def steps(self, epoch: int, first: int, last: int) -> dict:
        return self.group.call_ranks("referenced_steps", lambda rank: (epoch, first, last))[0]

    def evaluate(self) -> tuple:
        return self.group.call_ranks("referenced_evaluate", lambda rank: ())[0]


@dataclass(frozen=True)
class ReferencedCommand:
    """What a command trained against its starting weights is made of: its name (its config
    section and its manifest's stage), what its rows are called, how they are read
    (`encode(table, tokenizer, data, section, end_ids=, context_length=, source=)`), where it
    trains, its epoch rows (`row(0)` before training; `trainer.epoch_row`), the two held-out
    figures its `evaluate()` gives, its metrics, and the output manifest's state from its rows."""

    name: str
    noun: str
    encode: Callable
    local: type
    ray: type
    trainer: type
    row: type
    held_out: tuple[str, str]
    metrics: tuple[str, ...]
    state: Callable[[object], dict]


def train_against_reference(
    command: ReferencedCommand, *, data: str, model: str, out: str, cfg: Config, val_data: str | None = None, device: str = "auto", force: bool = False,
    report: Callable[[dict], None] | None = None,
) -> Manifest:
    """Train the policy at `model` on the rows at `data` (`cfg`'s section of `command`, prompts
    as `cfg.data` makes them, in this process or on `cfg.workers`' Ray group) and commit the
    checkpoint at `out`; `report(row)` after each epoch (epoch 0: the held-out rows before
    training)."""
    from rlctl.backends.hf import check_model_dir
    from rlctl.checkpoint import local_checkpoint_dir, same_folder
    from rlctl.dtypes import decided_bf16, models_device
    from rlctl.epoch_checkpoints import (
        clear,
        clear_finished,
        result_settings,
        resume_point,
        run_epochs,
    )
    from rlctl.lineage import make_manifest, model_ref, shards_ref, up_to_date
    from rlctl.passes import ModelShape, decided_micro_batch_tokens, ranks_at_once
    from rlctl.shards import read

    name = command.name
    check_model_dir(model)
    local_checkpoint_dir(out)
    if same_folder(out, model):
        raise InputError(f"{name} --out {out} is the --model folder: write the trained checkpoint elsewhere")
    on = models_device(device, cfg.workers)
    section = getattr(cfg, name)
    section = replace(
        section, bf16=decided_bf16(section.bf16, on),
        micro_batch_tokens=decided_micro_batch_tokens(section.micro_batch_tokens, on, ModelShape.of_folder(model), ranks=ranks_at_once(cfg.workers)),
    )
    train_source = read(data)
    val_source = read(val_data) if val_data else None
    inputs = [shards_ref(train_source), model_ref(model)] + ([shards_ref(val_source)] if val_source else [])
    manifest = make_manifest(name, {name: result_settings(to_dict(section)), "data": to_dict(cfg.data)}, inputs, seed=section.seed)
    if (existing := up_to_date(out, manifest, force)) is not None:
        clear_finished(out, manifest)
        return existing
    if train_source.table.num_rows == 0:
        raise InputError(f"{data}: no {command.noun}")
    progress = resume_point(out, manifest, force)  # an epoch checkpoint of this run: its weights to go on from
    start = progress.folder if progress is not None else model
    where = command.ray(start, section, cfg.workers, device) if cfg.workers.backend == "ray" else command.local(start, section, device)
    try:
        def encoded(source):
            return command.encode(source.table, where.tokenizer, cfg.data, section, end_ids=where.end_ids, context_length=where.context_length, source=source.uri)

        rows = encoded(train_source)
        held_out = encoded(val_source) if val_source and val_source.table.num_rows else None
        if progress is not None:  # the reference is the starting weights, not the epoch checkpoint's
            rows = with_kept_reference(rows, progress.kept.get("train"))
            held_out = with_kept_reference(held_out, progress.kept.get("held_out")) if held_out is not None else None
        steps_per_epoch = -(-len(rows) // section.batch_size)
        rows, held_out = where.start(rows, held_out, section.epochs * steps_per_epoch, progress)

        def measured(row) -> dict:
            if held_out is not None:
                for field_name, value in zip(command.held_out, where.evaluate()):
                    setattr(row, field_name, value)
            return row.as_dict()

        epochs = run_epochs(
            out, manifest, epochs=section.epochs, steps_per_epoch=steps_per_epoch, save_steps=section.save_steps, progress=progress,
            before=(lambda: measured(command.row(0))) if held_out is not None else None, steps=where.steps,
            row=lambda n, tally: measured(command.trainer.epoch_row(n, tally)),
            save=where.save_progress, report=report,
        )
        optimizer_steps = sum(row.get("steps", 0) for row in epochs)
        manifest.state = {**command.state(rows), "optimizer_steps": optimizer_steps, "epochs": epochs, "reference": model}  # what `--eval` measures against
        if section.ref_sync_every:
            manifest.state["ref_syncs"] = optimizer_steps // section.ref_sync_every  # the reference moved; `--eval` still measures against the starting one
        manifest.metrics = {k: v for k, v in epochs[-1].items() if k in command.metrics}
        saved = where.save(out, manifest)
    finally:
        where.close()
    clear(out)
    return saved


# --- measuring a trained policy against its reference ------------------------------------------


def reference_of(model: str, stage: str) -> str | None:
    """The reference a checkpoint `stage` wrote was trained against (its starting weights), as its manifest records it."""
    from pathlib import Path

    from rlctl.manifest import MANIFEST_NAME
    from rlctl.shards import read_manifest

    if not (Path(model) / MANIFEST_NAME).exists():
        return None
    manifest, _ = read_manifest(model)
    return manifest.state.get("reference") if manifest.stage == stage else None


def measured_against_reference(command: ReferencedCommand, passes: type, *, data: str, model: str, cfg: Config, ref: str | None, device: str, free: bool = False):
    """For `--eval`: (the rows at `data`, read as training reads them, with the reference's
    log-probabilities; `passes` measuring the policy at `model`; the rows' table). The reference
    is `ref`, else the one `model`'s manifest records (a checkpoint `command` wrote); none where
    the loss is `free` of one."""
    from rlctl.backends.hf import HFPolicy, check_model_dir, resolve_device
    from rlctl.dtypes import autocast_bf16, decided_bf16
    from rlctl.passes import ModelShape, decided_micro_batch_tokens
    from rlctl.shards import read

    name = command.name
    check_model_dir(model)
    ref = None if free else ref or reference_of(model, name)
    if not free and not ref:
        raise InputError(f"{name} --eval: {model} is not a checkpoint rlctl {name} wrote, so its reference is unknown: give it as --ref")
    if ref:
        check_model_dir(ref)
    on = resolve_device(device)
    section = getattr(cfg, name)
    tokens = decided_micro_batch_tokens(section.micro_batch_tokens, on.type, ModelShape.of_folder(model), ranks=1)
    section = replace(section, bf16=decided_bf16(section.bf16, on.type), micro_batch_tokens=tokens)
    source = read(data)
    if source.table.num_rows == 0:
        raise InputError(f"{data}: no {command.noun}")
    bf16 = autocast_bf16(section.bf16, on.type)
    policy = HFPolicy.load(model, str(on))
    rows = command.encode(source.table, policy.tokenizer, cfg.data, section, end_ids=policy.stop_ids, context_length=policy.context_length, source=source.uri)
    reference = policy if free else HFPolicy.load(ref, str(on))
    rows = passes(reference, section, bf16=bf16).with_reference(rows)
    del reference
    return rows, passes(policy, section, bf16=bf16), source.table
