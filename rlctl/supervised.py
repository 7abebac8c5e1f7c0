"""The optimizer side of rlctl's supervised trainers (`rlctl sft`, `rlctl reward-model`, `rlctl dpo`): AdamW on
the trainable weights, each epoch's rows in a seeded order, an optimizer step per `batch_size`
rows whose passes accumulate its gradient, clipping, the learning-rate schedule over the run's
steps, a non-finite gradient refused before it reaches the weights, and the line each epoch
prints."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator

import torch

from rlctl.errors import TrainingError

Tally = dict  # sums over optimizer steps of an epoch: "steps", "rows", "norm_sum", "lr" (the last step's), "seconds", and a trainer's own


def merged(tally: Tally, more: Tally) -> Tally:
    """Two runs of steps of one epoch as one: sums added, the later learning rate kept."""
    return {**tally, **{k: v if k == "lr" else tally.get(k, 0) + v for k, v in more.items()}}


class SupervisedSteps:
    """What a supervised trainer shares; `cfg` has lr, weight_decay, batch_size, max_grad_norm,
    warmup_steps, lr_schedule, min_lr_ratio, bf16, gradient_checkpointing and seed; `command`
    names it in messages."""

    def __init__(self, model, cfg, *, device_type: str, total_steps: int, command: str) -> None:
        from rlctl.backends.hf import disable_dropout, held_whole
        from rlctl.dtypes import autocast_bf16
        from rlctl.lora import transformers_model
        from rlctl.trainer import adamw, trainable

        self.model, self.cfg, self.total_steps, self.command = model, cfg, total_steps, command
        self.step = 0
        self.params = trainable(model)
        self.optimizer = adamw(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.bf16 = autocast_bf16(cfg.bf16, device_type)
        self.weights_whole = held_whole(model)  # not FSDP2 shards (casts_kept)
        if getattr(cfg, "disable_dropout", False):  # dpo, kto, reward-model; sft trains with the model's dropout
            disable_dropout(model)
        if cfg.gradient_checkpointing:
            transformers_model(model).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def lr_at(self, step: int) -> float:
        from rlctl.algos.lr_schedule import lr_at

        cfg = self.cfg
        return lr_at(step, lr=cfg.lr, warmup_steps=cfg.warmup_steps, schedule=cfg.lr_schedule, decay_steps=self.total_steps, min_lr_ratio=cfg.min_lr_ratio)

    def steps_of_epoch(self, count: int, epoch: int) -> Iterator[list[int]]:
        """Each optimizer step's rows of an epoch over `count` rows (the model in training mode
        meanwhile); the caller's passes between one and the next accumulate its gradient."""
        order = torch.randperm(count, generator=torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + epoch))
        self.model.train()
        try:
            for start in range(0, count, self.cfg.batch_size):
                self.optimizer.zero_grad(set_to_none=True)
                yield order[start : start + self.cfg.batch_size].tolist()
        finally:
            self.model.eval()

    def run_steps(self, count: int, epoch: int, passes: Callable[[list[int]], None], first: int = 0, last: int | None = None) -> Tally:
        """Optimizer steps `first` to `last` (None: the end) of an epoch over `count` rows:
        `passes(rows)` accumulates a step's gradient (and the caller's sums), then the step is
        taken. How many steps over how many rows, their norms' sum, the last rate, the seconds."""
        started = time.perf_counter()
        done: Tally = {"steps": 0, "rows": 0, "norm_sum": 0.0, "lr": None}
        for index, rows in enumerate(self.steps_of_epoch(count, epoch)):
            if index < first:
                continue
            if last is not None and index >= last:
                break
            passes(rows)
            norm, done["lr"] = self.apply(f"{self.command.replace('-', '_')}.lr")
            done["steps"] += 1
            done["rows"] += len(rows)
            done["norm_sum"] += norm
            self.after_step()
        done["seconds"] = time.perf_counter() - started
        return done

    def after_step(self) -> None:
        """What a trainer does after each optimizer step (`rlctl dpo`: move its reference)."""

    def pair_steps(self, pairs, epoch: int, sums, first: int = 0, last: int | None = None) -> Tally:
        """Optimizer steps `first` to `last` of an epoch over preference pairs, each the mean of
        its pairs' losses as the trainer's `passes` computes them, their sums added to `sums`:
        the tally with them (reward-model, dpo)."""
        def passes(rows: list[int]) -> None:
            sums.add(self.passes(pairs, rows, lambda summed: (summed / len(rows)).backward()))  # the step's mean

        return {**self.run_steps(len(pairs), epoch, passes, first, last), **vars(sums)}

    def state_dict(self) -> dict:
        """The optimizer's step and whole state (on FSDP2 ranks gathered: every rank calls it)."""
        from rlctl.workers.gather import full_optimizer_state

        return {"step": self.step, "optimizer": self.optimizer.state_dict() if self.weights_whole else full_optimizer_state(self.model, self.optimizer)}

    def load_state_dict(self, state: dict) -> None:
        """`state_dict()`'s (read back by rlctl.trainer_state), so training goes on where it stopped."""
        from rlctl.workers.gather import set_full_optimizer_state

        self.step = int(state["step"])
        if self.weights_whole:
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            set_full_optimizer_state(self.model, self.optimizer, state["optimizer"])
        if state.get("rng") is not None:
            torch.set_rng_state(state["rng"])

    def apply(self, lower: str) -> tuple[float, float]:
        """Clip the accumulated gradient and take the optimizer step at the schedule's rate:
        (the norm before clipping, the rate). `lower` names the setting to lower when the norm
        is not finite (nothing is committed then)."""
        from rlctl.trainer import clip_gradients

        norm = clip_gradients(self.params, self.cfg.max_grad_norm)
        if not math.isfinite(norm):
            raise TrainingError(f"{self.command}: optimizer step {self.step} had a non-finite gradient norm; nothing is committed (lower {lower}?)")
        lr = self.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.step += 1
        return norm, lr


def describe_epoch(row: dict, command: str = "sft") -> str:
    """One epoch's row as the line the command and the pipeline print."""
    return f"{command}: " + "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items() if k != "seconds")
