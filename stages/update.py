"""update: batch + policy checkpoint → new checkpoint + one metrics row (in the manifest).

The optimizer state saved in the input checkpoint is restored, so consecutive `update`s
behave as one continuous run. A critic given with `--critic` is trained too and written to
OUT/critic.

    rlctl update --batch runs/b --model models/tiny --out runs/ckpt-1 --lr 1e-5
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pyarrow as pa

from rlctl.backends import compiled_layers
from rlctl.checkpoint import (
    CRITIC_DIR,
    load_trainer_state,
    local_checkpoint_dir,
    same_folder,
    save_checkpoint,
)
from rlctl.config import UpdateConfig, WorkersConfig, to_dict
from rlctl.dtypes import decided_bf16, models_device
from rlctl.errors import InputError
from rlctl.lineage import make_manifest, model_ref, shards_ref, up_to_date
from rlctl.lora import prepare_for_training
from rlctl.manifest import Manifest, strict_json_value
from rlctl.passes import ModelShape, decided_micro_batch_tokens, ranks_at_once
from rlctl.schemas import spec, validate
from rlctl.shards import read
from rlctl.stages.rollout import sampling_of
from rlctl.tensors import check_token_ids
from rlctl.trainer import TrainBatch, Trainer, check_update_config


def run(
    *, batch: str, model: str, out: str, cfg: UpdateConfig, critic: str | None = None, device: str = "auto", force: bool = False,
    workers: WorkersConfig = WorkersConfig(),
) -> Manifest:
    from rlctl.backends.hf import HFPolicy, ValueModel, check_model_dir, resolve_device

    check_update_config(cfg)
    on = models_device(device, workers)
    tokens = decided_micro_batch_tokens(
        cfg.micro_batch_tokens, on, ModelShape.of_folder(model), critic=ModelShape.of_folder(critic) if critic else None, ranks=ranks_at_once(workers),
    )
    compiled_layers.check_compile(cfg.compile, on)
    cfg = replace(cfg, bf16=decided_bf16(cfg.bf16, on), micro_batch_tokens=tokens)  # "auto" decided, and recorded
    local_checkpoint_dir(out)
    for name, given in (("--model", model), ("--critic", critic)):
        if given and (same_folder(out, given) or same_folder(out, str(Path(given).parent)) and Path(given).name == CRITIC_DIR):
            raise InputError(f"update --out {out} is the {name} folder: write the new checkpoint elsewhere (an update in place could be applied twice after a crash)")
    source = read(batch, "batch")
    check_model_dir(model)
    if critic:
        check_model_dir(critic)
    elif cfg.critic_warmup:
        raise InputError("update.critic_warmup trains only the critic for its steps: give --critic")
    inputs = [shards_ref(source), model_ref(model)] + ([model_ref(critic)] if critic else [])
    manifest = make_manifest("update", {"update": to_dict(cfg), "critic": critic or ""}, inputs, seed=cfg.seed)
    if (existing := up_to_date(out, manifest, force)) is not None:
        return existing
    train_batch = TrainBatch.from_table(source.table)
    if train_batch.size == 0:
        raise InputError(f"{batch}: the batch has no rows")
    if cfg.rollout_rs != "off" and ("old_logprobs" not in source.table.column_names or source.table.column("old_logprobs").null_count):
        raise InputError(f"{batch}: update.rollout_rs compares the old policy's log-probs with the engine's, and the batch has no old_logprobs (score with --policy)")
    temperature = float(sampling_of(source.table).get("temperature", 1.0))
    if workers.backend == "ray":
        return _update_on_workers(source, train_batch, model, critic, out, cfg, workers, manifest, temperature)
    policy = HFPolicy.load(model, device)
    prepare_for_training(policy, cfg.lora, model)
    check_token_ids(source.table, policy.vocab_size, source=batch)
    critic_model = ValueModel.load(critic, resolve_device(device)) if critic else None
    trainer = Trainer(policy, cfg, critic=critic_model, temperature=temperature)
    state = load_trainer_state(model) or {"step": 0}
    if critic:
        state["critic_optimizer"] = _critic_optimizer_state(critic)
    trainer.load_state_dict(state)
    record_metrics(manifest, trainer.train(train_batch))
    return save_checkpoint(out, policy=policy, trainer_state=trainer.state_dict(), manifest=manifest, critic=critic_model)


def record_metrics(manifest: Manifest, metrics: dict) -> None:
    """The metrics row into the manifest: strict JSON (a skipped step's losses are null) and
    checked against the metrics schema."""
    manifest.metrics = strict_json_value(metrics)
    validate(pa.Table.from_pylist([manifest.metrics]), "metrics", source="update metrics")
    manifest.schema, manifest.schema_version = "metrics", spec("metrics").version


def _update_on_workers(source, train_batch, model, critic, out, cfg, workers, manifest, temperature) -> Manifest:
    """The same update on a Ray worker group (FSDP2 ranks); rank 0 writes the checkpoint."""
    from rlctl.workers import worker_group

    with worker_group(workers, policy=model, critic=critic, update=cfg, temperature=temperature) as group:
        check_token_ids(source.table, group.vocab_size, source=source.uri)
        record_metrics(manifest, group.trainer.train(train_batch))
        manifest.state = {**manifest.state, "workers": to_dict(workers)}
        return group.save(out, manifest, None)


def _critic_optimizer_state(critic_uri: str):
    """A critic saved inside a checkpoint (CKPT/critic) has its optimizer in CKPT's state."""
    path = Path(critic_uri)
    state = load_trainer_state(str(path.parent)) if path.name == CRITIC_DIR else None
    return state.get("critic_optimizer") if state else None
