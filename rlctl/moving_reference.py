"""A reference that moves towards the policy during `rlctl dpo` and `rlctl kto` (TR-DPO and
TR-KTO, Gorbatovski et al., 2024; TRL's sync_ref_model): after every `ref_sync_every`-th
optimizer step the reference becomes α·policy + (1 − α)·reference (`ref_sync_alpha`), and the
trainer recomputes its log-probabilities of the training rows (DPO's pairs; KTO's examples and
their mismatched pairs), so each later step compares with the reference of its time, as TRL's
reference forward per batch does.

With α = 1 the reference is the policy as it is at the sync, so its log-probabilities are the
current weights' and no copy is held. Below 1 a copy of the weights is held beside the policy
(on an FSDP2 rank: a copy of its shards), mixed in place and swapped into the model for the
reference's forward. The epoch checkpoints keep the copy whole, so a resumed run mixes into the
same reference."""

from __future__ import annotations

import contextlib

import torch

KEPT_PREFIX = "reference_weights/"  # the copy's tensors in an epoch checkpoint's kept file, by parameter name


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this process holds: an FSDP2 parameter's shard (the storage FSDP2 gathers from), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class MovingReference:
    """The reference of one preference run whose weights the policy `model` trains."""

    def __init__(self, model: torch.nn.Module, *, every: int, alpha: float) -> None:
        from rlctl.workers.gather import sharded_registered

        sharded_registered(model)  # an FSDP2 root's own parameters as the optimizer holds them, not a forward's gathered copies
        self.model, self.every, self.alpha = model, every, alpha
        self.named = list(model.named_parameters())
        with torch.no_grad():
            self.weights = [p.detach().clone() for _, p in self.named] if alpha < 1 else None

    def due(self, step: int) -> bool:
        """Whether the reference moves after the run's `step`-th optimizer step."""
        return step > 0 and step % self.every == 0

    @torch.no_grad()
    def move(self) -> None:
        """reference ← α·policy + (1 − α)·reference (α = 1: nothing held, the policy is it)."""
        if self.weights is None:
            return
        for (_, param), weight in zip(self.named, self.weights):
            _local(weight).lerp_(_local(param.detach()), self.alpha)

    @contextlib.contextmanager
    def swapped_in(self):
        """The model holding the reference's weights (the policy's put aside), then the policy's again."""
        if self.weights is None:
            yield
            return
        self._swap()
        try:
            yield
        finally:
            self._swap()

    @torch.no_grad()
    def _swap(self) -> None:
        """Exchange the model's weights with the copy's, a tensor at a time (one tensor's
        memory beside them). An FSDP2 model is resharded first: after a forward without a
        backward its root keeps gathered copies, which would go on holding the other weights."""
        from rlctl.workers.gather import sharded_registered

        sharded_registered(self.model)
        for (_, param), weight in zip(self.named, self.weights):
            held, other = _local(param.detach()), _local(weight)
            put_aside = held.clone()
            held.copy_(other)
            other.copy_(put_aside)

    def kept(self) -> dict[str, torch.Tensor]:
        """The copy's weights, whole, by parameter name (for an epoch checkpoint; on FSDP2 ranks
        a collective: every rank calls it)."""
        from torch.distributed.tensor import DTensor

        if self.weights is None:
            return {}
        return {KEPT_PREFIX + name: (w.full_tensor() if isinstance(w, DTensor) else w).detach().cpu().clone() for (name, _), w in zip(self.named, self.weights)}

    @torch.no_grad()
    def restore(self, kept: dict[str, torch.Tensor]) -> None:
        """The copy as an epoch checkpoint kept it (`kept()`'s tensors; an FSDP2 rank takes its shard of each)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        from rlctl.errors import InputError

        if self.weights is None:
            return
        missing = [name for name, _ in self.named if KEPT_PREFIX + name not in kept]
        if missing:
            raise InputError(f"the epoch checkpoint keeps no reference weights for {missing[0]!r} ({len(missing)} missing): resume with --force")
        for index, (name, param) in enumerate(self.named):
            whole = kept[KEPT_PREFIX + name].to(device=param.device, dtype=param.dtype)
            if isinstance(param, DTensor):
                self.weights[index] = distribute_tensor(whole, param.device_mesh, param.placements)
            else:
                self.weights[index].copy_(whole)


class ReferenceSyncs:
    """The part of a preference trainer (DpoTrainer, KtoTrainer) whose reference may move: it
    keeps the rows in training and, after every due optimizer step, moves the reference and
    recomputes their reference log-probabilities in place. The trainer gives
    `reference_values(rows)` (the current weights' values, a tensor) and its rows
    `refresh_reference_values(values)`; held-out rows keep the starting weights' as their
    reference, so that epochs compare (and `--eval` measures the same)."""

    moving_reference: MovingReference | None = None
    training = None  # the rows a sync recomputes: the ones in training

    def start_moving_reference(self, model: torch.nn.Module, cfg) -> None:
        """A moving reference when `cfg.ref_sync_every` asks for one."""
        self.moving_reference = MovingReference(model, every=cfg.ref_sync_every, alpha=cfg.ref_sync_alpha) if cfg.ref_sync_every else None

    def after_step(self) -> None:
        if self.moving_reference is not None and self.moving_reference.due(self.step):
            self.sync_reference()

    def sync_reference(self) -> None:
        """The reference moved towards the policy, and its log-probabilities of the training rows
        recomputed (in eval mode: the step loop trains in training mode)."""
        moving = self.moving_reference
        moving.move()
        self.model.eval()
        try:
            with moving.swapped_in():
                self.training.refresh_reference_values(self.reference_values(self.training))
        finally:
            self.model.train()
