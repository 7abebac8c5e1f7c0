"""Supervised fine-tuning (`rlctl sft`): the warm start a policy gets before RL, so that its
first rollouts already follow the task's format.

An example is a prompt and a demonstrated response. The prompt becomes tokens exactly as the
rollout stage makes them (`encode_prompts`: the same chat template, `data.max_prompt_tokens`,
`data.truncate`), and the response as the rollout would sample it: a plain response's tokens
and then the end token the engine stops at; a chat response as the tokenizer's template
renders the assistant's turn after the prompt, up to the turn's end token. The loss is the
mean negative log-likelihood of the trained response tokens (the prompt is context only), over
each optimizer step's examples, accumulated exactly over its passes as the update accumulates.

Data: `prompt` (text) or `messages` (chat) with `response` (or TRL's `completion`), or
`messages` alone ending in the assistant's turn(s), which are the response. A response of
several turns trains on the assistant's turns alone, each as the rollout would sample it after
its generation prompt: a tool's or the user's turn between them, and the template's turn
headers, are context, as the rollout's tool turns are in the update. With `sft.assistant_turns =
"all"` a conversation's every assistant turn is trained, from its first (TRL's
`assistant_only_loss`); with "last" (the default) only its trailing assistant turns.

It trains in this process or on a Ray group of FSDP2 ranks (`workers.backend = "ray"`), each
rank on its share of every optimizer step's examples. The output is a checkpoint folder: the HF weights (or a LoRA adapter) with a manifest that
lists every file and the epochs' losses, and no trainer state: RL started from it begins at
step 0 with a fresh optimizer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import pyarrow as pa
import torch

from rlctl.config import Config, DataConfig, SftConfig, to_dict
from rlctl.errors import InputError
from rlctl.manifest import Manifest
from rlctl.supervised import SupervisedSteps

RESPONSE_COLUMNS = ("response", "completion")  # rlctl's name, TRL's prompt-completion name


@dataclass(frozen=True)
class Examples:
    """Token ids of each example's prompt (context) and response (trained on), and which of a
    response's tokens the loss counts (`trained`; None: all of them)."""

    ids: list[str]
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    trained: list[list[bool]] | None = None  # a multi-turn response: its other turns and the turns' headers are context

    def __len__(self) -> int:
        return len(self.ids)

    def trained_tokens(self, row: int) -> int:
        return len(self.response_ids[row]) if self.trained is None else sum(self.trained[row])

    @property
    def response_tokens(self) -> int:
        """The tokens the loss counts, over every example."""
        return sum(self.trained_tokens(row) for row in range(len(self)))

    @cached_property
    def lengths(self) -> list[int]:
        """Each example's tokens: worked out once, not at every optimizer step's passes."""
        return [len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids)]


# --- examples ---------------------------------------------------------------------------------


def split_examples(table: pa.Table, source: str, assistant_turns: str = "last") -> tuple[list[str | None], list[list[dict] | None], list[str | list[dict]]]:
    """(plain prompts, chat contexts, responses) of every row: a response column beside the
    prompt, or a conversation whose trailing assistant turns ("last"), or whose turns from its
    first assistant turn on ("all"), are the response."""
    ids = table.column("id").to_pylist()
    prompts = table.column("prompt").to_pylist() if "prompt" in table.column_names else [None] * len(ids)
    chats = table.column("messages").to_pylist() if "messages" in table.column_names else [None] * len(ids)
    named = [c for c in RESPONSE_COLUMNS if c in table.column_names]
    if len(named) > 1:
        raise InputError(f"{source}: both a 'response' and a 'completion' column: keep one")
    if named:
        responses = table.column(named[0]).to_pylist()
        for prompt_id, response in zip(ids, responses):
            if response is None:
                raise InputError(f"{source}: example {prompt_id!r} has no {named[0]}")
        return prompts, chats, responses
    contexts, responses = [], []
    for prompt_id, chat in zip(ids, chats):
        turns = chat or []
        cut = len(turns)
        while cut and turns[cut - 1].get("role") == "assistant":
            cut -= 1
        if assistant_turns == "all":
            cut = next((i for i, turn in enumerate(turns) if turn.get("role") == "assistant"), len(turns))
        if cut == len(turns) or cut == 0:
            raise InputError(
                f"{source}: example {prompt_id!r} has no response: give a 'response' (or 'completion') column, "
                "or messages that end with the assistant's turn after the prompt's"
            )
        contexts.append(turns[:cut])
        responses.append(turns[cut:])
    return [None] * len(ids), contexts, responses


def response_tokens(
    tokenizer, prompt: str | None, context: list[dict] | None, response: str | list[dict], data: DataConfig, end_ids: Sequence[int], example: str,
) -> tuple[list[int], list[bool]]:
    """A response's tokens as the rollout would sample them after the prompt, and which of them
    are trained: plain text then the end token, all trained; in a chat, the template's rendering
    of each turn after the prompt's, an assistant's turn after its generation prompt trained up
    to its last end token, its header and anything else context; the context after the last
    trained token left out (a template's newline after the end token is never sampled:
    generation stops there)."""
    from rlctl.stages.rollout import prompt_chat

    _, chat = prompt_chat(example, prompt, context, data)  # the conversation the prompt's tokens were rendered from
    if chat is None:
        if not isinstance(response, str):
            raise InputError(f"example {example!r}: a chat response (messages) needs a chat prompt (messages, or data.chat_template = true)")
        end = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else list(end_ids[:1])
        tokens = tokenizer(response, add_special_tokens=False)["input_ids"] + end
        return tokens, [True] * len(tokens)
    turns = [{"role": "assistant", "content": response}] if isinstance(response, str) else list(response)
    if turns and turns[0].get("role") != "assistant":  # the prompt ends in the assistant's generation prompt
        raise InputError(f"example {example!r}: its response starts with a {turns[0].get('role')!r} turn: a response starts with the assistant's")
    tokens: list[int] = []
    trained: list[bool] = []

    def rendered(upto: int, opened: bool = False) -> str:
        return tokenizer.apply_chat_template(chat + turns[:upto], tokenize=False, add_generation_prompt=opened, **data.chat_template_kwargs)

    def add(text: str, covered: str, train: bool) -> str:
        if not text.startswith(covered):
            raise InputError(f"example {example!r}: the chat template does not render the conversation as the prompt then the response, so the response's tokens are unknown")
        piece = tokenizer(text[len(covered):], add_special_tokens=False)["input_ids"]
        ends = [i for i, token in enumerate(piece) if token in end_ids] if train else []
        last = ends[-1] + 1 if ends else len(piece) if train else 0
        tokens.extend(piece)
        trained.extend(i < last for i in range(len(piece)))
        return text

    covered = rendered(0, opened=True)  # the prompt
    for turn, message in enumerate(turns):
        assistant = message.get("role") == "assistant"
        if assistant and turn:
            covered = add(rendered(turn, opened=True), covered, train=False)  # its generation prompt: the turn's header
        covered = add(rendered(turn + 1), covered, train=assistant)
    while trained and not trained[-1]:
        trained.pop()
        tokens.pop()
    return tokens, trained


def encode_examples(table: pa.Table, tokenizer, data: DataConfig, cfg: SftConfig, *, end_ids: Sequence[int], context_length: int | None, source: str) -> Examples:
    """Every example as tokens; one that is empty or too long is one error (or, with
    `sft.truncate = "right"`, its response cut to `sft.max_tokens`). Scored rollouts are each
    prompt's best samples at or above `sft.min_reward`, in their sampled tokens."""
    from rlctl.scored_pairs import best_samples, is_scored

    if is_scored(table):
        kept = best_samples(table, min_reward=cfg.min_reward, per_prompt=cfg.per_prompt, source=source)
        return fitted_examples(
            [s.id for s in kept], [s.prompt_ids for s in kept], [s.response for s in kept], max_tokens=cfg.max_tokens, truncate=cfg.truncate,
            context_length=context_length, source=source, setting="sft",
        )
    prompts, contexts, responses = split_examples(table, source, cfg.assistant_turns)
    return examples_of(
        table.column("id").to_pylist(), prompts, contexts, responses, tokenizer, data, max_tokens=cfg.max_tokens, truncate=cfg.truncate,
        end_ids=end_ids, context_length=context_length, source=source, setting="sft",
    )


def encoded_prompts(ids: list[str], prompts: list[str | None], contexts: list[list[dict] | None], tokenizer, data: DataConfig, *, context_length: int | None) -> list[list[int]]:
    """Each example's prompt (plain, or a chat context) as the rollout encodes it."""
    from rlctl.stages.rollout import encode_prompts

    as_prompts = pa.table({"id": ids, "prompt": pa.array(prompts, pa.string()), "messages": pa.array(contexts)})
    return encode_prompts(as_prompts, tokenizer, data, context_length=context_length)


def examples_of(
    ids: list[str], prompts: list[str | None], contexts: list[list[dict] | None], responses: list[str | list[dict]], tokenizer, data: DataConfig, *,
    max_tokens: int, truncate: str, end_ids: Sequence[int], context_length: int | None, source: str, setting: str, noun: str = "example",
    prompt_ids: list[list[int]] | None = None,
) -> Examples:
    """Prompts (as the rollout encodes them; `prompt_ids` where they are encoded already) and
    responses (as it would sample them) as tokens; a response that is empty or over
    `max_tokens` with its prompt is one error naming it (or, with `truncate = "right"`, cut).
    `setting` names the config section in messages."""
    if prompt_ids is None:
        prompt_ids = encoded_prompts(ids, prompts, contexts, tokenizer, data, context_length=context_length)
    responses_as_tokens = []
    for example, prompt, context, response in zip(ids, prompts, contexts, responses):
        tokens, trained = response_tokens(tokenizer, prompt, context, response, data, end_ids, example)
        if response == "":  # an end token alone: most likely a column mapped wrong
            tokens = []
        responses_as_tokens.append((tokens, trained))
    return fitted_examples(
        ids, prompt_ids, responses_as_tokens, max_tokens=max_tokens, truncate=truncate, context_length=context_length, source=source, setting=setting, noun=noun,
    )


def fitted_examples(
    ids: list[str], prompt_ids: list[list[int]], responses: list[tuple[list[int], list[bool]]], *, max_tokens: int, truncate: str,
    context_length: int | None, source: str, setting: str, noun: str = "example",
) -> Examples:
    """Examples of token ids (each response with the mask of its trained tokens) held to
    `max_tokens` (else the model's context): one over it is an error naming it, or with
    `truncate = "right"` its response cut; an empty response, or one with nothing to train on,
    is an error."""
    limit = max_tokens or context_length or 0
    kept, masks = [], []
    for example, prompt_tokens, (tokens, trained) in zip(ids, prompt_ids, responses):
        if not tokens:
            raise InputError(f"{source}: {noun} {example!r} has an empty response")
        over = len(prompt_tokens) + len(tokens) - limit if limit else 0
        if over > 0:
            room = limit - len(prompt_tokens)
            if truncate != "right" or room < 1:
                why = "its prompt leaves no room for a response" if room < 1 else f"use --set {setting}.truncate=right to cut its response"
                where = f"{setting}.max_tokens" if max_tokens else "the model context"
                raise InputError(f"{source}: {noun} {example!r} has {len(prompt_tokens) + len(tokens)} tokens, over {limit} ({where}): {why}")
            tokens, trained = tokens[:room], trained[:room]
        if not any(trained):
            raise InputError(f"{source}: {noun} {example!r} has no assistant tokens to train on (its response is other roles' turns, or cut before the assistant's)")
        kept.append(tokens)
        masks.append(trained)
    return Examples(ids, prompt_ids, kept, None if all(all(m) for m in masks) else masks)


# --- training ---------------------------------------------------------------------------------


@dataclass
class EpochRow:
    """One epoch's figures: the train loss is the mean NLL per response token as the passes met
    them (the weights moving), `val_loss` the held-out examples' after the epoch."""

    epoch: int
    loss: float | None = None
    val_loss: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        row = {k: v for k, v in self.__dict__.items() if v is not None and (self.steps or k in ("epoch", "val_loss"))}
        if self.seconds:
            row["tokens_per_s"] = self.tokens / self.seconds
        return row


class SftPasses:
    """The policy's passes over examples, of similar lengths capped by `micro_batch_size` and
    `micro_batch_tokens`: the summed NLL of their trained response tokens, for training's
    steps or a measurement's. On a group of FSDP2 ranks (`ranks`) each rank takes its share,
    as the update's trainer does (`RankGroup.micro_batches`), and the sums are the group's."""

    def __init__(self, policy, cfg: SftConfig, *, bf16: bool, ranks=None) -> None:
        from rlctl.backends.hf import held_whole
        from rlctl.trainer import ALONE

        self.policy, self.cfg, self.bf16, self.ranks = policy, cfg, bf16, ranks or ALONE
        self.weights_whole = held_whole(policy.model)

    @torch.no_grad()
    def mean_loss(self, examples: Examples) -> float:
        """The mean NLL per response token of `examples` under the current weights."""
        return self.nll(examples, list(range(len(examples))), None) / examples.response_tokens

    def nll(self, examples: Examples, rows: list[int], backward: Callable[[torch.Tensor], None] | None) -> float:
        """The summed NLL of `rows`' trained response tokens (over every rank); `backward(summed)`
        after each pass, scaled so that FSDP's average over ranks is the sum."""
        from rlctl.backends.hf import casts_kept, pack, training_forward

        policy, lengths, ranks = self.policy, examples.lengths, self.ranks
        total = 0.0
        passes = ranks.micro_batches(torch.tensor(rows), self.cfg.micro_batch_size, lengths, None, int(self.cfg.micro_batch_tokens))
        with casts_kept(policy.device, self.bf16 and self.weights_whole):  # each weight cast to bf16 once for all the passes
            for micro, weight in passes:  # weight 0: a rank's empty pass, run to keep FSDP's collectives in step
                packed = pack([examples.prompt_ids[i] for i in micro], [examples.response_ids[i] for i in micro], policy.pad_id, policy.device)
                with training_forward(policy.model, policy.device, self.bf16, rows=len(micro), length=packed.input_ids.shape[1]):
                    logp, _ = policy.forward(packed, temperature=1.0)
                summed = -torch.where(trained_mask(packed.response_mask, examples, micro), logp.float(), 0).sum()
                if backward is not None:
                    backward(summed * (weight * ranks.grad_scale))
                total += weight * float(summed.detach())
        return ranks.sum({"nll": total})["nll"]


class SftTrainer(SupervisedSteps, SftPasses):
    """AdamW on the policy (or its LoRA adapters), an optimizer step per `batch_size` examples,
    each accumulated over SftPasses' passes."""

    def __init__(self, policy, cfg: SftConfig, *, total_steps: int, ranks=None) -> None:
        from rlctl.trainer import ALONE

        SupervisedSteps.__init__(self, policy.model, cfg, device_type=policy.device.type, total_steps=total_steps, command="sft")
        self.policy, self.ranks = policy, ranks or ALONE

    def train_epoch(self, examples: Examples, epoch: int) -> EpochRow:
        return self.epoch_row(epoch, self.train_steps(examples, epoch))

    def train_steps(self, examples: Examples, epoch: int, first: int = 0, last: int | None = None) -> dict:
        """Optimizer steps `first` to `last` of an epoch: SupervisedSteps' tally with the summed NLL and its tokens."""
        sums = {"nll": 0.0, "tokens": 0}

        def passes(rows: list[int]) -> None:
            counted = sum(examples.trained_tokens(i) for i in rows)
            sums["nll"] += self.nll(examples, rows, lambda summed: (summed / counted).backward())  # the step's mean
            sums["tokens"] += counted

        return {**self.run_steps(len(examples), epoch, passes, first, last), **sums}

    @staticmethod
    def epoch_row(epoch: int, tally: dict) -> EpochRow:
        """An epoch's row from the tally of all its steps."""
        return EpochRow(
            epoch, loss=tally["nll"] / tally["tokens"], grad_norm=tally["norm_sum"] / tally["steps"], lr=tally["lr"], steps=tally["steps"],
            tokens=tally["tokens"], seconds=tally["seconds"],
        )


def trained_mask(response_mask: torch.Tensor, examples: Examples, rows: Sequence[int]) -> torch.Tensor:
    """`response_mask` [B, T] of a pass over `rows`, less the response tokens that are context."""
    if examples.trained is None:
        return response_mask
    trained = torch.zeros_like(response_mask)
    for k, row in enumerate(rows):
        trained[k, : len(examples.trained[row])] = torch.tensor(examples.trained[row])
    return response_mask & trained


# --- where it trains: this process, or a Ray group of FSDP2 ranks ------------------------------


class LocalPolicy:
    """The policy a supervised command trains (sft, dpo), loaded in this process."""

    def __init__(self, model: str, cfg, device: str) -> None:
        from rlctl.backends.hf import HFPolicy
        from rlctl.lora import prepare_for_training

        self.policy = HFPolicy.load(model, device)
        prepare_for_training(self.policy, cfg.lora, model)
        self.cfg, self.trainer = cfg, None
        self.tokenizer, self.end_ids, self.context_length = self.policy.tokenizer, self.policy.stop_ids, self.policy.context_length

    def save(self, out: str, manifest: Manifest) -> Manifest:
        from rlctl.checkpoint import save_checkpoint

        return save_checkpoint(out, policy=self.policy, trainer_state=None, manifest=manifest)

    def save_progress(self, folder: Path, manifest: Manifest, files: dict[str, bytes] | None = None) -> Manifest:
        """The epoch checkpoint (rlctl.epoch_checkpoints): weights, the optimizer's state, `files`."""
        from rlctl.checkpoint import save_checkpoint
        from rlctl.epoch_checkpoints import STATE_DIR

        return save_checkpoint(str(folder), policy=self.policy, trainer_state=self.trainer.state_dict(), manifest=manifest, state_dir=STATE_DIR, files=files)

    def resume(self, progress) -> None:
        """The optimizer's state of the epoch checkpoint the weights were loaded from (None: a fresh start)."""
        if progress is not None:
            self.trainer.load_state_dict(progress.state)

    def close(self) -> None:
        """Nothing held beyond this object."""


class RayPolicy:
    """The policy a supervised command trains (sft, dpo) on a Ray worker group (`workers.*`):
    FSDP2 ranks each train on their share of every optimizer step's rows, as `cfg` asks (its
    `lora`, `bf16` and `gradient_checkpointing`); the controller holds the tokenizer only."""

    def __init__(self, model: str, cfg, workers, device: str) -> None:
        from rlctl.backends.hf import folder_stop_ids
        from rlctl.config import Config, ModelConfig, UpdateConfig
        from rlctl.workers.ray import RayWorkers

        update = UpdateConfig(lora=cfg.lora, bf16=cfg.bf16, gradient_checkpointing=cfg.gradient_checkpointing)
        self.group = RayWorkers(Config(model=ModelConfig(path=model, device=device), workers=workers, update=update), policy_source=model, critic_source=None)
        self.cfg = cfg
        self.tokenizer, self.context_length = self.group.tokenizer, self.group.context_length
        self.end_ids = folder_stop_ids(model, self.tokenizer)

    def save(self, out: str, manifest: Manifest) -> Manifest:
        manifest.state = {**manifest.state, "workers": to_dict(self.group.cfg.workers)}
        return self.group.save(out, manifest, None, trainer_state=False)

    def save_progress(self, folder: Path, manifest: Manifest, files: dict[str, bytes] | None = None) -> Manifest:
        """The epoch checkpoint: the ranks gather the weights and the optimizer's state, rank 0 writes it."""
        return Manifest.from_json(self.group.call_ranks("save_progress", lambda rank: (str(folder), manifest.to_json(), files))[0])

    def resume(self, progress) -> None:
        """Each rank loads the optimizer's state of the epoch checkpoint (None: a fresh start)."""
        if progress is not None:
            self.group.call_ranks("load_progress", lambda rank: (progress.folder,))

    def close(self) -> None:
        self.group.close()


class LocalSft(LocalPolicy):
    def start(self, examples: Examples, total_steps: int, progress=None) -> None:
        self.examples, self.trainer = examples, SftTrainer(self.policy, self.cfg, total_steps=total_steps)
        self.resume(progress)

    def steps(self, epoch: int, first: int, last: int) -> dict:
        return self.trainer.train_steps(self.examples, epoch, first, last)

    def loss(self, examples: Examples) -> float:
        return self.trainer.mean_loss(examples)


class RaySft(RayPolicy):
    def start(self, examples: Examples, total_steps: int, progress=None) -> None:
        import ray

        self.examples, self.total_steps = ray.put(examples), total_steps  # one copy, read by every rank
        self.group.call_ranks("sft_start", lambda rank: (self.cfg, total_steps))
        self.resume(progress)

    def steps(self, epoch: int, first: int, last: int) -> dict:
        return self.group.call_ranks("sft_steps", lambda rank: (self.examples, self.cfg, self.total_steps, epoch, first, last))[0]

    def loss(self, examples: Examples) -> float:
        return self.group.call_ranks("sft_loss", lambda rank: (examples, self.cfg, self.total_steps))[0]


# --- measuring a model on held-out examples ---------------------------------------------------


@dataclass(frozen=True)
class EvalRow:
    """A model on a set of examples (`rlctl sft --eval`): how many, their trained response
    tokens, the mean NLL per such token, and its perplexity."""

    source: str  # a data_source, or "all"
    examples: int
    tokens: int
    loss: float
    perplexity: float


def evaluate(*, data: str, model: str, cfg: Config, device: str = "auto") -> list[EvalRow]:
    """The model at `model` on the examples at `data`, read as training reads them (`cfg.sft`,
    `cfg.data`): one row over every example ("all"), then one per data_source where the
    examples name several."""
    import math

    from rlctl.backends.hf import HFPolicy, check_model_dir, resolve_device
    from rlctl.dtypes import autocast_bf16, decided_bf16
    from rlctl.passes import ModelShape, decided_micro_batch_tokens
    from rlctl.reward_model import source_groups
    from rlctl.shards import read

    check_model_dir(model)
    on = resolve_device(device)
    tokens = decided_micro_batch_tokens(cfg.sft.micro_batch_tokens, on.type, ModelShape.of_folder(model), ranks=1)
    sft = replace(cfg.sft, bf16=decided_bf16(cfg.sft.bf16, on.type), micro_batch_tokens=tokens)
    source = read(data, "prompts")
    if source.table.num_rows == 0:
        raise InputError(f"{data}: no examples")
    policy = HFPolicy.load(model, str(on))
    examples = encode_examples(source.table, policy.tokenizer, cfg.data, sft, end_ids=policy.stop_ids, context_length=policy.context_length, source=source.uri)
    measuring = SftPasses(policy, sft, bf16=autocast_bf16(sft.bf16, on.type))
    rows = []
    with torch.no_grad():
        for name, members in source_groups(source.table, examples.ids).items():
            counted = sum(examples.trained_tokens(i) for i in members)
            loss = measuring.nll(examples, members, None) / counted
            rows.append(EvalRow(name, len(members), counted, loss, math.exp(min(loss, 700.0))))
    return rows


# --- the command ------------------------------------------------------------------------------


def run(
    *, data: str, model: str, out: str, cfg: Config, val_data: str | None = None, device: str = "auto", force: bool = False,
    report: Callable[[dict], None] | None = None,
) -> Manifest:
    """Fine-tune `model` on the examples at `data` (`cfg.sft`, prompts as `cfg.data` makes
    them, in this process or on `cfg.workers`' Ray group) and commit the checkpoint at `out`;
    `report(row)` after each epoch (epoch 0: the held-out loss before training)."""
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

    check_model_dir(model)
    local_checkpoint_dir(out)
    if same_folder(out, model):
        raise InputError(f"sft --out {out} is the --model folder: write the fine-tuned checkpoint elsewhere")
    on = models_device(device, cfg.workers)
    sft = replace(
        cfg.sft, bf16=decided_bf16(cfg.sft.bf16, on),
        micro_batch_tokens=decided_micro_batch_tokens(cfg.sft.micro_batch_tokens, on, ModelShape.of_folder(model), ranks=ranks_at_once(cfg.workers)),
    )
    train_source = read(data, "prompts")
    val_source = read(val_data, "prompts") if val_data else None
    inputs = [shards_ref(train_source), model_ref(model)] + ([shards_ref(val_source)] if val_source else [])
    manifest = make_manifest("sft", {"sft": result_settings(to_dict(sft)), "data": to_dict(cfg.data)}, inputs, seed=sft.seed)
    if (existing := up_to_date(out, manifest, force)) is not None:
        clear_finished(out, manifest)
        return existing
    if train_source.table.num_rows == 0:
        raise InputError(f"{data}: no examples")
    progress = resume_point(out, manifest, force)  # an epoch checkpoint of this run: its weights to go on from
    start = progress.folder if progress is not None else model
    where = RaySft(start, sft, cfg.workers, device) if cfg.workers.backend == "ray" else LocalSft(start, sft, device)
    try:
        def encoded(source) -> Examples:
            return encode_examples(source.table, where.tokenizer, cfg.data, sft, end_ids=where.end_ids, context_length=where.context_length, source=source.uri)

        examples, held_out = encoded(train_source), encoded(val_source) if val_source and val_source.table.num_rows else None
        where.start(examples, sft.epochs * -(-len(examples) // sft.batch_size), progress)

        def measured(row: EpochRow) -> dict:
            if held_out is not None:
                row.val_loss = where.loss(held_out)
            return row.as_dict()

        rows = run_epochs(
            out, manifest, epochs=sft.epochs, steps_per_epoch=-(-len(examples) // sft.batch_size), save_steps=sft.save_steps, progress=progress,
            before=(lambda: measured(EpochRow(0))) if held_out is not None else None, steps=where.steps,
            row=lambda n, tally: measured(SftTrainer.epoch_row(n, tally)), save=where.save_progress, report=report,
        )
        steps = sum(row.get("steps", 0) for row in rows)
        manifest.state = {"examples": len(examples), "response_tokens": examples.response_tokens, "optimizer_steps": steps, "epochs": rows}
        manifest.metrics = {k: v for k, v in rows[-1].items() if k in ("loss", "val_loss")}
        saved = where.save(out, manifest)
    finally:
        where.close()
    clear(out)
    return saved
