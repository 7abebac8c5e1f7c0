"""Direct preference optimization (`rlctl dpo`): the policy trained on preference pairs, without
a reward model or sampling, against its own starting weights as the reference (Rafailov et al.,
2023; TRL's DPOTrainer, OpenRLHF's train_dpo).

A pair is a prompt with a chosen and a rejected response, in the data `rlctl reward-model` reads
(`split_pairs`). The prompt becomes tokens as the rollout makes them and each response as the
rollout would sample it (`rlctl sft`'s reading: the chat template's assistant turn up to its
end token, the assistant's turns alone trained in a response of several). A response's
log-probability log π(y|x) is the sum over its trained tokens, and with

    h = (log π(y_c) − log π_ref(y_c)) − (log π(y_r) − log π_ref(y_r))

a pair's loss is, by `dpo.loss` (β = `dpo.beta`, ε = `dpo.label_smoothing`):

    sigmoid  −(1 − ε) log σ(β·h) − ε log σ(−β·h)              DPO; ε > 0: conservative DPO
    robust   (−(1 − ε) log σ(β·h) + ε log σ(−β·h)) / (1 − 2ε)   rDPO, unbiased under labels flipped at rate ε
    ipo      (h' − 1/(2β))², h' as h with per-token log-ratios  IPO
    hinge    max(0, 1 − β·h)                                    SLiC's hinge
    simpo    −(1 − ε) log σ(β·s) − ε log σ(−β·s)              SimPO: no reference,
             s = log π(y_c)/|y_c| − log π(y_r)/|y_r| − γ/β      per-token log-probs, γ = `dpo.simpo_gamma`
    orpo     −log π(y_c)/|y_c| − β log σ(o),                   ORPO: no reference, the chosen response's
             o = log odds(y_c) − log odds(y_r)                  NLL beside an odds-ratio term; odds(y) =
                                                                p/(1 − p), p = exp(log π(y)/|y|)

and TRL's further losses by their names (r_c, r_r: each response's log π − log π_ref):
`sigmoid_norm` (DPO on per-token log-ratios), `exo_pair` (EXO, ε > 0), `nca_pair`, `bco_pair`,
`sppo_hard`, `apo_zero`, `apo_down` and `discopop` (τ = `dpo.discopop_tau`); docs/algorithms.md
has each formula. `dpo.f_divergence` puts f'(π/π_ref) of another f-divergence in place of each
log-ratio (f-DPO), and `dpo.ld_alpha` < 1 weighs a side's tokens past its pair's shorter side's
length by it, in the policy's and the reference's log-probabilities alike (LD-DPO).
`dpo.use_weighting` multiplies each pair's loss by WPO's weights of its two responses.
`dpo.reference_free` takes the reference's log-probabilities as 0 (CPO's loss with sft_weight = 1).

plus, with `dpo.sft_weight` = α > 0, α·(−log π(y_c)/|y_c|), the chosen response's NLL per token
(RPO), the mean over each optimizer step's pairs. β·(log π − log π_ref) is a response's implicit
reward (SimPO's and ORPO's: β·log π/|y|): `accuracy` is the share of pairs whose chosen response has the
larger one, `margin` the mean difference. The reference's log-probabilities are computed once,
before the first step, with the starting weights (LoRA adapters start at B = 0, so the same
function): no second model is held, and SimPO and ORPO compute none. With `dpo.ref_sync_every`
the reference moves towards the policy every N optimizer steps (TR-DPO, rlctl.moving_reference)
and its log-probabilities of the training pairs are computed again after each move (held-out
pairs are measured against the starting weights throughout, as `--eval` measures).

It trains in this process or on a Ray group of FSDP2 ranks (`workers.backend = "ray"`), each
rank on its share of every step's pairs, as `rlctl sft` does. The output is a checkpoint folder
like sft's: weights (or a LoRA adapter) without trainer state, the epochs' figures in its
manifest."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import NamedTuple

import pyarrow as pa
import torch

from rlctl.algos.preference import desensitized_weights, dpo_losses, f_score, log1mexp, wpo_weights  # noqa: F401 (f_score, log1mexp: rlctl.dpo's API)
from rlctl.config import Config, DataConfig, DpoConfig
from rlctl.manifest import Manifest
from rlctl.moving_reference import ReferenceSyncs
from rlctl.referenced import LocalReferenced, RayReferenced, ReferencedCommand
from rlctl.reward_model import EpochRow as PairsEpochRow
from rlctl.reward_model import PairsRow
from rlctl.sft import Examples
from rlctl.supervised import SupervisedSteps

# --- pairs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DpoPairs:
    """Each pair's chosen and rejected side as examples (one prompt, two responses), and the
    reference's log-probabilities of each response (empty until computed)."""

    chosen: Examples
    rejected: Examples
    ref_chosen: list[float] = field(default_factory=list)
    ref_rejected: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.chosen)

    def reference_values(self) -> torch.Tensor:
        """The reference's log-probabilities [2, pairs]: the chosen responses', the rejected ones'."""
        return torch.tensor([self.ref_chosen, self.ref_rejected], dtype=torch.float64)

    def with_reference_values(self, values: torch.Tensor) -> DpoPairs:
        return replace(self, ref_chosen=values[0].tolist(), ref_rejected=values[1].tolist())

    def refresh_reference_values(self, values: torch.Tensor) -> None:
        """The reference's log-probabilities replaced in place, after the reference moved
        (rlctl.moving_reference): whoever holds these pairs sees the new ones."""
        self.ref_chosen[:], self.ref_rejected[:] = values[0].tolist(), values[1].tolist()

    @property
    def ids(self) -> list[str]:
        return self.chosen.ids

    @cached_property
    def lengths(self) -> list[int]:
        """A pair's tokens in a pass: both sides padded to the longer (so passes cap by tokens)."""
        return [2 * max(c, r) for c, r in zip(self.chosen.lengths, self.rejected.lengths)]


def encode_dpo_pairs(table: pa.Table, tokenizer, data: DataConfig, cfg: DpoConfig, *, end_ids: Sequence[int], context_length: int | None, source: str) -> DpoPairs:
    """Every pair's prompt and both responses as tokens; a side that is empty or too long is one
    error naming the pair (or, with `dpo.truncate = "right"`, its response cut). Scored rollouts
    are pairs of each prompt's best and worst sample (`dpo.scored_pairs = "all"`: of every two
    whose rewards differ), in their sampled tokens (rlctl.scored_pairs)."""
    from rlctl.reward_model import pair_ids, split_pairs
    from rlctl.scored_pairs import best_and_worst, is_scored
    from rlctl.sft import encoded_prompts, examples_of, fitted_examples

    if is_scored(table):
        scored = best_and_worst(table, min_gap=cfg.min_reward_gap, source=source, which=cfg.scored_pairs)
        ids, prompt_tokens = [pair.id for pair in scored], [pair.prompt_ids for pair in scored]

        def sampled(name: str) -> Examples:
            return fitted_examples(
                ids, prompt_tokens, [getattr(pair, name) for pair in scored], max_tokens=cfg.max_tokens, truncate=cfg.truncate,
                context_length=context_length, source=source, setting="dpo", noun=f"the {name} response of pair",
            )

        return DpoPairs(sampled("chosen"), sampled("rejected"))
    ids = pair_ids(table)
    split = split_pairs(table, source)
    prompts, chats = [p for p, _, _, _ in split], [c for _, c, _, _ in split]
    prompt_ids = encoded_prompts(ids, prompts, chats, tokenizer, data, context_length=context_length)  # the pair's one prompt, for both sides

    def side(index: int, name: str) -> Examples:
        return examples_of(
            ids, prompts, chats, [pair[index] for pair in split], tokenizer, data, max_tokens=cfg.max_tokens, truncate=cfg.truncate,
            end_ids=end_ids, context_length=context_length, source=source, setting="dpo", noun=f"the {name} response of pair", prompt_ids=prompt_ids,
        )

    return DpoPairs(side(2, "chosen"), side(3, "rejected"))


# --- figures (the losses: rlctl.algos.preference) ---------------------------------------------


@dataclass
class DpoSums:
    """Sums over pairs: the loss, the pairs ranked right, the implicit rewards."""

    loss: float = 0.0
    right: float = 0.0
    chosen_reward: float = 0.0
    rejected_reward: float = 0.0

    def add(self, other: DpoSums) -> None:
        for key, value in vars(other).items():
            setattr(self, key, getattr(self, key) + value)


@dataclass
class EpochRow(PairsEpochRow):
    """One epoch's figures as `rlctl reward-model`'s (the loss, the share of pairs whose chosen
    response has the larger implicit reward, `accuracy`, the mean chosen − rejected reward,
    `margin`), and each side's mean implicit reward."""

    chosen_reward: float | None = None
    rejected_reward: float | None = None


# --- training ---------------------------------------------------------------------------------


class DpoPasses:
    """The policy's passes over pairs, in passes of both sides of similar-length pairs: the
    reference's log-probabilities, and the loss, ranking and rewards under `cfg` (training's, or
    a measurement's). On a group of FSDP2 ranks (`ranks`) each rank takes its share, and the
    sums are the group's."""

    def __init__(self, policy, cfg: DpoConfig, *, bf16: bool, ranks=None) -> None:
        from rlctl.backends.hf import held_whole
        from rlctl.trainer import ALONE

        self.policy, self.cfg, self.bf16, self.ranks = policy, cfg, bf16, ranks or ALONE
        self.weights_whole = held_whole(policy.model)

    @torch.no_grad()
    def with_reference(self, pairs: DpoPairs) -> DpoPairs:
        """`pairs` with the current weights' log-probabilities as the reference's (before training),
        each rank computing its share, every rank getting all of them; zeros for a loss without
        a reference, or with dpo.reference_free (no forward)."""
        if pairs.ref_chosen:  # computed already: a resumed run's, from its epoch checkpoint
            return pairs
        if not self.cfg.has_reference:
            return pairs.with_reference_values(torch.zeros(2, len(pairs), dtype=torch.float64))
        return pairs.with_reference_values(self.reference_values(pairs))

    @torch.no_grad()
    def reference_values(self, pairs: DpoPairs) -> torch.Tensor:
        """The current weights' log-probabilities of each pair's responses [2, pairs] (chosen,
        rejected), each rank computing its share, every rank getting all of them."""
        from rlctl.backends.hf import casts_kept

        values = torch.zeros(2, len(pairs), dtype=torch.float64)
        with casts_kept(self.policy.device, self.bf16 and self.weights_whole):  # each weight cast to bf16 once for all the passes
            for micro, weight in self._passes_of(pairs, list(range(len(pairs)))):
                chosen, rejected, _, _ = self._logps(pairs, micro)
                if weight:
                    values[0, micro], values[1, micro] = chosen.double().cpu(), rejected.double().cpu()
        return self.ranks.sum_tensor(values)

    @torch.no_grad()
    def evaluate(self, pairs: DpoPairs) -> tuple[float, float]:
        """(mean loss, accuracy) of `pairs` under the current weights."""
        sums = self.passes(pairs, list(range(len(pairs))), None)
        return sums.loss / len(pairs), sums.right / len(pairs)

    def passes(self, pairs: DpoPairs, rows: list[int], backward: Callable[[torch.Tensor], None] | None) -> DpoSums:
        """Sums over `rows` (over every rank); `backward(summed loss)` after each pass, scaled so
        that FSDP's average over ranks is the sum."""
        from rlctl.backends.hf import casts_kept

        if not pairs.ref_chosen:
            raise ValueError("the reference's log-probabilities are not computed yet (with_reference)")
        sums, cfg = DpoSums(), self.cfg
        with casts_kept(self.policy.device, self.bf16 and self.weights_whole):  # each weight cast to bf16 once for all the passes
            for micro, weight in self._passes_of(pairs, rows):  # weight 0: a rank's empty pass, run to keep FSDP's collectives in step
                chosen, rejected, chosen_plain, pair_weight = self._logps(pairs, micro, weighing=cfg.use_weighting)
                ref_chosen, ref_rejected = (torch.tensor([values[i] for i in micro], device=chosen.device) for values in (pairs.ref_chosen, pairs.ref_rejected))
                chosen_tokens, rejected_tokens = (torch.tensor([side.trained_tokens(i) for i in micro], device=chosen.device) for side in (pairs.chosen, pairs.rejected))
                losses, chosen_reward, rejected_reward = dpo_losses(
                    chosen, rejected, ref_chosen, ref_rejected, beta=cfg.beta, loss=cfg.loss, label_smoothing=cfg.label_smoothing,
                    chosen_tokens=chosen_tokens, rejected_tokens=rejected_tokens, simpo_gamma=cfg.simpo_gamma, sft_weight=cfg.sft_weight,
                    discopop_tau=cfg.discopop_tau, f_divergence=cfg.f_divergence, f_alpha=cfg.f_alpha, chosen_plain=chosen_plain,
                    loss_weights=cfg.loss_weights,
                )
                if pair_weight is not None:  # WPO: each pair's loss as if its responses were sampled from the policy
                    losses = losses * pair_weight
                summed = losses.sum()
                if backward is not None:
                    backward(summed * (weight * self.ranks.grad_scale))
                sums.add(DpoSums(
                    weight * float(summed.detach()), weight * float((chosen_reward > rejected_reward).sum()),
                    weight * float(chosen_reward.sum()), weight * float(rejected_reward.sum()),
                ))
        return DpoSums(**self.ranks.sum(vars(sums)))

    def _passes_of(self, pairs: DpoPairs, rows: list[int]) -> list[tuple[list[int], float]]:
        return self.ranks.micro_batches(torch.tensor(rows), self.cfg.micro_batch_size, pairs.lengths, None, int(self.cfg.micro_batch_tokens))

    def _logps(self, pairs: DpoPairs, micro: list[int], *, weighing: bool = False) -> PairLogps:
        """Each pair's chosen and rejected response's summed log-probability over its trained
        tokens, both sides in one forward (with `dpo.ld_alpha` below 1, the tokens past the
        shorter side's length weighted by it: `desensitized_weights`), the chosen side's plain
        sum (its NLL's), and with `weighing` (dpo.use_weighting) WPO's weight of each pair."""
        from rlctl.backends.hf import pack, training_forward
        from rlctl.sft import trained_mask

        policy, count = self.policy, len(micro)
        prompts = [pairs.chosen.prompt_ids[i] for i in micro]
        responses = [pairs.chosen.response_ids[i] for i in micro] + [pairs.rejected.response_ids[i] for i in micro]
        packed = pack(prompts + prompts, responses, policy.pad_id, policy.device)
        with training_forward(policy.model, policy.device, self.bf16, rows=2 * count, length=packed.input_ids.shape[1]):
            logp, sum_pi_squared = policy.forward(packed, temperature=1.0, statistic="sum_pi_squared" if weighing else None)
        counted = torch.cat([
            trained_mask(packed.response_mask[:count], pairs.chosen, micro), trained_mask(packed.response_mask[count:], pairs.rejected, micro),
        ])
        plain = torch.where(counted, logp.float(), 0)
        summed = plain.sum(-1) if self.cfg.ld_alpha == 1 else (plain * desensitized_weights(counted, self.cfg.ld_alpha)).sum(-1)
        pair_weight = None
        if weighing:
            side_weight = wpo_weights(logp.detach().float(), sum_pi_squared.detach().float(), counted)
            pair_weight = side_weight[:count] * side_weight[count:]
        return PairLogps(summed[:count], summed[count:], plain[:count].sum(-1), pair_weight)


class PairLogps(NamedTuple):
    """A pass's log-probabilities of its pairs [P] each (rlctl.dpo.DpoPasses._logps)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_plain: torch.Tensor  # the chosen side's plain sum, where `chosen` is LD-DPO's weighted one
    pair_weight: torch.Tensor | None  # WPO's weight of each pair (dpo.use_weighting), or None


class DpoTrainer(ReferenceSyncs, SupervisedSteps, DpoPasses):
    """AdamW on the policy (or its LoRA adapters), an optimizer step per `batch_size` pairs,
    each accumulated over DpoPasses' passes; with `dpo.ref_sync_every`, the reference moved
    towards the policy after every N-th step and its log-probabilities of the training pairs
    recomputed in place (ReferenceSyncs)."""

    def __init__(self, policy, cfg: DpoConfig, *, total_steps: int, ranks=None) -> None:
        from rlctl.trainer import ALONE

        SupervisedSteps.__init__(self, policy.model, cfg, device_type=policy.device.type, total_steps=total_steps, command="dpo")
        self.policy, self.ranks = policy, ranks or ALONE
        self.start_moving_reference(policy.model, cfg)

    def train_epoch(self, pairs: DpoPairs, epoch: int) -> EpochRow:
        return self.epoch_row(epoch, self.train_steps(pairs, epoch))

    def train_steps(self, pairs: DpoPairs, epoch: int, first: int = 0, last: int | None = None) -> dict:
        """Optimizer steps `first` to `last` of an epoch: SupervisedSteps' tally with the pairs' sums."""
        self.training = pairs
        return self.pair_steps(pairs, epoch, DpoSums(), first, last)

    @staticmethod
    def epoch_row(epoch: int, tally: dict) -> EpochRow:
        """An epoch's row from the tally of all its steps."""
        n = tally["rows"]
        row = EpochRow(epoch, grad_norm=tally["norm_sum"] / tally["steps"], lr=tally["lr"], steps=tally["steps"], pairs=n, seconds=tally["seconds"])
        row.loss, row.accuracy = tally["loss"] / n, tally["right"] / n
        row.chosen_reward, row.rejected_reward = tally["chosen_reward"] / n, tally["rejected_reward"] / n
        row.margin = row.chosen_reward - row.rejected_reward
        return row


# --- where it trains: this process, or a Ray group of FSDP2 ranks ------------------------------


class LocalDpo(LocalReferenced):
    trainer_class = DpoTrainer


class RayDpo(RayReferenced):
    command = "dpo"


# --- measuring a trained policy on held-out pairs ----------------------------------------------


@dataclass(frozen=True)
class EvalRow(PairsRow):
    """A policy against its reference on a set of pairs (`rlctl dpo --eval`): the loss,
    accuracy and margin of the implicit rewards, and each side's mean implicit reward."""

    chosen_reward: float = 0.0
    rejected_reward: float = 0.0


def evaluate(*, data: str, model: str, cfg: Config, ref: str | None = None, device: str = "auto") -> list[EvalRow]:
    """The policy at `model` against the reference at `ref` (by default the one a dpo checkpoint
    was trained against; none for a reference-free loss) on the pairs at `data`, read as training
    reads them, under `cfg.dpo`'s loss: one row over every pair ("all"), then one per
    data_source where the pairs name several."""
    from rlctl.referenced import measured_against_reference
    from rlctl.reward_model import source_groups

    pairs, measuring, table = measured_against_reference(
        COMMAND, DpoPasses, data=data, model=model, cfg=cfg, ref=ref, device=device, free=not cfg.dpo.has_reference,
    )
    rows = []
    with torch.no_grad():
        for name, members in source_groups(table, pairs.ids).items():
            sums, n = measuring.passes(pairs, members, None), len(members)
            chosen, rejected = sums.chosen_reward / n, sums.rejected_reward / n
            rows.append(EvalRow(name, n, sums.loss / n, sums.right / n, chosen - rejected, chosen, rejected))
    return rows


# --- the command ------------------------------------------------------------------------------


def run(
    *, data: str, model: str, out: str, cfg: Config, val_data: str | None = None, device: str = "auto", force: bool = False,
    report: Callable[[dict], None] | None = None,
) -> Manifest:
    """Train the policy at `model` on the preference pairs at `data` (`cfg.dpo`) and commit the
    checkpoint at `out` (rlctl.referenced.train_against_reference)."""
    from rlctl.referenced import train_against_reference

    return train_against_reference(COMMAND, data=data, model=model, out=out, cfg=cfg, val_data=val_data, device=device, force=force, report=report)


COMMAND = ReferencedCommand(
    "dpo", "preference pairs", encode_dpo_pairs, LocalDpo, RayDpo, DpoTrainer, EpochRow, ("val_loss", "val_accuracy"),
    ("loss", "accuracy", "margin", "val_loss", "val_accuracy"), lambda pairs: {"pairs": len(pairs)},
)
