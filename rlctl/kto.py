"""Kahneman-Tversky optimization (`rlctl kto`): the policy trained on responses each labelled
desirable or undesirable, with no pairs, no reward model and no sampling, against its own
starting weights as the reference (Ethayarajh et al., 2024; TRL's KTOTrainer, OpenRLHF's
train_kto).

An example is a prompt with one response and a boolean `label` (true: desirable), read as
`rlctl sft` reads a prompt and its response; preference pairs (chosen/rejected columns, as
`rlctl dpo` reads them) are taken as two examples each, the chosen one desirable. With
r = log π(y|x) − log π_ref(y|x) (sums over the response's trained tokens) and β = `kto.beta`,

    desirable    λ_D · (1 − σ(β·(r − z)))
    undesirable  λ_U · (1 − σ(β·(z − r)))

the mean over each optimizer step's examples, λ_D, λ_U = `kto.desirable_weight`,
`kto.undesirable_weight`. z, the reference point, estimates KL(π ‖ π_ref) from mismatched
pairs: each example's prompt with another example's response (a seeded derangement, fixed for
the run), z = max(0, mean over the step's examples of log π(y'|x) − log π_ref(y'|x)), computed
without a gradient before the step's passes (the paper's; TRL estimates it per micro-batch).
The reference's log-probabilities, of the responses and of the mismatched ones, are computed
once before the first step with the starting weights: no second model is held. With
`kto.ref_sync_every` the reference moves towards the policy every N optimizer steps (TR-KTO,
rlctl.moving_reference) and both are computed again after each move (held-out examples are
measured against the starting weights throughout, as `--eval` measures). β·r is an
example's implicit reward; each epoch reports the mean over the desirable examples, over the
undesirable ones, their difference (`margin`) and z (`kl`). `kto.loss = "apo_zero_unpaired"`
(APO-zero on single responses; TRL's loss_type) is λ_D·(1 − σ(β·r)) and λ_U·σ(β·r) instead,
with no reference point: no mismatched pairs are computed, and `kl` is 0.

It trains in this process or on a Ray group of FSDP2 ranks (`workers.backend = "ray"`), as
`rlctl dpo` does, and resumes from its epoch checkpoints; the output is a checkpoint folder
like dpo's."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

import pyarrow as pa
import torch

from rlctl.config import Config, DataConfig, KtoConfig
from rlctl.errors import InputError
from rlctl.manifest import Manifest
from rlctl.moving_reference import ReferenceSyncs
from rlctl.referenced import LocalReferenced, RayReferenced, ReferencedCommand
from rlctl.sft import Examples
from rlctl.supervised import SupervisedSteps

# --- examples ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class KtoExamples:
    """Each example's prompt and response as tokens, whether it is desirable, whose response
    follows its prompt in its mismatched pair (`partner`), and the reference's log-probabilities
    of both sequences (empty until computed)."""

    examples: Examples
    desirable: list[bool]
    partner: list[int]
    ref: list[float] = field(default_factory=list)
    ref_mismatched: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.examples)

    def reference_values(self) -> torch.Tensor:
        """The reference's log-probabilities [2, examples]: the responses', the mismatched ones'."""
        return torch.tensor([self.ref, self.ref_mismatched], dtype=torch.float64)

    def with_reference_values(self, values: torch.Tensor) -> KtoExamples:
        return replace(self, ref=values[0].tolist(), ref_mismatched=values[1].tolist())

    def refresh_reference_values(self, values: torch.Tensor) -> None:
        """The reference's log-probabilities replaced in place, after the reference moved
        (rlctl.moving_reference): whoever holds these examples sees the new ones."""
        self.ref[:], self.ref_mismatched[:] = values[0].tolist(), values[1].tolist()

    @property
    def ids(self) -> list[str]:
        return self.examples.ids

    @cached_property
    def mismatched(self) -> Examples:
        """Each example's prompt followed by its partner's response (trained tokens: the partner's)."""
        ex, partner = self.examples, self.partner
        return Examples(
            ex.ids, ex.prompt_ids, [ex.response_ids[j] for j in partner], None if ex.trained is None else [ex.trained[j] for j in partner],
        )


def mismatched_partners(count: int, seed: int) -> list[int]:
    """A derangement of `count` examples, seeded: example i's prompt meets response partner[i] ≠ i."""
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()
    partner = [0] * count
    for k, row in enumerate(order):
        partner[row] = order[(k + 1) % count]
    return partner


def split_labelled(table: pa.Table, source: str) -> tuple[list[str], list[str | None], list[list[dict] | None], list, list[bool]]:
    """(ids, plain prompts, chat contexts, responses, desirable) of every example: rows with a
    `label`, or preference pairs taken as a desirable and an undesirable example each."""
    from rlctl.reward_model import pair_ids, split_pairs
    from rlctl.sft import split_examples

    names = table.column_names
    ids = pair_ids(table)
    if "chosen" in names or "rejected" in names:
        split = split_pairs(table, source)
        out: tuple[list, list, list, list, list] = ([], [], [], [], [])
        for pair_id, (prompt, chat, chosen, rejected) in zip(ids, split):
            for side, response, good in (("chosen", chosen, True), ("rejected", rejected, False)):
                for column, value in zip(out, (f"{pair_id}:{side}", prompt, chat, response, good)):
                    column.append(value)
        return out
    if "label" not in names:
        raise InputError(f"{source}: KTO examples need a 'label' column (true: desirable, false: undesirable), or 'chosen' and 'rejected' columns")
    labels = table.column("label").to_pylist()
    for example, label in zip(ids, labels):
        if not isinstance(label, bool):
            raise InputError(f"{source}: example {example!r} has label {label!r}: it must be true (desirable) or false (undesirable)")
    if "id" not in names:
        table = table.append_column("id", pa.array(ids, pa.string()))
    prompts, contexts, responses = split_examples(table, source)
    return ids, prompts, contexts, responses, labels


def encode_kto_examples(
    table: pa.Table, tokenizer, data: DataConfig, cfg: KtoConfig, *, end_ids: Sequence[int], context_length: int | None, source: str,
) -> KtoExamples:
    """Every example as tokens (as `rlctl sft` reads them; one empty or too long is one error
    naming it), its label, and its partner in the mismatched pairs. Scored rollouts are each
    prompt's best sample (desirable) and worst (undesirable), in their sampled tokens."""
    from rlctl.scored_pairs import best_and_worst, is_scored
    from rlctl.sft import examples_of, fitted_examples

    if is_scored(table):
        scored = best_and_worst(table, min_gap=cfg.min_reward_gap, source=source)
        ids = [f"{pair.id}:{side}" for pair in scored for side in ("chosen", "rejected")]
        examples = fitted_examples(
            ids, [pair.prompt_ids for pair in scored for _ in range(2)], [side for pair in scored for side in (pair.chosen, pair.rejected)],
            max_tokens=cfg.max_tokens, truncate=cfg.truncate, context_length=context_length, source=source, setting="kto",
        )
        return KtoExamples(examples, [good for _ in scored for good in (True, False)], mismatched_partners(len(ids), cfg.seed))
    ids, prompts, contexts, responses, desirable = split_labelled(table, source)
    if len(ids) < 2:
        raise InputError(f"{source}: KTO needs at least 2 examples (its reference point pairs each prompt with another example's response)")
    examples = examples_of(
        ids, prompts, contexts, responses, tokenizer, data, max_tokens=cfg.max_tokens, truncate=cfg.truncate, end_ids=end_ids,
        context_length=context_length, source=source, setting="kto",
    )
    return KtoExamples(examples, desirable, mismatched_partners(len(ids), cfg.seed))


# --- the loss ---------------------------------------------------------------------------------


def kto_losses(
    logratio: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor | float, *, beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
    loss: str = "kto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(each example's loss, its implicit reward β·r) from r = log π − log π_ref [N], whether it
    is desirable [N] and the reference point z (which "apo_zero_unpaired", APO-zero on single
    responses, does without: a desirable response's log-ratio pushed up, an undesirable one's down)."""
    if loss == "kto":
        chosen = desirable_weight * (1 - torch.sigmoid(beta * (logratio - kl)))
        rejected = undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratio)))
    elif loss == "apo_zero_unpaired":  # D'Oosterlinck et al., eq. 7 with each response on its own (TRL's KTO loss_type)
        chosen = desirable_weight * (1 - torch.sigmoid(beta * logratio))
        rejected = undesirable_weight * torch.sigmoid(beta * logratio)
    else:
        raise ValueError(f"unknown KTO loss {loss!r}")
    return torch.where(desirable, chosen, rejected), (beta * logratio).detach()


@dataclass
class KtoSums:
    """Sums over examples: the loss, how many of each label, their implicit rewards, and the
    reference point z weighted by the examples it was estimated for."""

    loss: float = 0.0
    desirable: float = 0.0
    undesirable: float = 0.0
    desirable_reward: float = 0.0
    undesirable_reward: float = 0.0
    kl: float = 0.0

    def add(self, other: KtoSums) -> None:
        for key, value in vars(other).items():
            setattr(self, key, getattr(self, key) + value)


@dataclass
class EpochRow:
    """One epoch's figures, as the passes met the examples (the weights moving): the mean loss,
    the reference point z (`kl`), the mean implicit reward of the desirable and of the
    undesirable examples and their difference (`margin`); the held-out examples' loss and
    margin after the epoch."""

    epoch: int
    loss: float | None = None
    kl: float | None = None
    desirable_reward: float | None = None
    undesirable_reward: float | None = None
    margin: float | None = None
    val_loss: float | None = None
    val_margin: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    steps: int = 0
    examples: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        row = {k: v for k, v in self.__dict__.items() if v is not None and (self.steps or k in ("epoch", "val_loss", "val_margin"))}
        if self.seconds:
            row["examples_per_s"] = self.examples / self.seconds
        return row

    @classmethod
    def of_sums(cls, epoch: int, sums: dict, **more) -> EpochRow:
        """A row's figures from sums over its examples."""
        n = sums["desirable"] + sums["undesirable"]
        good = sums["desirable_reward"] / sums["desirable"] if sums["desirable"] else None
        bad = sums["undesirable_reward"] / sums["undesirable"] if sums["undesirable"] else None
        margin = good - bad if good is not None and bad is not None else None
        return cls(epoch, loss=sums["loss"] / n, kl=sums["kl"] / n, desirable_reward=good, undesirable_reward=bad, margin=margin, **more)


# --- training ---------------------------------------------------------------------------------


class KtoPasses:
    """The policy's passes over examples, of similar lengths capped by `micro_batch_size` and
    `micro_batch_tokens`: the reference's log-probabilities, the reference point over a set of
    examples, and the loss and rewards under `cfg`. On a group of FSDP2 ranks (`ranks`) each
    rank takes its share, and the sums are the group's."""

    def __init__(self, policy, cfg: KtoConfig, *, bf16: bool, ranks=None) -> None:
        from rlctl.backends.hf import held_whole
        from rlctl.trainer import ALONE

        self.policy, self.cfg, self.bf16, self.ranks = policy, cfg, bf16, ranks or ALONE
        self.weights_whole = held_whole(policy.model)

    def with_reference(self, examples: KtoExamples) -> KtoExamples:
        """`examples` with the current weights' log-probabilities as the reference's, of each
        response and each mismatched one (before training), every rank getting all of them."""
        if examples.ref:  # computed already: a resumed run's, from its epoch checkpoint
            return examples
        return examples.with_reference_values(self.reference_values(examples))

    @torch.no_grad()
    def reference_values(self, examples: KtoExamples) -> torch.Tensor:
        """The current weights' log-probabilities [2, examples] of each response and each
        mismatched one (0 for a loss without a reference point), each rank computing its share,
        every rank getting all of them."""
        values = torch.zeros(2, len(examples), dtype=torch.float64)
        everyone = list(range(len(examples)))
        sides = (examples.examples, examples.mismatched) if self.cfg.loss == "kto" else (examples.examples,)  # no reference point: no mismatched pairs
        for side, sequences in enumerate(sides):
            for micro, weight, logps in self._logps(sequences, everyone):
                if weight:
                    values[side, micro] = logps.double().cpu()
        return self.ranks.sum_tensor(values)

    @torch.no_grad()
    def reference_point(self, examples: KtoExamples, rows: list[int]) -> float:
        """z over `rows`: max(0, the mean of log π − log π_ref over their mismatched pairs); 0
        without a forward for a loss that has no reference point."""
        if self.cfg.loss != "kto":
            return 0.0
        total = 0.0
        for micro, weight, logps in self._logps(examples.mismatched, rows):
            total += weight * float((logps.double().cpu() - torch.tensor([examples.ref_mismatched[i] for i in micro], dtype=torch.float64)).sum())
        return max(0.0, self.ranks.sum({"kl": total})["kl"] / len(rows))

    @torch.no_grad()
    def evaluate(self, examples: KtoExamples) -> tuple[float, float | None]:
        """(mean loss, margin) of `examples` under the current weights."""
        rows = list(range(len(examples)))
        row = EpochRow.of_sums(0, vars(self.passes(examples, rows, self.reference_point(examples, rows), None)))
        return row.loss, row.margin

    def passes(self, examples: KtoExamples, rows: list[int], kl: float, backward: Callable[[torch.Tensor], None] | None) -> KtoSums:
        """Sums over `rows` (over every rank) at the reference point `kl`; `backward(summed
        loss)` after each pass, scaled so that FSDP's average over ranks is the sum."""
        if not examples.ref:
            raise ValueError("the reference's log-probabilities are not computed yet (with_reference)")
        sums, cfg = KtoSums(), self.cfg
        for micro, weight, logps in self._logps(examples.examples, rows, backward is not None):  # weight 0: a rank's empty pass, run to keep FSDP's collectives in step
            ref = torch.tensor([examples.ref[i] for i in micro], device=logps.device)
            desirable = torch.tensor([examples.desirable[i] for i in micro], device=logps.device)
            losses, rewards = kto_losses(
                logps - ref, desirable, kl, beta=cfg.beta, desirable_weight=cfg.desirable_weight, undesirable_weight=cfg.undesirable_weight, loss=cfg.loss,
            )
            summed = losses.sum()
            if backward is not None:
                backward(summed * (weight * self.ranks.grad_scale))
            good = desirable.double().cpu()
            sums.add(KtoSums(
                weight * float(summed.detach()), weight * float(good.sum()), weight * float((1 - good).sum()),
                weight * float((rewards.double().cpu() * good).sum()), weight * float((rewards.double().cpu() * (1 - good)).sum()), weight * kl * len(micro),
            ))
        return KtoSums(**self.ranks.sum(vars(sums)))

    def _logps(self, sequences: Examples, rows: list[int], grad: bool = False):
        """(rows, weight, each row's summed log-probability over its trained response tokens [B])
        of each pass of this rank over `rows` (weight 0: a rank's empty pass, run on one row to
        keep FSDP's collectives in step)."""
        from rlctl.backends.hf import casts_kept, pack, training_forward
        from rlctl.sft import trained_mask

        policy = self.policy
        passes = self.ranks.micro_batches(torch.tensor(rows), self.cfg.micro_batch_size, sequences.lengths, None, int(self.cfg.micro_batch_tokens))
        with casts_kept(policy.device, self.bf16 and self.weights_whole), torch.set_grad_enabled(grad):  # each weight cast to bf16 once for all the passes
            for micro, weight in passes:
                packed = pack([sequences.prompt_ids[i] for i in micro], [sequences.response_ids[i] for i in micro], policy.pad_id, policy.device)
                with training_forward(policy.model, policy.device, self.bf16, rows=len(micro), length=packed.input_ids.shape[1]):
                    logp, _ = policy.forward(packed, temperature=1.0)
                summed = torch.where(trained_mask(packed.response_mask, sequences, micro), logp.float(), 0).sum(-1)
                yield micro, weight, summed


class KtoTrainer(ReferenceSyncs, SupervisedSteps, KtoPasses):
    """AdamW on the policy (or its LoRA adapters), an optimizer step per `batch_size` examples:
    the step's reference point first, then its passes; with `kto.ref_sync_every`, the reference
    moved towards the policy after every N-th step and its log-probabilities of the training
    examples and their mismatched pairs recomputed in place (ReferenceSyncs)."""

    def __init__(self, policy, cfg: KtoConfig, *, total_steps: int, ranks=None) -> None:
        from rlctl.trainer import ALONE

        SupervisedSteps.__init__(self, policy.model, cfg, device_type=policy.device.type, total_steps=total_steps, command="kto")
        self.policy, self.ranks = policy, ranks or ALONE
        self.start_moving_reference(policy.model, cfg)

    def train_epoch(self, examples: KtoExamples, epoch: int) -> EpochRow:
        return self.epoch_row(epoch, self.train_steps(examples, epoch))

    def train_steps(self, examples: KtoExamples, epoch: int, first: int = 0, last: int | None = None) -> dict:
        """Optimizer steps `first` to `last` of an epoch: SupervisedSteps' tally with the examples' sums."""
        self.training, sums = examples, KtoSums()

        def passes(rows: list[int]) -> None:
            kl = self.reference_point(examples, rows)
            sums.add(self.passes(examples, rows, kl, lambda summed: (summed / len(rows)).backward()))  # the step's mean

        return {**self.run_steps(len(examples), epoch, passes, first, last), **vars(sums)}

    @staticmethod
    def epoch_row(epoch: int, tally: dict) -> EpochRow:
        """An epoch's row from the tally of all its steps."""
        return EpochRow.of_sums(epoch, tally, grad_norm=tally["norm_sum"] / tally["steps"], lr=tally["lr"], steps=tally["steps"], examples=tally["rows"], seconds=tally["seconds"])


# --- where it trains: this process, or a Ray group of FSDP2 ranks ------------------------------


class LocalKto(LocalReferenced):
    trainer_class = KtoTrainer


class RayKto(RayReferenced):
    command = "kto"


# --- measuring a trained policy on held-out examples --------------------------------------------


@dataclass(frozen=True)
class EvalRow:
    """A policy against its reference on a set of examples (`rlctl kto --eval`): the loss, the
    reference point z over them, the mean implicit reward of the desirable and of the
    undesirable ones (None where there are none) and their difference."""

    source: str  # a data_source, or "all"
    examples: int
    loss: float
    kl: float
    desirable_reward: float | None
    undesirable_reward: float | None
    margin: float | None


def example_sources(table: pa.Table, cfg: KtoConfig, source: str) -> list[str | None]:
    """The data_source of each example, in the order encode_kto_examples makes them (a pair, or
    a prompt's best and worst scored samples: two)."""
    from rlctl.reward_model import pair_ids
    from rlctl.scored_pairs import best_and_worst, is_scored

    sources = table.column("data_source").to_pylist() if "data_source" in table.column_names else [None] * table.num_rows
    if is_scored(table):
        named = dict(zip(pair_ids(table), sources))
        return [named[pair.id] for pair in best_and_worst(table, min_gap=cfg.min_reward_gap, source=source) for _ in range(2)]
    pairs = "chosen" in table.column_names or "rejected" in table.column_names
    return [name for name in sources for _ in range(2 if pairs else 1)]


def evaluate(*, data: str, model: str, cfg: Config, ref: str | None = None, device: str = "auto") -> list[EvalRow]:
    """The policy at `model` against the reference at `ref` (by default the one a kto checkpoint
    was trained against) on the examples at `data`, read as training reads them, under `cfg.kto`:
    one row over every example ("all"), then one per data_source where they name several."""
    from rlctl.referenced import measured_against_reference

    examples, measuring, table = measured_against_reference(COMMAND, KtoPasses, data=data, model=model, cfg=cfg, ref=ref, device=device)
    groups: dict[str, list[int]] = {"all": list(range(len(examples)))}
    for index, name in enumerate(example_sources(table, cfg.kto, data)):
        groups.setdefault(str(name or "unknown"), []).append(index)
    if len(groups) == 2:  # one data_source: the same row twice
        groups = {"all": groups["all"]}
    rows = []
    with torch.no_grad():
        for name, members in groups.items():
            kl = measuring.reference_point(examples, members)
            row = EpochRow.of_sums(0, vars(measuring.passes(examples, members, kl, None)))
            rows.append(EvalRow(name, len(members), row.loss, row.kl, row.desirable_reward, row.undesirable_reward, row.margin))
    return rows


# --- the command ------------------------------------------------------------------------------


def run(
    *, data: str, model: str, out: str, cfg: Config, val_data: str | None = None, device: str = "auto", force: bool = False,
    report: Callable[[dict], None] | None = None,
) -> Manifest:
    """Train the policy at `model` on the labelled examples at `data` (`cfg.kto`) and commit the
    checkpoint at `out` (rlctl.referenced.train_against_reference)."""
    from rlctl.referenced import train_against_reference

    return train_against_reference(COMMAND, data=data, model=model, out=out, cfg=cfg, val_data=val_data, device=device, force=force, report=report)


COMMAND = ReferencedCommand(
    "kto", "examples", encode_kto_examples, LocalKto, RayKto, KtoTrainer, EpochRow, ("val_loss", "val_margin"),
    ("loss", "kl", "margin", "val_loss", "val_margin"), lambda examples: {"examples": len(examples), "desirable": sum(examples.desirable)},
)
