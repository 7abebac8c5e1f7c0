"""Reward-model training (`rlctl reward-model`): a model of human (or any) preferences that
`rm:FOLDER` then scores rollouts with, the RLHF step between supervised fine-tuning and PPO.

A pair is a prompt with a chosen and a rejected response. The model reads each side exactly as
`rm:` scoring reads a sample (`scored_ids`: a chat prompt's conversation through the
tokenizer's chat template, else the prompt's text then the response's), and its reward is the
sequence-classification head's logit at the last token: a causal LM's decoder with a new
one-output head (`AutoModelForSequenceClassification`, `num_labels = 1`). The loss is
Bradley-Terry's, −log σ(r_chosen − r_rejected − margin), plus `center_coef` · (r_chosen +
r_rejected)², the mean over each optimizer step's pairs, accumulated exactly over its passes.

Data: `chosen` and `rejected` (text, or the assistant's turn(s) as messages) beside `prompt`
(text, or chat messages) or `messages`; or, TRL's implicit prompt, `chosen` and `rejected` as
whole conversations whose shared leading turns are the prompt. An optional `margin` column
(TRL's) asks for that much more reward for the chosen side.

It trains in this process (on `--device`), or on a Ray group of FSDP2 ranks (`workers.backend =
"ray"`: each rank takes its share of every step's pairs, as `rlctl sft` does). The output is a
committed model folder that `rm:` loads: weights, tokenizer, and a manifest with the epochs'
loss and accuracy."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import torch

from rlctl.config import Config, RewardModelConfig, to_dict
from rlctl.errors import InputError
from rlctl.manifest import Manifest
from rlctl.supervised import SupervisedSteps

Response = str | list[dict]
LORA_TRAINED_WHOLE = ("score",)  # with LoRA adapters, the new head is trained whole


# --- what the model reads ---------------------------------------------------------------------


def scored_ids(tokenizer, prompt: str | None, chat: Sequence[dict] | None, response: Response) -> list[int]:
    """The tokens a reward model reads for one response, in training and in `rm:` scoring
    alike: a chat rendered whole by the tokenizer's template (the response as the assistant's
    turn, closed by the template's end token), else the prompt's text (a chat's last message
    without a template) then the response's and the end token, as TRL's RewardTrainer and
    OpenRLHF read plain pairs: their reward models score here as they trained."""
    if chat is not None and getattr(tokenizer, "chat_template", None):
        turns = [{"role": "assistant", "content": response}] if isinstance(response, str) else list(response)
        text = tokenizer.apply_chat_template(list(chat) + turns, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    context = prompt if chat is None else ((chat[-1].get("content") or "") if chat else "")
    reply = response if isinstance(response, str) else "".join(turn.get("content") or "" for turn in response)
    ids = tokenizer((context or "") + reply)["input_ids"]
    end = tokenizer.eos_token_id
    return ids + [end] if end is not None and (not ids or ids[-1] != end) else ids


def scorer_tokenizer(path: str):
    """A reward model's tokenizer as training and scoring use it: right padding, and the end
    token as the pad token where the tokenizer has none."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="right", trust_remote_code=False)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_scorer(uri: str, device: torch.device, *, new_head_seed: int | None = None):
    """(model, tokenizer) of a sequence-classification model with one output, fp32, eval mode.
    `new_head_seed`: a causal LM folder gets a new head, initialised from this seed (training);
    None: the folder must hold a trained head, since a new one would score noise (`rm:`)."""
    from transformers import AutoModelForSequenceClassification

    from rlctl import cpu_linear
    from rlctl.backends.hf import check_model_dir, quiet_transformers

    quiet_transformers()
    path = check_model_dir(uri)
    if new_head_seed is not None:
        torch.manual_seed(new_head_seed)
    try:
        tokenizer = scorer_tokenizer(path)
        model, loading = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=torch.float32, output_loading_info=True, trust_remote_code=False, use_safetensors=True,
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        raise InputError(f"model {uri!r} cannot be loaded as a reward model: {type(exc).__name__}: {first}") from None
    untrained = sorted(loading.get("missing_keys", []))
    if untrained and new_head_seed is None:  # e.g. a plain causal LM: transformers would add a random head and score noise
        raise InputError(
            f"rm:{uri}: not a trained reward model: its classification head or weights ({', '.join(untrained[:2])}) are not in the "
            "checkpoint, so its scores would be random; train one with `rlctl reward-model`, or use a sequence-classification model with one label"
        )
    if model.config.pad_token_id is None:  # the head reads the last token that is not padding
        model.config.pad_token_id = tokenizer.pad_token_id
    return cpu_linear.install(model.to(device).eval()), tokenizer


def trainable_scorer(uri: str, device: torch.device, cfg: RewardModelConfig, resume_from: str | None = None):
    """(model, tokenizer) to train: `load_scorer` with a new head seeded from `cfg.seed` where
    the folder has none, and with `cfg.lora.r` LoRA adapters, the head trained whole.
    `resume_from`: an epoch checkpoint of this training, whose weights (a LoRA run's adapters
    and head, over `uri`) it goes on from."""
    from rlctl.lora import add_adapter, load_adapter

    if resume_from is not None and not cfg.lora.r:
        return load_scorer(resume_from, device, new_head_seed=cfg.seed)
    model, tokenizer = load_scorer(uri, device, new_head_seed=cfg.seed)
    if cfg.lora.r and resume_from is not None:
        return load_adapter(model, resume_from), tokenizer
    if cfg.lora.r:
        model = add_adapter(model, cfg.lora, base_path=uri, trained_whole=LORA_TRAINED_WHOLE, setting="reward_model.lora")
    return model, tokenizer


def as_saved(model):
    """The reward model as its folder holds it: a LoRA model's adapters merged into its weights
    (and its head's trained copy in place), so `rm:` loads it as any reward model."""
    from rlctl.lora import is_lora

    return model.merge_and_unload() if is_lora(model) else model


def pooled(sequence: Sequence[int], pad_token_id: int | None) -> list[int]:
    """`sequence` up to the token transformers' sequence-classification models pool: the last
    that is not the pad token (so with pad = end token, the one before a trailing end token, as
    the model trained under TRL read it)."""
    end = len(sequence)
    while pad_token_id is not None and end > 1 and sequence[end - 1] == pad_token_id:
        end -= 1
    return list(sequence[:end])


def rewards_of(model, sequences: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    """The head's logit at the token each sequence is pooled at, fp32 [N]: over the real tokens
    alone (rlctl.backends.unpadded: no padding computed) where the decoder has the Llama layout,
    else transformers' forward of the right-padded batch."""
    from rlctl.backends import unpadded
    from rlctl.backends.hf import pack

    direct = unpadded.for_model(model)
    if direct is None:  # padded with the token the model pools by, which is then never pooled
        batch = pack(sequences, [[] for _ in sequences], model.config.pad_token_id if model.config.pad_token_id is not None else pad_id, device)
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits[:, 0].float()
    kept = [pooled(s, model.config.pad_token_id) for s in sequences]
    batch = pack(kept, [[pad_id]] * len(kept), pad_id, device)  # the state "predicting" a dummy token: the last kept token's
    return unpadded.run_as_forward(model, lambda: model.score(direct.states(batch))).squeeze(-1).float()  # an FSDP2 rank: in its hooks


# --- pairs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pairs:
    """Token ids of each pair's chosen and rejected side, its margin, and how many pairs over
    `max_tokens` were left out (`too_long = "drop"`)."""

    ids: list[str]
    chosen: list[list[int]]
    rejected: list[list[int]]
    margins: list[float]
    dropped: int = 0

    def __len__(self) -> int:
        return len(self.ids)

    @cached_property
    def lengths(self) -> list[int]:
        """A pair's padded tokens in a pass: two sequences of the longer side's length."""
        return [2 * max(len(c), len(r)) for c, r in zip(self.chosen, self.rejected)]


def _shared_turns(chosen: list[dict], rejected: list[dict]) -> int:
    same = 0
    while same < min(len(chosen), len(rejected)) and chosen[same] == rejected[same]:
        same += 1
    return same


def pair_ids(table: pa.Table) -> list[str]:
    """Each pair's id: its `id` column, else its row number."""
    return table.column("id").cast(pa.string()).to_pylist() if "id" in table.column_names else [str(i) for i in range(table.num_rows)]


def split_pairs(table: pa.Table, source: str) -> list[tuple[str | None, list[dict] | None, Response, Response]]:
    """(plain prompt, chat prompt, chosen, rejected) of every row."""
    names = table.column_names
    if "chosen" not in names or "rejected" not in names:
        raise InputError(f"{source}: preference pairs need 'chosen' and 'rejected' columns (it has: {', '.join(names)})")

    def column(name: str) -> list:
        return table.column(name).to_pylist() if name in names else [None] * table.num_rows

    prompts, chats = column("prompt"), column("messages")
    rows = []
    for row, (prompt, chat, chosen, rejected) in enumerate(zip(prompts, chats, column("chosen"), column("rejected"))):
        if chosen is None or rejected is None:
            raise InputError(f"{source}: row {row} has no {'chosen' if chosen is None else 'rejected'} response")
        if isinstance(prompt, list):  # a chat prompt in the `prompt` column (verl's, TRL's conversational)
            prompt, chat = None, prompt
        if prompt is None and chat is None and isinstance(chosen, list) and isinstance(rejected, list):
            cut = _shared_turns(chosen, rejected)  # TRL's implicit prompt: the conversations' shared turns
            if cut == 0 or cut == min(len(chosen), len(rejected)):
                raise InputError(f"{source}: row {row}: chosen and rejected conversations share no prompt turns, or one is the other's prefix")
            chat, chosen, rejected = chosen[:cut], chosen[cut:], rejected[cut:]
        elif isinstance(chosen, list) != isinstance(rejected, list):
            raise InputError(f"{source}: row {row}: chosen and rejected must both be text or both be messages")
        if isinstance(chosen, list) and chat is None:
            raise InputError(f"{source}: row {row}: a response given as messages needs a chat prompt (messages, or a prompt of messages)")
        rows.append((prompt, chat, chosen, rejected))
    return rows


def margin_value(value, pair_id: str, source: str) -> float:
    """A pair's `margin` as a finite float (none: 0)."""
    try:
        margin = float(value) if value is not None else 0.0
    except (TypeError, ValueError):
        margin = math.nan
    if not math.isfinite(margin):
        raise InputError(f"{source}: pair {pair_id!r} has a margin that is not a finite number: {value!r}")
    return margin


def encode_pairs(table: pa.Table, tokenizer, cfg: RewardModelConfig, *, context_length: int | None, source: str) -> Pairs:
    """Every pair as the tokens the model reads; a side over `max_tokens` is one error (or,
    with `too_long = "drop"`, the pair is left out). Scored rollouts are pairs of each prompt's
    best and worst sample's text (rlctl.scored_pairs)."""
    from rlctl.scored_pairs import as_text_pairs, is_scored

    if is_scored(table):
        table = as_text_pairs(table, min_gap=cfg.min_reward_gap, source=source)
    ids = pair_ids(table)
    margins = table.column("margin").to_pylist() if "margin" in table.column_names else [0.0] * table.num_rows
    limit = cfg.max_tokens or context_length or 0
    kept_ids, chosen_ids, rejected_ids, kept_margins = [], [], [], []
    dropped = 0
    for pair_id, margin, (prompt, chat, chosen, rejected) in zip(ids, margins, split_pairs(table, source)):
        sides = [scored_ids(tokenizer, prompt, chat, response) for response in (chosen, rejected)]
        longest = max(len(s) for s in sides)
        if limit and longest > limit:
            if cfg.too_long == "drop":
                dropped += 1
                continue
            where = "reward_model.max_tokens" if cfg.max_tokens else "the model context"
            raise InputError(f"{source}: pair {pair_id!r} has a side of {longest} tokens, over {limit} ({where}): use --set reward_model.too_long=drop to leave such pairs out")
        kept_ids.append(pair_id)
        chosen_ids.append(sides[0])
        rejected_ids.append(sides[1])
        kept_margins.append(margin_value(margin, pair_id, source))
    return Pairs(kept_ids, chosen_ids, rejected_ids, kept_margins, dropped)


# --- training ---------------------------------------------------------------------------------


@dataclass
class EpochRow:
    """One epoch's figures, as the passes met the pairs (the weights moving): the mean loss, the
    share of pairs ranked right (`accuracy`), the mean r_chosen − r_rejected (`margin`); the
    held-out pairs' loss and accuracy after the epoch."""

    epoch: int
    loss: float | None = None
    accuracy: float | None = None
    margin: float | None = None
    val_loss: float | None = None
    val_accuracy: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    steps: int = 0
    pairs: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        row = {k: v for k, v in self.__dict__.items() if v is not None and (self.steps or k in ("epoch", "val_loss", "val_accuracy"))}
        if self.seconds:
            row["pairs_per_s"] = self.pairs / self.seconds
        return row


@dataclass
class PairSums:
    """Sums over pairs: the loss, the pairs ranked right, r_chosen − r_rejected."""

    loss: float = 0.0
    right: float = 0.0
    margin: float = 0.0

    def add(self, other: PairSums) -> None:
        self.loss, self.right, self.margin = self.loss + other.loss, self.right + other.right, self.margin + other.margin


def pair_losses(chosen: torch.Tensor, rejected: torch.Tensor, margins: torch.Tensor, center_coef: float) -> torch.Tensor:
    """Each pair's loss: Bradley-Terry's −log σ(r_c − r_r − margin), plus the centring term."""
    losses = -torch.nn.functional.logsigmoid(chosen - rejected - margins)
    if center_coef:
        losses = losses + center_coef * (chosen + rejected) ** 2
    return losses


class RewardModelTrainer(SupervisedSteps):
    """AdamW on every weight of the model and its head, an optimizer step per `batch_size` pairs,
    in passes of at most `micro_batch_size` pairs of similar lengths. On a group of FSDP2 ranks
    (`ranks`) each rank takes its share of every step's pairs, and the sums are the group's."""

    def __init__(self, model, pad_id: int, cfg: RewardModelConfig, *, device: torch.device, total_steps: int, ranks=None) -> None:
        from rlctl.trainer import ALONE

        super().__init__(model, cfg, device_type=device.type, total_steps=total_steps, command="reward-model")
        self.pad_id, self.device, self.ranks = pad_id, device, ranks or ALONE

    def train_epoch(self, pairs: Pairs, epoch: int) -> EpochRow:
        return self.epoch_row(epoch, self.train_steps(pairs, epoch))

    def train_steps(self, pairs: Pairs, epoch: int, first: int = 0, last: int | None = None) -> dict:
        """Optimizer steps `first` to `last` of an epoch: SupervisedSteps' tally with the pairs' sums."""
        return self.pair_steps(pairs, epoch, PairSums(), first, last)

    @staticmethod
    def epoch_row(epoch: int, tally: dict) -> EpochRow:
        """An epoch's row from the tally of all its steps."""
        n = tally["rows"]
        return EpochRow(
            epoch, loss=tally["loss"] / n, accuracy=tally["right"] / n, margin=tally["margin"] / n,
            grad_norm=tally["norm_sum"] / tally["steps"], lr=tally["lr"], steps=tally["steps"], pairs=n, seconds=tally["seconds"],
        )

    @torch.no_grad()
    def evaluate(self, pairs: Pairs) -> tuple[float, float]:
        """(mean loss, accuracy) of `pairs` under the current weights."""
        sums = self.passes(pairs, list(range(len(pairs))), None)
        return sums.loss / len(pairs), sums.right / len(pairs)

    def passes(self, pairs: Pairs, rows: list[int], backward: Callable[[torch.Tensor], None] | None) -> PairSums:
        return pair_sums(self.model, pairs, rows, pad_id=self.pad_id, cfg=self.cfg, device=self.device, bf16=self.bf16, ranks=self.ranks, backward=backward)


def pair_sums(
    model, pairs: Pairs, rows: list[int], *, pad_id: int, cfg: RewardModelConfig, device: torch.device, bf16: bool, ranks=None,
    backward: Callable[[torch.Tensor], None] | None = None,
) -> PairSums:
    """Sums over `rows` (over every rank of `ranks`), in passes of both sides of similar-length
    pairs; `backward(summed loss)` after each pass, scaled so that FSDP's average over ranks is
    the sum (training), none to only measure."""
    from rlctl.backends.hf import casts_kept, held_whole, training_forward
    from rlctl.trainer import ALONE

    sums, ranks = PairSums(), ranks or ALONE
    with casts_kept(device, bf16 and held_whole(model)):  # each weight cast to bf16 once for all the passes
        for micro, weight in ranks.micro_batches(torch.tensor(rows), cfg.micro_batch_size, pairs.lengths):
            # weight 0: a rank's empty pass over one pair, run to keep FSDP's collectives in step
            sequences = [pairs.chosen[i] for i in micro] + [pairs.rejected[i] for i in micro]
            width = max(len(s) for s in sequences)
            with training_forward(model, device, bf16, rows=len(sequences), length=width):
                rewards = rewards_of(model, sequences, pad_id, device)
            chosen, rejected = rewards[: len(micro)], rewards[len(micro) :]
            margins = torch.tensor([pairs.margins[i] for i in micro], device=device)
            summed = pair_losses(chosen, rejected, margins, cfg.center_coef).sum()
            if backward is not None:
                backward(summed * (weight * ranks.grad_scale))
            gap = (chosen - rejected).detach()
            sums.add(PairSums(weight * float(summed.detach()), weight * float((gap > 0).sum()), weight * float(gap.sum())))
    return PairSums(**ranks.sum(vars(sums)))


# --- where it trains: this process, or a Ray group of FSDP2 ranks ------------------------------


class LocalRewardModel:
    """The reward model loaded in this process (on `device`); `resume_from`: an epoch checkpoint's weights."""

    def __init__(self, model: str, cfg: RewardModelConfig, device: str, resume_from: str | None = None) -> None:
        from rlctl.backends.hf import context_length_of, resolve_device

        self.device = resolve_device(device)
        self.scorer, self.tokenizer = trainable_scorer(model, self.device, cfg, resume_from)
        self.cfg, self.context_length = cfg, context_length_of(self.scorer)

    def start(self, pairs: Pairs, total_steps: int, progress=None) -> None:
        self.pairs = pairs
        self.trainer = RewardModelTrainer(self.scorer, self.tokenizer.pad_token_id, self.cfg, device=self.device, total_steps=total_steps)
        if progress is not None:
            self.trainer.load_state_dict(progress.state)

    def save_progress(self, folder: Path, manifest: Manifest) -> Manifest:
        """The epoch checkpoint: the weights as trained (a LoRA model's adapters and head, not merged) and the optimizer's state."""
        from rlctl.checkpoint import save_checkpoint
        from rlctl.epoch_checkpoints import STATE_DIR

        held = SimpleNamespace(model=self.scorer, tokenizer=self.tokenizer)
        return save_checkpoint(str(folder), policy=held, trainer_state=self.trainer.state_dict(), manifest=manifest, state_dir=STATE_DIR)

    def steps(self, epoch: int, first: int, last: int) -> dict:
        return self.trainer.train_steps(self.pairs, epoch, first, last)

    def evaluate(self, pairs: Pairs) -> tuple[float, float]:
        return self.trainer.evaluate(pairs)

    def save(self, out: str, manifest: Manifest) -> Manifest:
        from rlctl.checkpoint import save_checkpoint

        return save_checkpoint(out, policy=SimpleNamespace(model=as_saved(self.scorer), tokenizer=self.tokenizer), trainer_state=None, manifest=manifest)

    def close(self) -> None:
        """Nothing held beyond this object."""


class RayRewardModel:
    """A Ray worker group (`workers.*`): FSDP2 ranks each train on their share of every step's
    pairs; rank 0 writes the gathered weights. The controller holds the tokenizer only."""

    def __init__(self, model: str, cfg: RewardModelConfig, workers, device: str, resume_from: str | None = None) -> None:
        from rlctl.config import Config, ModelConfig
        from rlctl.workers.ray import RayWorkers

        self.group = RayWorkers(
            Config(model=ModelConfig(device=device), workers=workers), policy_source=None, critic_source=None,
            reward_model={"path": model, "settings": cfg, "resume_from": resume_from},
        )
        self.tokenizer, self.context_length = scorer_tokenizer(model), self.group.context_length

    def start(self, pairs: Pairs, total_steps: int, progress=None) -> None:
        import ray

        self.pairs, self.total_steps = ray.put(pairs), total_steps  # one copy, read by every rank
        self.group.call_ranks("reward_model_start", lambda rank: (total_steps,))
        if progress is not None:
            self.group.call_ranks("load_progress", lambda rank: (progress.folder,))

    def save_progress(self, folder: Path, manifest: Manifest) -> Manifest:
        """The epoch checkpoint: the ranks gather the weights and the optimizer's state, rank 0 writes it."""
        return Manifest.from_json(self.group.call_ranks("save_progress", lambda rank: (str(folder), manifest.to_json(), None))[0])

    def steps(self, epoch: int, first: int, last: int) -> dict:
        return self.group.call_ranks("reward_model_steps", lambda rank: (self.pairs, self.total_steps, epoch, first, last))[0]

    def evaluate(self, pairs: Pairs) -> tuple[float, float]:
        return self.group.call_ranks("reward_model_evaluate", lambda rank: (pairs, self.total_steps))[0]

    def save(self, out: str, manifest: Manifest) -> Manifest:
        manifest.state = {**manifest.state, "workers": to_dict(self.group.cfg.workers)}
        return Manifest.from_json(self.group.call_ranks("save_reward_model", lambda rank: (out, manifest.to_json()))[0])

    def close(self) -> None:
        self.group.close()


# --- evaluating a reward model on held-out pairs -----------------------------------------------


@dataclass(frozen=True)
class PairsRow:
    """A reward model on a set of pairs: how many, the mean Bradley-Terry loss, the share ranked
    right, the mean r_chosen − r_rejected."""

    source: str  # a data_source, or "all"
    pairs: int
    loss: float
    accuracy: float
    margin: float


def source_groups(table: pa.Table, ids: list[str]) -> dict[str, list[int]]:
    """The encoded rows' positions (`ids`: the pairs or examples kept, in order) over all
    ("all"), then by the `data_source` of their rows where they name several."""
    named = dict(zip(pair_ids(table), table.column("data_source").to_pylist())) if "data_source" in table.column_names else {}
    groups: dict[str, list[int]] = {"all": list(range(len(ids)))}
    for row, pair_id in enumerate(ids):
        groups.setdefault(str(named.get(pair_id) or "unknown"), []).append(row)
    return {"all": groups["all"]} if len(groups) == 2 else groups  # one data_source: the same row twice


def evaluate(*, data: str, model: str, cfg: Config, device: str = "auto") -> tuple[list[PairsRow], int]:
    """(rows, pairs left out as too long) of the reward model at `model` (a trained head) on the
    pairs at `data`, read as training and `rm:` read them: one row over every pair ("all"),
    then one per data_source where the pairs name several."""
    from rlctl.backends.hf import check_model_dir, context_length_of, resolve_device
    from rlctl.dtypes import autocast_bf16, decided_bf16
    from rlctl.shards import read

    check_model_dir(model)
    on = resolve_device(device)
    rm_cfg = replace(cfg.reward_model, bf16=decided_bf16(cfg.reward_model.bf16, on.type))
    source = read(data)
    if source.table.num_rows == 0:
        raise InputError(f"{data}: no preference pairs")
    scorer, tokenizer = load_scorer(model, on)
    pairs = encode_pairs(source.table, tokenizer, rm_cfg, context_length=context_length_of(scorer), source=source.uri)
    if not len(pairs):
        raise InputError(f"{data}: every pair is over {rm_cfg.max_tokens or context_length_of(scorer)} tokens (reward_model.too_long = drop left them all out)")
    groups = source_groups(source.table, pairs.ids)
    bf16 = autocast_bf16(rm_cfg.bf16, on.type)
    rows = []
    with torch.no_grad():
        for name, members in groups.items():
            sums = pair_sums(scorer, pairs, members, pad_id=tokenizer.pad_token_id, cfg=rm_cfg, device=on, bf16=bf16)
            rows.append(PairsRow(name, len(members), sums.loss / len(members), sums.right / len(members), sums.margin / len(members)))
    return rows, pairs.dropped


# --- the command ------------------------------------------------------------------------------


def run(
    *, data: str, model: str, out: str, cfg: Config, val_data: str | None = None, device: str = "auto", force: bool = False,
    report: Callable[[dict], None] | None = None,
) -> Manifest:
    """Train a reward model from `model` on the pairs at `data` (`cfg.reward_model`) and commit
    it at `out`; `report(row)` after each epoch (epoch 0: the held-out pairs before training)."""
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
    from rlctl.shards import read

    check_model_dir(model)
    local_checkpoint_dir(out)
    if same_folder(out, model):
        raise InputError(f"reward-model --out {out} is the --model folder: write the reward model elsewhere")
    on = models_device(device, cfg.workers)
    rm_cfg = replace(cfg.reward_model, bf16=decided_bf16(cfg.reward_model.bf16, on))
    train_source = read(data)
    val_source = read(val_data) if val_data else None
    inputs = [shards_ref(train_source), model_ref(model)] + ([shards_ref(val_source)] if val_source else [])
    settings = {k: v for k, v in result_settings(to_dict(rm_cfg)).items() if k not in ("data", "val_data", "base")}  # where it reads from is in the inputs
    manifest = make_manifest("reward-model", {"reward_model": settings}, inputs, seed=rm_cfg.seed)
    if (existing := up_to_date(out, manifest, force)) is not None:
        clear_finished(out, manifest)
        return existing
    if train_source.table.num_rows == 0:
        raise InputError(f"{data}: no preference pairs")
    progress = resume_point(out, manifest, force)  # an epoch checkpoint of this run: its weights to go on from
    resume_from = progress.folder if progress is not None else None
    if cfg.workers.backend == "ray":
        where = RayRewardModel(model, rm_cfg, cfg.workers, device, resume_from)
    else:
        where = LocalRewardModel(model, rm_cfg, device, resume_from)
    try:
        def encoded(source) -> Pairs:
            return encode_pairs(source.table, where.tokenizer, rm_cfg, context_length=where.context_length, source=source.uri)

        pairs = encoded(train_source)
        held_out = encoded(val_source) if val_source and val_source.table.num_rows else None
        if not len(pairs):
            raise InputError(f"{data}: every pair is over {rm_cfg.max_tokens or where.context_length} tokens (reward_model.too_long = drop left them all out)")
        where.start(pairs, rm_cfg.epochs * -(-len(pairs) // rm_cfg.batch_size), progress)
        evaluated = held_out is not None and len(held_out)

        def measured(row: EpochRow) -> dict:
            if evaluated:
                row.val_loss, row.val_accuracy = where.evaluate(held_out)
            return row.as_dict()

        rows = run_epochs(
            out, manifest, epochs=rm_cfg.epochs, steps_per_epoch=-(-len(pairs) // rm_cfg.batch_size), save_steps=rm_cfg.save_steps, progress=progress,
            before=(lambda: measured(EpochRow(0))) if evaluated else None, steps=where.steps,
            row=lambda n, tally: measured(RewardModelTrainer.epoch_row(n, tally)), save=where.save_progress, report=report,
        )
        steps = sum(row.get("steps", 0) for row in rows)
        manifest.state = {"pairs": len(pairs), "dropped": pairs.dropped + (held_out.dropped if held_out else 0), "optimizer_steps": steps, "epochs": rows}
        manifest.metrics = {k: v for k, v in rows[-1].items() if k in ("loss", "accuracy", "val_loss", "val_accuracy")}
        saved = where.save(out, manifest)
    finally:
        where.close()
    clear(out)
    return saved
