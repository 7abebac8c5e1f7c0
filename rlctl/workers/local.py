"""Models held resident in this process for a pipeline run: each loaded once.

The policy that trains is the policy that generates (HybridFlow's colocated hybrid engine):
on the HF backend the rollout engine *is* the training module, so the weight hand-over after
an update is in memory and costs nothing. With `rollout.backend = "vllm"` a vLLM engine lives
beside the trainer in this process; after every update the trainer's tensors are pushed into
it in place and a probe checks that both are the same model (a failed check is exit 1). The
reference model and the critic are held beside them when configured. `RayWorkers` offers the
same methods.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlctl import faults
from rlctl.backends.hf import HFPolicy, ValueModel, resolve_device
from rlctl.checkpoint import CRITIC_DIR, load_trainer_state, same_folder, save_checkpoint
from rlctl.config import Config
from rlctl.digests import module_digest, stream_digest
from rlctl.errors import InputError
from rlctl.lora import (
    AdapterDisabledReference,
    adapts_tied_output,
    base_path,
    hf_state_dict,
    is_lora,
    prepare_for_training,
)
from rlctl.manifest import Manifest
from rlctl.trainer import Trainer


class LocalWorkers:
    writes_parts = False  # one process: the controller writes what it computed
    def __init__(self, cfg: Config, *, policy_source: str, critic_source: str | None) -> None:
        self.device = resolve_device(cfg.model.device)
        self.loads: list[str] = []  # every model load, for accounting (each model once per run)
        self._digests: dict[tuple[str, int], str] = {}
        self.policy = self._load_policy(policy_source)
        prepare_for_training(self.policy, cfg.update.lora, policy_source)
        self.ref = self._reference(cfg.model.ref) if cfg.model.ref else None
        self.critic = None
        if critic_source:
            self.loads.append(f"critic:{critic_source}")
            self.critic = ValueModel.load(critic_source, self.device)
        temperature = cfg.rollout.temperature
        self.trainer = Trainer(self.policy, cfg.update, critic=self.critic, temperature=temperature)
        state = load_trainer_state(policy_source)
        if state is not None:
            self.trainer.load_state_dict(state)
        self.generator = None  # a vLLM engine beside the trainer, or None (the trainer generates)
        if cfg.rollout.backend == "vllm":
            self.generator = start_vllm(cfg, policy_source, self.policy)

    def _reference(self, uri: str):
        """The reference model; for a LoRA policy whose base it is, the policy itself with
        its adapters disabled (no second copy)."""
        if is_lora(self.policy.model) and same_folder(uri, base_path(self.policy.model)):
            return AdapterDisabledReference(self.policy)
        return self._load_policy(uri)

    def load_reference(self, uri: str) -> None:
        """Score with the reference at `uri` from now on (pipeline.ref_sync_every)."""
        self.loads.append(f"ref:{uri}")
        self.ref = None  # the old one freed before the new one loads
        self.ref = self._reference(uri)

    def _load_policy(self, uri: str) -> HFPolicy:
        self.loads.append(f"policy:{uri}")
        return HFPolicy.load(uri, str(self.device))

    @property
    def engine(self):
        """The rollout engine: the training policy itself (hf), or the vLLM engine beside it."""
        return self.generator or self.policy

    def pause_engine(self) -> None:
        """Before an update: a vLLM engine on a GPU gives its memory to the trainer (sleep mode)."""
        if self.generator is not None:
            self.generator.sleep()

    def hand_over_weights(self) -> dict:
        """Make the rollout engine generate with the just-trained weights, for the manifest.
        hf: shared module, nothing moves. vllm: push in place, then the probe check."""
        handed = {"mode": "in-memory (shared module)", "policy_version": self.trainer.step, "weights_digest": self.weights_digest()}
        if self.generator is None:
            return handed
        return {**handed, "mode": "in-place push into the vLLM engine", **push_and_check(self.generator, self.policy.model, self.trainer.step)}

    def weights_digest(self, *, stream: bool = False) -> str:
        """The policy's weights' digest (rlctl.digests), kept per optimizer step since the
        weights change only when the trainer steps. `stream`: the one-stream digest that runs
        recorded before name their weights by (replay of such a run)."""
        if stream:
            return stream_digest(self.policy.model)
        return self._digest("policy", self.policy.model)

    def critic_digest(self) -> str:
        return self._digest("critic", self.critic)

    def _digest(self, name: str, module: torch.nn.Module) -> str:
        key = (name, self.trainer.step)
        if key not in self._digests:
            self._digests = {k: v for k, v in self._digests.items() if k[0] != name}
            self._digests[key] = module_digest(module)
        return self._digests[key]

    def save(self, directory: str, manifest: Manifest, pipeline_state: dict | None) -> Manifest:
        """A checkpoint whose manifest (the commit point) carries the controller's state."""
        if pipeline_state is not None:
            manifest.state = {**manifest.state, "pipeline": pipeline_state}
        return save_checkpoint(directory, policy=self.policy, trainer_state=self.trainer.state_dict(), manifest=manifest, critic=self.critic)

    def close(self) -> None:
        """Stop a vLLM engine; the other models live in this process and go with it."""
        if getattr(self, "generator", None) is not None:
            self.generator.close()
            self.generator = None


def start_vllm(cfg: Config, source: str, trainer: HFPolicy):
    """The vLLM engine of a hybrid run, checked against the trainer before its first rollout."""
    from rlctl.backends.base import sampling_params
    from rlctl.backends.vllm_engine import VLLMEngine

    lora = is_lora(trainer.model)
    if lora and adapts_tied_output(trainer.model):
        raise InputError(
            "update.lora adapts lm_head of a model with tied embeddings: vLLM ties them again and would not generate with the "
            "trained lm_head; leave lm_head out of update.lora.target_modules, or use rollout.backend = \"hf\""
        )
    engine = VLLMEngine.load(base_path(trainer.model) if lora else source, cfg.model.device, cfg.vllm, compute_dtype=cfg.rollout.dtype, params=sampling_params(cfg.rollout), seed=cfg.rollout.seed)
    if lora:  # the engine holds the base: give it the merged weights before the first rollout
        push_and_check(engine, trainer.model, 0)
    else:
        sync_record(engine, trainer.model, 0.0)
    return engine


def push_and_check(engine, trainer_model: torch.nn.Module, step: int) -> dict:
    """Push the trainer's tensors into the vLLM engine in place, then probe it (`sync_record`).
    The test-only fault `RLCTL_FAULT_SKIP=push-weights-` skips the push, for the probe to catch."""
    seconds = 0.0
    if not faults.skipped(f"push-weights-{step}"):
        seconds = engine.push_weights(hf_state_dict(trainer_model).items())
    return sync_record(engine, trainer_model, seconds)


def sync_record(engine, trainer_model: torch.nn.Module, seconds: float) -> dict:
    """The probe check after a push, as recorded; out of sync is exit 1 (never train on stale rollouts)."""
    from rlctl.backends.vllm_engine import WeightsOutOfSyncError

    check = engine.check_against(trainer_model)
    if not check.in_sync:
        raise WeightsOutOfSyncError(f"the vLLM engine is not generating with the trainer's weights: {check.reason()}; stopping before the next rollout")
    return {"weights_in_sync": True, "weight_sync_seconds": seconds, "probe_max_logprob_diff": check.max_logprob_diff}


def checkpoint_sources(checkpoint: str | None, cfg: Config, start: str | None = None) -> tuple[str, str | None]:
    """Where to load the policy and critic from: a resumed checkpoint, or the config's models
    (the policy from `start`, a warm start's checkpoint, where given)."""
    if checkpoint is None:
        return start or cfg.model.path, (cfg.model.critic or None)
    critic = str(Path(checkpoint) / CRITIC_DIR) if cfg.model.critic else None
    return checkpoint, critic
