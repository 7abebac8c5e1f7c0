"""The PPO/GRPO update: epochs over the batch, mini-batches (one optimizer step each), and
micro-batches whose gradients sum to exactly the mini-batch gradient.

Exactness comes from `algos.losses.aggregate`: each micro-batch's loss is divided by the
token/sequence counts of its whole mini-batch, not its own, so accumulation is a plain sum.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa
import torch

from rlctl import faults
from rlctl.algos.entropy_control import EntropyControl
from rlctl.algos.kl import KL_ESTIMATORS
from rlctl.algos.losses import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    aggregate,
    clipped_value_loss,
    entropy_shaped_advantages,
    high_entropy_tokens,
    importance_ratio,
    off_policy_sequences,
    rollout_is_weights,
    sequence_log_weights,
)
from rlctl.algos.lr_schedule import lr_at
from rlctl.algos.rejection import RejectionRule, kept_tokens, parse_rules
from rlctl.backends import compiled_layers
from rlctl.backends.hf import (
    HFPolicy,
    ValueModel,
    casts_kept,
    disable_dropout,
    distinct_prompts,
    held_whole,
    pack,
    training_forward,
)
from rlctl.config import UpdateConfig
from rlctl.dtypes import autocast_bf16
from rlctl.errors import InputError, TrainingError
from rlctl.lora import transformers_model
from rlctl.passes import ModelShape, cut_passes, token_cap
from rlctl.tensors import list_lengths, mask_from_lengths, padded, sampled_mask


@dataclass(frozen=True)
class TrainBatch:
    """What update trains on, as padded [N, T] tensors plus the token ids."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    response_mask: torch.Tensor  # [N, T] bool
    advantages: torch.Tensor  # [N, T]
    old_logprobs: torch.Tensor | None  # [N, T]; None: the update's own first forward, detached (one optimizer step only)
    ref_logprobs: torch.Tensor | None  # [N, T]
    old_values: torch.Tensor | None  # [N, T]
    returns: torch.Tensor | None  # [N, T]
    rollout_logprobs: torch.Tensor | None = None  # [N, T] the engine's, for rollout importance sampling
    truncated: torch.Tensor | None = None  # [N] bool: cut at the length limit (finish_reason "length")
    rollout_is_scale: float = 1.0  # update.rollout_is_batch_normalize: 1 / the batch's mean truncated weight

    @property
    def size(self) -> int:
        return len(self.response_ids)

    def without_truncated(self) -> TrainBatch:
        """The batch with the tokens of its truncated responses out of the loss (update.mask_truncated):
        such a row then has no token to train on, and the trainer leaves it out of its passes."""
        if self.truncated is None or not bool(self.truncated.any()):
            return self
        return replace(self, response_mask=self.response_mask & ~self.truncated.unsqueeze(-1))

    def without_rejected(self, rules: list[RejectionRule]) -> tuple[TrainBatch, dict[str, float]]:
        """The batch with the tokens (or whole rows) that update.rollout_rs rejects out of the
        loss and its token divisors, as verl's rejection leaves its response_mask; the shares
        rejected. It compares the old policy's log-probs with the engine's, so both must be in it."""
        if self.old_logprobs is None or self.rollout_logprobs is None:
            raise InputError("update.rollout_rs compares the old policy's log-probs with the engine's: the batch needs old_logprobs (score.old_logprobs = recompute) and rollout_logprobs")
        kept, metrics = kept_tokens(rules, old_logprobs=self.old_logprobs, rollout_logprobs=self.rollout_logprobs, response_mask=self.response_mask)
        return replace(self, response_mask=kept), metrics

    def with_normalized_weights(self, level: str, threshold: float) -> TrainBatch:
        """update.rollout_is_batch_normalize (verl's rollout_is_batch_normalize): the truncated
        importance weights scaled so that their mean over the batch is 1 — over its tokens, or
        with sequence-level weights over its sequences (those with tokens in the loss)."""
        if self.old_logprobs is None or self.rollout_logprobs is None:
            raise InputError("update.rollout_is_batch_normalize needs the whole batch's weights before the update: old_logprobs (score.old_logprobs = recompute) and rollout_logprobs")
        weights = rollout_is_weights(old_logprobs=self.old_logprobs, rollout_logprobs=self.rollout_logprobs, response_mask=self.response_mask, level=level, threshold=threshold)
        if level == "sequence":
            rows = self.response_mask.any(-1)
            mean = float(weights[rows].amax(-1).double().mean()) if rows.any() else 1.0  # a row's one weight, on each of its tokens
        else:
            mean = float(weights[self.response_mask].double().mean()) if self.response_mask.any() else 1.0
        return replace(self, rollout_is_scale=1.0 / mean)

    @classmethod
    def from_table(cls, table: pa.Table, *, own_old_logprobs: bool = False) -> TrainBatch:
        """`own_old_logprobs`: the old policy's log-probs are the update's own forward before
        its one optimizer step (score.old_logprobs = "update"), not a column of the batch."""
        names = table.column_names
        lengths = list_lengths(table.column("response_ids"))
        width = int(lengths.max(initial=0))

        def optional(name):
            if name in names and not table.column(name).null_count:
                return padded(table.column(name), width=width, dtype=torch.float32)
            return None

        old = optional("old_logprobs")
        sampled = sampled_mask(table, lengths, width)  # a tool's tokens (rollout.tool): context, never trained on
        return cls(
            prompt_ids=table.column("prompt_ids").to_pylist(),
            response_ids=table.column("response_ids").to_pylist(),
            response_mask=sampled if sampled is not None else mask_from_lengths(lengths, width),
            advantages=padded(table.column("advantages"), width=width, dtype=torch.float32),
            old_logprobs=None if own_old_logprobs else old if old is not None else padded(table.column("rollout_logprobs"), width=width, dtype=torch.float32),
            ref_logprobs=optional("ref_logprobs"),
            old_values=optional("values"),
            returns=optional("returns"),
            rollout_logprobs=optional("rollout_logprobs"),
            truncated=torch.from_numpy(np.asarray(table.column("finish_reason").to_pylist(), dtype=object) == "length") if "finish_reason" in names else None,
        )


def check_update_config(cfg: UpdateConfig, batch_size: int | None = None) -> None:
    if cfg.compile and cfg.gradient_checkpointing:
        raise InputError("update.compile and update.gradient_checkpointing: choose one (the compiled layers keep their activations)")
    if cfg.loss_agg_mode not in LOSS_AGG_MODES:
        raise InputError(f"unknown loss_agg_mode {cfg.loss_agg_mode!r}; available: {', '.join(LOSS_AGG_MODES)}")
    KL_ESTIMATORS.get(cfg.kl_loss_estimator)
    if cfg.lora.r:
        from rlctl.lora import require_peft

        require_peft()
    if cfg.micro_batch_size < 1 or cfg.epochs < 1 or cfg.mini_batch_size < 0:
        raise InputError("update: micro_batch_size and epochs must be ≥ 1, mini_batch_size ≥ 0")
    if batch_size is not None and cfg.mini_batch_size and batch_size % cfg.mini_batch_size:
        raise InputError(f"update: mini_batch_size={cfg.mini_batch_size} does not divide the batch of {batch_size} sequences")
    if cfg.rollout_rs != "off":
        parse_rules(cfg.rollout_rs, cfg.rollout_rs_threshold)
    if cfg.entropy_target and cfg.entropy_coef_min > cfg.entropy_coef_max:
        raise InputError(f"update.entropy_coef_min ({cfg.entropy_coef_min:g}) is above update.entropy_coef_max ({cfg.entropy_coef_max:g})")
    if cfg.kl_loss_unbiased and not cfg.use_kl_loss:
        raise InputError("update.kl_loss_unbiased weighs the KL loss's terms: set update.use_kl_loss = true too")
    if cfg.lr_schedule != "constant" and cfg.decay_steps <= cfg.warmup_steps:
        per_batch = f"; this batch takes {optimizer_steps(cfg, batch_size)} optimizer steps per update" if batch_size else ""
        raise InputError(
            f"update.lr_schedule = {cfg.lr_schedule} decays until update.decay_steps ({cfg.decay_steps}), which must exceed "
            f"update.warmup_steps ({cfg.warmup_steps}): set it in optimizer steps{per_batch}"
        )


def optimizer_steps(cfg: UpdateConfig, batch_size: int) -> int:
    """Optimizer steps one update of `batch_size` sequences takes: a step per mini-batch, per epoch."""
    return cfg.epochs * (-(-batch_size // cfg.mini_batch_size) if cfg.mini_batch_size else 1)


KL_STOP_FACTOR = 1.5  # update.target_kl stops an update past this multiple of it (Spinning Up's and SB3's rule)


def kl_reached(cfg: UpdateConfig, stats: dict[str, float]) -> bool:
    """Whether a mini-batch's approximate KL from the old policy (k3, `approx_kl`) is past
    `update.target_kl` × KL_STOP_FACTOR: the update stops before stepping on it."""
    return bool(cfg.target_kl) and stats.get("approx_kl", 0.0) > KL_STOP_FACTOR * cfg.target_kl


@dataclass(frozen=True)
class RankGroup:
    """This process's place in a data-parallel group (rank 0 of 1 when training alone).

    Every rank holds the whole batch and computes the same mini-batch order and normalisers;
    it trains on its contiguous share of each mini-batch (`share`). FSDP averages gradients
    over ranks, while each rank's loss is its share of the whole mini-batch's loss, so the loss
    is scaled by the group size (`grad_scale`) to make the gradients sum. Statistics are
    partial sums, added across ranks (`sum`)."""

    rank: int = 0
    size: int = 1

    @property
    def grad_scale(self) -> float:
        return float(self.size)

    def micro_batches(
        self, indices: torch.Tensor, micro_batch_size: int, lengths: Sequence[int] | None = None, groups: Mapping[int, int] | Sequence[int] | None = None,
        max_tokens: int = 0,
    ) -> list[tuple[list[int], float]]:
        """(rows, weight) of each forward/backward pass this rank makes on a mini-batch.

        The rank's share is its contiguous slice of `indices`; with `lengths` (each row's
        sequence length) the share is ordered by length before it is cut into passes, so a pass
        pads its rows to a similar length instead of the longest of a random draw, and a pass
        holds at most `max_tokens` padded tokens (0: no cap; rlctl.passes). With
        `groups` (each row's prompt, by row: `distinct_prompts`) the rows of one prompt are kept
        together, in the mini-batch before it is shared out and in the passes (groups ordered
        by their longest row), so that a pass runs each prompt once. The loss normalisers are
        the mini-batch's, so no order changes a gradient (beyond float rounding). Every rank
        makes the same number of passes (FSDP's collectives run in lockstep), so a rank with
        fewer rows adds passes over one row with weight 0, which change neither gradients nor
        statistics."""
        from rlctl.dispatch import row_slices

        order = indices.tolist()
        if groups is not None:  # a group's rows side by side, groups in order of first appearance
            first: dict[int, int] = {}
            for row in order:
                first.setdefault(groups[row], len(first))
            order.sort(key=lambda row: first[groups[row]])
        # every rank's passes, to agree on their number
        shares = [cut_passes(_in_pass_order(order[s], lengths, groups), micro_batch_size, lengths, max_tokens) for s in row_slices(len(order), self.size)]
        passes = max(1, max(len(share) for share in shares))
        batches = shares[self.rank] + [[]] * (passes - len(shares[self.rank]))
        return [(rows, 1.0) if rows else (indices[:1].tolist(), 0.0) for rows in batches]

    def sum(self, stats: dict[str, float]) -> dict[str, float]:
        if self.size == 1:
            return stats
        keys = sorted(stats)
        values = self.sum_tensor(torch.tensor([stats[k] for k in keys], dtype=torch.float64))
        return dict(zip(keys, values.tolist()))

    def sum_tensor(self, values: torch.Tensor) -> torch.Tensor:
        """`values` (on the CPU) added across ranks (each rank's share filled in, zeros
        elsewhere); through the GPU where the group's backend is NCCL, which takes no CPU tensor."""
        if self.size == 1:
            return values
        import torch.distributed as dist

        if dist.get_backend() == "nccl":
            on_gpu = values.to(f"cuda:{torch.cuda.current_device()}")
            dist.all_reduce(on_gpu)
            return on_gpu.cpu()
        dist.all_reduce(values)
        return values


ALONE = RankGroup()


def rows_with_gradient(cfg: UpdateConfig, batch: TrainBatch, indices: torch.Tensor, *, critic: bool) -> torch.Tensor:
    """The rows of `indices` whose forward and backward can move a weight. Every policy loss is
    a token's advantage times a function of its ratio, so a row whose advantage is 0 at every
    response token (a GRPO group whose samples all scored alike) adds exactly 0 to the loss and
    to every gradient, unless another term reads its log-probs: a KL loss, an entropy bonus, or
    a critic trained in the same passes. The loss's divisors stay the whole mini-batch's, so
    leaving such rows out changes no gradient beyond float rounding (the passes hold other rows)."""
    if not cfg.skip_zero_advantage or critic or (cfg.use_kl_loss and cfg.kl_loss_coef > 0) or cfg.entropy_coef or cfg.entropy_target:
        return indices
    mask = batch.response_mask[indices].bool()
    moves = (torch.where(mask, batch.advantages[indices], 0) != 0).any(-1)
    return indices[moves]


def _in_pass_order(rows: list[int], lengths: Sequence[int] | None, groups: Mapping[int, int] | Sequence[int] | None) -> list[int]:
    """A rank's rows in the order its passes take them: by length, a prompt's rows together."""
    if groups is not None and lengths is not None:
        longest: dict[int, int] = {}
        for row in rows:
            longest[groups[row]] = max(longest.get(groups[row], 0), lengths[row])
        return sorted(rows, key=lambda row: (longest[groups[row]], groups[row], lengths[row]))
    if lengths is not None:
        return sorted(rows, key=lambda row: lengths[row])
    return rows


def adamw(params, *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW, fused where torch has the kernel for the parameters' device: on the CPU torch's
    default is a loop over the parameters, 5× slower (small preset: 39–45 ms against 8 ms a
    step; bench/RESULTS.md)."""
    params = list(params)
    into_process_memory(params)
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.bfloat16, torch.float16) for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)


def into_process_memory(params: list[torch.nn.Parameter]) -> None:
    """Move CPU parameters that still live in their checkpoint file's mapping into the process's
    own memory before an optimizer writes them in place. transformers loads safetensors weights
    as views of a private mapping of the file, and the first write to each of its pages is a
    copy-on-write fault: small preset (97 MB), 0.23 s at the first optimizer step of every
    `rlctl update` against ~20 ms for a copy (bench/RESULTS.md)."""
    with torch.no_grad():
        for param in params:
            if param.device.type == "cpu" and type(param.data) is torch.Tensor:  # not a DTensor shard (FSDP2 made its own copy)
                param.data = param.data.clone()


class Trainer:
    """Holds the policy (and critic) optimizers; `train(batch)` runs one update."""

    def __init__(
        self, policy: HFPolicy | None, cfg: UpdateConfig, *, critic: ValueModel | None = None, temperature: float = 1.0, ranks: RankGroup = ALONE,
    ) -> None:
        """`policy=None`: a critic-only trainer (the critic's own pool of ranks,
        `workers.placement = "split"`), stepping in lockstep with the policy's."""
        self.policy, self.cfg, self.critic, self.temperature, self.ranks = policy, cfg, critic, temperature, ranks
        self.step = 0
        self.entropy_control = EntropyControl(cfg.entropy_coef)  # update.entropy_target's controller (saved with the optimizer state)
        self.pad_id = policy.pad_id if policy is not None else 0  # padding sits past each row's end: any id gives the same values
        self.device = policy.device if policy is not None else next(critic.parameters()).device
        self.optimizer = adamw(trainable(policy.model), lr=cfg.lr, weight_decay=cfg.weight_decay) if policy is not None else None  # LoRA: the adapters only
        self.critic_optimizer = adamw(critic.parameters(), lr=cfg.critic_lr, weight_decay=cfg.weight_decay) if critic is not None else None
        # what update.micro_batch_tokens = "auto" fits in memory (a stage or pipeline decides it before: then unused)
        self.weights_whole = all(held_whole(m) for m in (policy.model if policy is not None else None, critic) if m is not None)  # not FSDP2 shards
        self.shapes = (ModelShape.of_model(policy.model) if policy is not None else None, ModelShape.of_model(critic.lm) if critic is not None else None)
        for lm in (policy.model if policy is not None else None, critic.lm if critic is not None else None):
            if lm is not None and cfg.disable_dropout:
                disable_dropout(lm)
            if lm is not None and cfg.compile:
                compiled_layers.enable(transformers_model(lm))
            if lm is not None and cfg.gradient_checkpointing:
                # non-reentrant: gradients reach LoRA adapters and FSDP2's hooks without inputs that require grad
                transformers_model(lm).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    # -- state ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "critic_optimizer": self.critic_optimizer.state_dict() if self.critic_optimizer else None,
            "entropy_control": self.entropy_control_state(),
        }

    def entropy_control_state(self) -> dict | None:
        """The adaptive entropy controller's state for a checkpoint; None where it is off."""
        return self.entropy_control.to_json() if self.cfg.entropy_target else None

    def load_entropy_control(self, saved: dict | None) -> None:
        """A checkpoint's controller state, where it has one and the control is on: a resumed run
        goes on with the coefficient it had (a run that turns the control on starts at entropy_coef)."""
        if saved is not None and self.cfg.entropy_target:
            self.entropy_control = EntropyControl.from_json(saved, where="the checkpoint's trainer state")

    def entropy_bonus(self) -> float:
        """The entropy bonus's coefficient in the coming optimizer step's loss."""
        cfg = self.cfg
        return self.entropy_control.applied(cfg.entropy_target) if cfg.entropy_target else cfg.entropy_coef

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.load_entropy_control(state.get("entropy_control"))
        if self.optimizer is not None and state.get("optimizer"):
            self.optimizer.load_state_dict(state["optimizer"])
        if self.critic_optimizer is not None and state.get("critic_optimizer"):
            self.critic_optimizer.load_state_dict(state["critic_optimizer"])

    def lr_at(self, step: int) -> float:
        """The policy's rate at optimizer step `step` (rlctl.algos.lr_schedule); its schedule
        starts when the critic's warm-up ends (0 before)."""
        cfg = self.cfg
        step -= cfg.critic_warmup
        if step < 0:
            return 0.0
        return lr_at(step, lr=cfg.lr, warmup_steps=cfg.warmup_steps, schedule=cfg.lr_schedule, decay_steps=cfg.decay_steps, min_lr_ratio=cfg.min_lr_ratio)

    # -- training ---------------------------------------------------------------------

    def train(self, batch: TrainBatch) -> dict[str, float]:
        cfg = self.cfg
        check_update_config(cfg, batch.size)
        if self.policy is not None and cfg.use_kl_loss and batch.ref_logprobs is None:
            raise InputError("use_kl_loss needs ref_logprobs in the batch: score with --ref")
        if self.critic is not None and (batch.returns is None or batch.old_values is None):
            raise InputError("training a critic needs values and returns in the batch (score with --critic, advantage gae)")
        mini = cfg.mini_batch_size or batch.size
        if self.policy is not None and batch.old_logprobs is None and (cfg.epochs > 1 or mini < batch.size):
            raise InputError(
                "the update's own log-probs stand for the old policy's only on its first optimizer step: "
                f"use one epoch and one mini-batch (epochs={cfg.epochs}, {-(-batch.size // mini)} mini-batches), or score's old_logprobs"
            )
        masked_rows = None
        if cfg.mask_truncated:
            batch = batch.without_truncated()
            masked_rows = float(batch.truncated.float().mean()) if batch.truncated is not None else 0.0
        correction: dict[str, float] = {}  # the rollout correction's batch-wide figures
        if cfg.rollout_rs != "off":  # on every rank alike: the whole batch's rows and tokens
            batch, correction = batch.without_rejected(parse_rules(cfg.rollout_rs, cfg.rollout_rs_threshold))
        if self.policy is not None and cfg.rollout_is != "off" and cfg.rollout_is_batch_normalize:
            batch = batch.with_normalized_weights(cfg.rollout_is, cfg.rollout_is_threshold)
            correction["rollout_is_batch_mean"] = 1.0 / batch.rollout_is_scale
        started = time.perf_counter()
        generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.step)
        totals: dict[str, float] = {}
        reported: dict[str, int] = {}
        steps = 0
        stopped = False  # update.target_kl: the policy moved far enough from the old one
        if self.policy is not None:
            self.policy.model.train()
        for _ in range(cfg.epochs):
            order = torch.randperm(batch.size, generator=generator)
            for start in range(0, batch.size, mini):
                stats = self.accumulate_gradients(batch, order[start : start + mini])
                if steps and kl_reached(cfg, stats):  # the same on every rank: the statistics are the group's sums
                    stopped = True
                    break
                stats.update(self._optimizer_step())
                if cfg.entropy_target and "entropy" in stats:  # a step that trained the policy measured its entropy
                    self.entropy_control = self.entropy_control.after_step(
                        stats["entropy"], target=cfg.entropy_target, delta=cfg.entropy_coef_delta, low=cfg.entropy_coef_min, high=cfg.entropy_coef_max,
                    )
                faults.point(f"rank-{self.ranks.rank}:optimizer-step-{self.step}")
                for k, v in stats.items():
                    totals[k] = totals.get(k, 0.0) + v
                    reported[k] = reported.get(k, 0) + 1
                steps += 1
            if stopped:
                break
        if stopped:  # the unapplied mini-batch's gradients go
            for optimizer in (self.optimizer, self.critic_optimizer):
                if optimizer is not None:
                    optimizer.zero_grad(set_to_none=True)
        if self.policy is not None:
            self.policy.model.eval()
        skipped = int(totals.get("skipped_steps", 0) + totals.get("vf_skipped_steps", 0))
        if skipped and not cfg.allow_skipped_steps:
            raise TrainingError(
                f"update: {skipped} of {steps} optimizer steps had a non-finite gradient norm and were skipped; "
                "nothing is committed (set update.allow_skipped_steps=true to go on without them)"
            )
        seconds = time.perf_counter() - started
        tokens = int(batch.response_mask.sum()) * cfg.epochs
        metrics = {k: v / reported[k] for k, v in totals.items()}  # a mean over the steps that measured it
        metrics.update({k: totals[k] for k in ("skipped_steps", "vf_skipped_steps") if k in totals})  # counts, not means
        metrics.update({"step": self.step, "lr": self.lr_at(self.step - 1), "seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9)})
        if cfg.target_kl:
            metrics.update(kl_stopped_early=float(stopped), optimizer_steps=steps)
        if cfg.entropy_target:
            metrics["entropy_coef"] = self.entropy_control.coef  # the controller's, for the next update's steps
        if masked_rows is not None:
            metrics["truncated_masked"] = masked_rows  # the share of the batch's rows out of the loss
        metrics.update(correction)
        return metrics

    def accumulate_gradients(self, batch: TrainBatch, indices: torch.Tensor) -> dict[str, float]:
        """Zero the gradients, then backward every micro-batch of this mini-batch."""
        cfg = self.cfg
        for optimizer in (self.optimizer, self.critic_optimizer):
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
        mask = batch.response_mask[indices]
        norms = {"batch_tokens": int(mask.sum()), "batch_seqs": len(indices), "horizon": cfg.loss_horizon or batch.response_mask.shape[1]}
        policy = self.policy if self.policy_trains() else None  # the critic's warm-up leaves the policy alone
        stats = {"pg_loss": 0.0, "pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0, "ppo_kl": 0.0, "entropy": 0.0} if policy is not None else {}
        if policy is not None and batch.ref_logprobs is not None:  # reported whenever measurable; a loss only with use_kl_loss
            stats["kl"] = 0.0
        if self.critic is not None:
            stats["vf_loss"] = 0.0
        if policy is not None and batch.old_logprobs is None and batch.rollout_logprobs is not None:
            stats["logprob_mismatch"] = 0.0  # engine vs trainer, measured where the old log-probs are made
        if policy is not None and cfg.rollout_is != "off":
            if batch.rollout_logprobs is None:
                raise InputError("update.rollout_is needs the engine's rollout_logprobs in the batch")
            stats["rollout_is_weight"] = 0.0
        if policy is not None and cfg.target_kl:
            stats["approx_kl"] = 0.0
        if policy is not None and cfg.top_entropy_quantile < 1.0:
            stats["entropy_tokens_kept"] = 0.0  # the share of the trained tokens whose policy gradient counted
        bonus = self.entropy_bonus()
        if policy is not None and cfg.entropy_advantage:
            stats["entropy_advantage"] = 0.0  # the mean raise of the trained tokens' advantages
        if policy is not None and cfg.off_policy_mask:
            stats["off_policy_masked"] = 0.0  # the share of the trained tokens the off-policy sequence mask left out
        if policy is not None and cfg.policy_loss == "vespo":
            stats["vespo_weight"] = 0.0  # VESPO's φ, a token-weighted mean over the trained tokens
        # every rank filters the whole mini-batch alike, so all make the same passes (FSDP)
        # update.mask_truncated, update.rollout_rs: a row without a token in the loss moves nothing in any term
        in_loss = indices[batch.response_mask[indices].any(-1)] if cfg.mask_truncated or cfg.rollout_rs != "off" else indices
        trained = rows_with_gradient(cfg, batch, in_loss, critic=self.critic is not None)
        weightless = trained.numel() == 0  # no row trains: one row's pass with its loss scaled by 0 gives the step its zero gradients
        if weightless:
            trained = indices[:1]
        tokens = max(int(batch.response_mask[trained].sum()), 1)  # the statistics' divisor: the trained tokens
        device = self.device
        bf16 = autocast_bf16(cfg.bf16, device.type)
        lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
        rows = trained.tolist()
        prompts = [batch.prompt_ids[i] for i in rows]
        # decided from the mini-batch's trained rows, so every rank makes the same forward calls (FSDP)
        share_prompts = policy is not None and policy.shares_prompts(prompts)
        groups = dict(zip(rows, distinct_prompts(prompts)[1])) if share_prompts else None  # the mini-batch's rows only
        with casts_kept(device, bf16 and self.weights_whole):  # each weight cast to bf16 once per optimizer step
            for micro, weight in self.ranks.micro_batches(trained, cfg.micro_batch_size, lengths, groups, token_cap(cfg.micro_batch_tokens, device.type, *self.shapes)):
                scale = 0.0 if weightless else weight * self.ranks.grad_scale
                packed = pack([batch.prompt_ids[i] for i in micro], [batch.response_ids[i] for i in micro], self.pad_id, device)

                def forward_context(module, rows=len(micro), length=packed.input_ids.shape[1]):
                    return training_forward(module, device, bf16, rows=rows, length=length)

                width = packed.response_mask.shape[1]

                def take(t: torch.Tensor, rows=micro, width=width) -> torch.Tensor:
                    return t[rows, :width].to(device)

                m = packed.response_mask & take(batch.response_mask)  # the tokens in the loss: a tool's are not

                if policy is not None:
                    shared_rows = ([batch.prompt_ids[i] for i in micro], [batch.response_ids[i] for i in micro]) if share_prompts else None
                    self._policy_backward(batch, packed, m, shared_rows, take, norms, weight, scale, tokens, forward_context, stats, bonus)
                if self.critic is not None:
                    with forward_context(self.critic.lm):
                        values = self.critic(packed)
                    vf, _ = clipped_value_loss(
                        values=values.float(), old_values=take(batch.old_values), returns=take(batch.returns), response_mask=m,
                        cliprange_value=cfg.cliprange_value,
                    )
                    vf_loss = aggregate(loss=vf, response_mask=m, mode=cfg.loss_agg_mode, **norms)
                    (cfg.vf_coef * vf_loss * scale).backward()
                    stats["vf_loss"] += weight * float(vf_loss.detach())
        stats = self.ranks.sum(stats)
        if policy is not None:  # the same on every rank, so not summed: the share of optimizer steps whose passes ran
            # each prompt once, and the share of the mini-batch's rows left out for a zero advantage (metrics)
            stats["prompt_sharing"] = float(share_prompts)
            stats["zero_advantage_skipped"] = (len(in_loss) - (0 if weightless else len(trained))) / len(indices)
            if cfg.entropy_target:
                stats["entropy_coef_applied"] = bonus  # update.entropy_target: the coefficient this step's loss took
        return stats

    def _policy_backward(
        self, batch: TrainBatch, packed, m: torch.Tensor, shared_rows: tuple[list, list] | None, take, norms: dict, weight: float, scale: float,
        tokens: int, forward_context, stats: dict, entropy_bonus: float,
    ) -> None:
        """One micro-batch's policy loss, its backward, and its share of the statistics; the
        forward runs in `forward_context(module)` (`training_forward`), the loss and backward
        outside. With `shared_rows` (prompts, responses: GRPO's groups) each distinct prompt's
        forward runs once (`forward_sharing_prompts`), its gradients summed over its rows."""
        cfg = self.cfg
        with forward_context(self.policy.model):
            if shared_rows is not None:
                logp, entropy = self.policy.forward_sharing_prompts(*shared_rows, temperature=self.temperature, statistic="entropy")
            else:
                logp, entropy = self.policy.forward(packed, temperature=self.temperature, statistic="entropy")
        old = take(batch.old_logprobs) if batch.old_logprobs is not None else logp.detach().float()
        if batch.old_logprobs is None and batch.rollout_logprobs is not None:
            stats["logprob_mismatch"] += weight * float(torch.where(m, (old - take(batch.rollout_logprobs)).abs(), 0).sum()) / tokens
        loss_settings = {  # the settings only one policy loss takes
            "kl_cov": {"kl_cov_ratio": cfg.kl_cov_ratio, "kl_cov_coef": cfg.kl_cov_coef},
            "clip_cov": {"clip_cov_ratio": cfg.clip_cov_ratio, "clip_cov_lb": cfg.clip_cov_lb, "clip_cov_ub": cfg.clip_cov_ub},
            "sapo": {"sapo_tau_pos": cfg.sapo_tau_pos, "sapo_tau_neg": cfg.sapo_tau_neg},
            "vespo": {"vespo_k_pos": cfg.vespo_k_pos, "vespo_lambda_pos": cfg.vespo_lambda_pos, "vespo_k_neg": cfg.vespo_k_neg, "vespo_lambda_neg": cfg.vespo_lambda_neg},
        }.get(cfg.policy_loss, {})
        advantages = take(batch.advantages)
        if cfg.entropy_advantage:
            shaped = entropy_shaped_advantages(advantages, entropy, alpha=cfg.entropy_advantage, kappa=cfg.entropy_advantage_kappa)
            stats["entropy_advantage"] += weight * float(torch.where(m, shaped - advantages, 0).sum()) / tokens
            advantages = shaped
        weights = None
        if cfg.rollout_is != "off":
            weights = rollout_is_weights(
                old_logprobs=old, rollout_logprobs=take(batch.rollout_logprobs), response_mask=m,
                level=cfg.rollout_is, threshold=cfg.rollout_is_threshold,
            ) * batch.rollout_is_scale
            stats["rollout_is_weight"] += weight * float(torch.where(m, weights, 0).sum()) / tokens
            if cfg.policy_loss == "vespo":  # VESPO folds the correction into each sequence's importance weight instead
                loss_settings["behaviour_log_weight"] = sequence_log_weights(weights, m, cfg.rollout_is)
                weights = None
        pg = POLICY_LOSSES[cfg.policy_loss](
            logprobs=logp, old_logprobs=old, advantages=advantages, response_mask=m,
            clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high, clip_ratio_c=cfg.clip_ratio_c, **loss_settings,
        )
        token_loss = pg.loss
        if cfg.top_entropy_quantile < 1.0:  # the policy gradient of the pass's high-entropy tokens only; the divisors stay the mini-batch's
            kept = high_entropy_tokens(entropy, m, cfg.top_entropy_quantile)
            token_loss = torch.where(kept, token_loss, 0)
            stats["entropy_tokens_kept"] += weight * float(kept.sum()) / tokens
        if cfg.off_policy_mask:  # the engine's log-probs where the batch has them: they measure the drift of the update and of the engine alike
            behaviour = take(batch.rollout_logprobs) if batch.rollout_logprobs is not None else old
            on_policy = off_policy_sequences(logprobs=logp, behaviour_logprobs=behaviour, advantages=advantages, response_mask=m, threshold=cfg.off_policy_mask)
            token_loss = torch.where(on_policy, token_loss, 0)
            stats["off_policy_masked"] += weight * float((m & ~on_policy).sum()) / tokens
        if weights is not None:
            token_loss = token_loss * weights
        if pg.weight is not None:
            stats["vespo_weight"] += weight * float((pg.weight.squeeze(-1) * m.sum(-1)).sum()) / tokens
        pg_loss = aggregate(loss=token_loss, response_mask=m, mode=cfg.loss_agg_mode, **norms)
        loss = pg_loss
        if entropy_bonus:  # a bonus of 0 stays out of the graph: no backward through the entropy's [tokens, V] softmax work
            loss = loss - entropy_bonus * aggregate(loss=entropy, response_mask=m, mode=cfg.loss_agg_mode, **norms)
        if batch.ref_logprobs is not None:
            kl = KL_ESTIMATORS.get(cfg.kl_loss_estimator)(logprobs=logp, ref_logprobs=take(batch.ref_logprobs))
            if cfg.use_kl_loss:
                term = kl * importance_ratio(logp, old) if cfg.kl_loss_unbiased else kl
                loss = loss + cfg.kl_loss_coef * aggregate(loss=term, response_mask=m, mode=cfg.loss_agg_mode, **norms)
            stats["kl"] += weight * float(torch.where(m, kl.detach(), 0).sum()) / tokens
        (loss * scale).backward()
        stats["pg_loss"] += weight * float(pg_loss.detach())
        stats["pg_clipfrac"] += weight * float(pg.clipped.sum()) / tokens
        stats["pg_clipfrac_lower"] += weight * float(pg.dual_clipped.sum()) / tokens
        stats["ppo_kl"] += weight * float(pg.approx_kl.detach().sum()) / tokens
        if "approx_kl" in stats:  # update.target_kl's measure: k3 of the old policy to this one, ≥ 0 per token
            k1 = pg.approx_kl.detach()  # log p_old − log p, 0 off the loss's tokens (so is k3 there)
            stats["approx_kl"] += weight * float((torch.expm1(-k1) + k1).sum()) / tokens
        stats["entropy"] += weight * float(torch.where(m, entropy.detach(), 0).sum()) / tokens

    def policy_trains(self) -> bool:
        """Whether the coming optimizer step moves the policy: not during the critic's warm-up
        (`update.critic_warmup`: the first optimizer steps train only the critic)."""
        return self.policy is not None and self.step >= self.cfg.critic_warmup

    def _optimizer_step(self) -> dict[str, float]:
        stats: dict[str, float] = {}
        if self.policy is not None and self.cfg.critic_warmup:
            stats["critic_warmup"] = 0.0 if self.policy_trains() else 1.0  # the share of the update's steps the policy sat out
        if self.optimizer is not None and self.policy_trains():
            lr = self.lr_at(self.step)
            stats["grad_norm"] = grad_norm = clip_gradients(trainable(self.policy.model), self.cfg.max_grad_norm)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            if math.isfinite(grad_norm):  # a non-finite gradient would poison the weights: skip
                self.optimizer.step()
            else:
                stats["skipped_steps"] = 1.0
        if self.critic_optimizer is not None:
            stats["vf_grad_norm"] = clip_gradients(self.critic.parameters(), self.cfg.max_grad_norm)
            if math.isfinite(stats["vf_grad_norm"]):
                self.critic_optimizer.step()
            else:
                stats["vf_skipped_steps"] = 1.0
        self.step += 1
        return stats


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters an update changes: all of them, or a LoRA run's adapters."""
    return [p for p in model.parameters() if p.requires_grad]


def clip_gradients(parameters, max_norm: float) -> float:
    """Clip the gradients to a global norm of `max_norm` (0: no clip); their norm before."""
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return 0.0
    limit = max_norm if max_norm > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, limit)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor under FSDP


def flat_gradients(model: torch.nn.Module) -> np.ndarray:
    """All parameter gradients as one float64 vector (for tests and debugging)."""
    return torch.cat([p.grad.detach().double().reshape(-1) for p in model.parameters() if p.grad is not None]).numpy()
