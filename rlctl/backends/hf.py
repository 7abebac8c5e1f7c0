"""The Hugging Face backend: transformers models + torch, on the CPU or CUDA.

`HFPolicy` holds one causal LM and its tokenizer and does the three things the stages need
of a policy: generate with sampling (KV cache, left padding, finished rows dropped from the
batch), log-probs of given responses (no grad), and a differentiable forward for training.
`ValueModel` is a causal LM with a scalar value head, saved beside the LM as
`value_head.safetensors`.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Callable, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from rlctl import cpu_linear
from rlctl.algos.logprobs import logprobs_and_statistic, row_uniforms, sample_next
from rlctl.backends import unpadded
from rlctl.backends.base import Generation, SamplingParams, stream_rows
from rlctl.backends.stop_strings import StopStrings
from rlctl.errors import InputError
from rlctl.lora import transformers_model

VALUE_HEAD_FILE = "value_head.safetensors"
COMPUTE_DTYPES = ("fp32", "bf16")  # what "auto" becomes (rlctl.dtypes)


def quiet_transformers() -> None:
    """No progress bars or advisory warnings from transformers on our stderr."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise InputError(f"unknown device {device!r}; use auto, cpu or cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"device {device!r} asked for, but torch sees no CUDA device")
    return torch.device(device)


def decide_dtype(device: torch.device, compute_dtype: str) -> str:
    """fp32 or bf16: "auto" decided for `device` (rlctl.dtypes), anything else checked."""
    from rlctl.dtypes import AUTO
    from rlctl.dtypes import compute_dtype as decided

    if compute_dtype not in (AUTO, *COMPUTE_DTYPES):
        raise InputError(f"compute dtype must be one of {AUTO}, {', '.join(COMPUTE_DTYPES)}, got {compute_dtype!r}")
    return decided(compute_dtype, device.type)


# the largest [rows, heads, L, L] attention score tensor the eager attention is used for (see training_forward)
EAGER_ATTENTION_MAX_SCORES = 1 << 25


@contextmanager
def training_forward(model, device: torch.device, bf16: bool, *, rows: int, length: int):
    """A forward of `model` as the update computes it: bf16 autocast when training in bf16, and
    on the CPU under it, for short sequences, transformers' eager attention (bf16 matmuls,
    fp32 softmax, as autocast's math attention on a GPU): torch's CPU math kernel upcasts to
    fp32 (MKL) and the CPU flash-attention backward in bf16 is slower still (small preset,
    64 × 76 tokens: flash 1.64 s, math 1.51 s, eager 1.33–1.46 s per update; bench/RESULTS.md).
    The score tensor stays small (≤ EAGER_ATTENTION_MAX_SCORES elements; longer sequences keep SDPA)."""
    with ExitStack() as stack:
        if bf16:
            stack.enter_context(torch.autocast(device.type, dtype=torch.bfloat16))
            stack.enter_context(bf16_attention(model, device, rows=rows, length=length))
        yield


@contextmanager
def casts_kept(device: torch.device, bf16: bool):
    """Around the passes of one optimizer step: each trained weight is cast to bf16 once, not
    once per pass. autocast caches its casts of weights that require grad until its outermost
    region exits, so an enabled region is held open here and a disabled one inside it: the code
    between forwards (losses, backward) runs without autocast as before, and each pass's
    `training_forward` re-enables it and finds the casts made by the first. The gradients are
    the same bits (tests/unit/test_trainer.py); small preset, an update of 64 rows in 16 passes:
    2.92 s instead of 3.23 (bench/casts_kept_bench.py, RESULTS.md). Only for weights held whole in this process:
    an FSDP2 rank's weights are gathered per pass, and caching those would keep them gathered."""
    if not bf16:
        yield
        return
    with torch.autocast(device.type, dtype=torch.bfloat16), torch.autocast(device.type, enabled=False):
        yield


def disable_dropout(model: torch.nn.Module) -> int:
    """Every dropout of the model set to 0 — its `nn.Dropout` modules and the attention
    modules' `attention_dropout` rate, which transformers passes to the attention in training
    mode — so that a training forward gives the log-probs an eval forward gives (TRL's
    disable_dropout). A LoRA adapter's own dropout (update.lora.dropout) stays. Returns how
    many were on."""
    turned_off = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout) and module.p and "lora_dropout" not in name:
            module.p = 0.0
            turned_off += 1
        rate = getattr(module, "attention_dropout", None)
        if isinstance(rate, float) and rate:
            module.attention_dropout = 0.0
            turned_off += 1
    return turned_off


def seen_tokens(prompt_ids, vocab: int, device) -> torch.Tensor:
    """[B, vocab] booleans: the tokens each row's prompt holds (rollout.repetition_penalty's
    start; the decode loop marks each drawn token)."""
    seen = torch.zeros((len(prompt_ids), vocab), dtype=torch.bool, device=device)
    for row, ids in enumerate(prompt_ids):
        seen[row, torch.as_tensor(list(ids), dtype=torch.long, device=device)] = True
    return seen


def held_whole(model) -> bool:
    """Whether every parameter of `model` is a plain tensor of this process (not a DTensor shard)."""
    return all(type(p.data) is torch.Tensor for p in model.parameters())


def bf16_attention(model, device: torch.device, *, rows: int, length: int):
    """The attention of a bf16 forward over `rows` × `length` tokens: on the CPU, for short
    sequences, transformers' eager attention (see training_forward); otherwise the model's own,
    and always where the layers checkpoint their activations (update.gradient_checkpointing):
    their backward reruns the attention after this forward has put the model's own back."""
    heads = int(getattr(model.config, "num_attention_heads", 1))
    if unpadded.checkpointing(transformers_model(model)):
        return nullcontext()
    if device.type == "cpu" and rows * heads * length * length <= EAGER_ATTENTION_MAX_SCORES:
        return attention_implementation(model, "eager")
    return nullcontext()


@contextmanager
def attention_implementation(model, name: str):
    """Run `model`'s attention layers with transformers' `name` implementation for a while."""
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def decoding_attention(model, device: torch.device):
    """The attention `generate` runs: on the CPU, for a model that attends with SDPA, rlctl's
    single-token decode attention (rlctl.backends.decode_attention; RLCTL_DECODE_ATTENTION=sdpa
    keeps SDPA); otherwise the model's own."""
    uses_sdpa = getattr(model.config, "_attn_implementation", None) == "sdpa"
    if device.type != "cpu" or not uses_sdpa or os.environ.get("RLCTL_DECODE_ATTENTION") == "sdpa":
        return nullcontext()
    from rlctl.backends import decode_attention

    return attention_implementation(model, decode_attention.register())


class Bf16Copy:
    """A bf16 copy of a module's parameters for generation, refreshed from the trained fp32
    module before each use. Autocast would cast every weight at every decode step (slower than
    fp32 for one token per row); the copy casts once per rollout. Buffers (rotary frequencies)
    stay fp32."""

    def __init__(self) -> None:
        self.module = None
        self._source_id = None

    def of(self, source: torch.nn.Module) -> torch.nn.Module:
        """The copy, holding `source`'s current weights (a frozen source, the reference, is
        copied once)."""
        import copy

        if self.module is None or self._source_id != id(source):
            self.module = copy.deepcopy(source)
            for p in self.module.parameters():
                p.requires_grad_(False)
                p.data = p.data.to(torch.bfloat16)
            self._source_id = id(source)
        elif any(p.requires_grad for p in source.parameters()):
            with torch.no_grad():
                for mine, theirs in zip(self.module.parameters(), source.parameters()):
                    mine.copy_(theirs)
        self.module.eval()
        return self.module


def check_model_dir(uri: str) -> Path:
    """A local HF model folder: its config names a model type, and when it is (part of) an
    rlctl checkpoint or reshard output, every file matches the manifest."""
    from rlctl.checkpoint import verify_checkpoint
    from rlctl.lora import adapter_base, is_adapter_dir

    path = Path(uri)
    if not path.exists():
        raise InputError(f"model {uri!r} does not exist")
    if not path.is_dir():
        raise InputError(f"model {uri!r} is a file, not a Hugging Face model folder")
    if is_adapter_dir(path):  # a LoRA checkpoint: the adapter here, the base where it names
        verify_checkpoint(uri)
        check_model_dir(adapter_base(path))
        return path
    if not (path / "config.json").is_file():
        raise InputError(f"model {uri!r} is not a Hugging Face model folder (no config.json)")
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"model {uri!r}: config.json is not valid JSON: {exc}") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise InputError(f"model {uri!r}: config.json names no model_type, so this is not a model folder")
    verify_checkpoint(uri)
    return path


def load_causal_lm(uri: str, device: torch.device):
    """(model, tokenizer) from a local HF folder; fp32 weights, eval mode, no dropout."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlctl.lora import adapter_base, is_adapter_dir, load_adapter

    quiet_transformers()
    path = check_model_dir(uri)
    weights = adapter_base(path) if is_adapter_dir(path) else path
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left", trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32, trust_remote_code=False, use_safetensors=True).to(device)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"model {uri!r} cannot be loaded as a causal LM: {_first_line(exc)}") from None
    if weights is not path:
        model = load_adapter(model, str(path)).to(device)
    model.eval()
    return model, tokenizer


def context_length_of(model) -> int | None:
    """The longest sequence a model's positions cover (its config's max_position_embeddings)."""
    value = getattr(model.config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) else None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


@dataclass(frozen=True)
class PackedBatch:
    """Prompt + response sequences right-padded into one tensor, and where responses sit."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    position_ids: torch.Tensor  # [B, L]
    logit_index: torch.Tensor  # [B, T] position whose logits predict response token t
    response_ids: torch.Tensor  # [B, T] (0 where padded)
    response_mask: torch.Tensor  # [B, T] bool


def pack(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], pad_id: int, device) -> PackedBatch:
    full = [list(p) + list(r) for p, r in zip(prompt_ids, response_ids)]
    B, L = len(full), max(len(s) for s in full)
    T = max((len(r) for r in response_ids), default=0)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    logit_index = torch.zeros((B, T), dtype=torch.long)
    responses = torch.zeros((B, T), dtype=torch.long)
    response_mask = torch.zeros((B, T), dtype=torch.bool)
    for i, (seq, p, r) in enumerate(zip(full, prompt_ids, response_ids)):
        input_ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention_mask[i, : len(seq)] = 1
        n = len(r)
        logit_index[i, :n] = torch.arange(len(p) - 1, len(p) - 1 + n)
        responses[i, :n] = torch.tensor(list(r), dtype=torch.long)
        response_mask[i, :n] = True
    position_ids = torch.arange(L).unsqueeze(0).expand(B, L).contiguous()
    return PackedBatch(
        input_ids.to(device), attention_mask.to(device), position_ids.to(device),
        logit_index.to(device), responses.to(device), response_mask.to(device),
    )


def batches_by_length(
    prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], batch_size: int, max_tokens: int = 0,
) -> list[list[int]]:
    """Row indices in batches of at most `batch_size` rows and `max_tokens` padded tokens (rows ×
    the longest sequence; 0: no cap), the rows ordered by sequence length, so that a batch pads
    to similar lengths."""
    from rlctl.passes import cut_passes

    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
    return cut_passes(sorted(range(len(prompt_ids)), key=lambda i: lengths[i]), batch_size, lengths, max_tokens)


def distinct_prompts(prompt_ids: Sequence[Sequence[int]]) -> tuple[list[Sequence[int]], list[int]]:
    """The distinct prompts of a batch in first-seen order, and for each row the index of its
    prompt among them: a prompt sampled n times (GRPO's groups) needs its forward pass once."""
    index: dict[tuple[int, ...], int] = {}
    distinct: list[Sequence[int]] = []
    source = []
    for prompt in prompt_ids:
        key = tuple(prompt)
        if key not in index:
            index[key] = len(distinct)
            distinct.append(prompt)
        source.append(index[key])
    return distinct, source


# Running each distinct prompt once saves (repeated prompt tokens) × (parameters) × 2 FLOPs
# forward (× 6 with backward) and costs a second model call per pass with KV-cache copies. On
# the CPU the call costs more than the saving below ~1e9 parameter-tokens (the README's PPO
# example: a 0.85M-parameter model, mini-batches of 12 rows drawn from groups of 4, ~90
# repeated tokens each: update 0.67 → 0.77 s when it shared anyway; the small preset at TRL's
# shape: 576 tokens × 24M, 10% faster shared). On a GPU the FLOPs are far cheaper and the call's
# launches no cheaper: on an H200, Qwen2.5-0.5B's shape, 8 prompts × 8 samples × 128 response
# tokens, an update shared its prompts at 0.60× / 0.70× / 1.40× the speed at 5.5e12 / 2.8e13 /
# 5.5e13 parameter-tokens (prompts of 200 / 1,000 / 2,000 tokens; bench/prompt_sharing_bench.py):
# the break-even lies near 4e13.
SHARED_PROMPT_MIN_PARAM_TOKENS = {"cpu": 1e9, "cuda": 4e13}
SHARE_PROMPTS_ENV = "RLCTL_SHARE_PROMPTS"  # auto (the rule above) | always | never: to compare, or to debug
SHARE_PROMPTS_MODES = ("auto", "always", "never")


def worth_sharing_prompts(prompt_ids: Sequence[Sequence[int]], *, parameters: int, device_type: str) -> bool:
    """Whether rows with these prompts run each distinct prompt once on a model of
    `parameters` (`HFPolicy.forward_sharing_prompts`): when the repeated prompt tokens times
    the parameters reach SHARED_PROMPT_MIN_PARAM_TOKENS for the device, or as
    RLCTL_SHARE_PROMPTS says (forwarded to Ray workers, as every RLCTL_* variable)."""
    mode = os.environ.get(SHARE_PROMPTS_ENV, "auto")
    if mode not in SHARE_PROMPTS_MODES:
        raise InputError(f"{SHARE_PROMPTS_ENV}={mode!r}: use one of {', '.join(SHARE_PROMPTS_MODES)}")
    distinct, _ = distinct_prompts(prompt_ids)
    saved = sum(len(p) for p in prompt_ids) - sum(len(p) for p in distinct)
    if saved == 0 or mode != "auto":
        return saved > 0 and mode != "never"
    return saved * parameters >= SHARED_PROMPT_MIN_PARAM_TOKENS.get(device_type, SHARED_PROMPT_MIN_PARAM_TOKENS["cuda"])


def left_padded(prompt_ids: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts as (ids, attention mask, positions) [B, L], padded on the left so that every
    prompt ends at the last column (where the next token's logits are)."""
    length = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids), length), dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        ids[i, length - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        mask[i, length - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def batches_by_prompt(
    prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], batch_size: int, max_tokens: int = 0,
) -> list[list[int]]:
    """Row indices in batches of at most `batch_size` rows and `max_tokens` padded tokens (rows ×
    the longest sequence; 0: no cap) that keep the rows of one prompt together (a group larger
    than a batch is split), the groups ordered by their longest sequence."""
    _, source = distinct_prompts(prompt_ids)
    groups: dict[int, list[int]] = {}
    for row, prompt in enumerate(source):
        groups.setdefault(prompt, []).append(row)
    widths = [(len(prompt_ids[rows[0]]) + max(len(response_ids[r]) for r in rows), rows) for rows in groups.values()]
    batches: list[list[int]] = []
    for width, rows in sorted(widths, key=lambda pair: pair[0]):  # widest last: a group that joins a batch sets its padded width
        fits = max(1, min(batch_size, max_tokens // width)) if max_tokens else batch_size  # rows of this width in one batch
        for start in range(0, len(rows), fits):
            chunk = rows[start : start + fits]
            if batches and len(batches[-1]) + len(chunk) <= fits:
                batches[-1].extend(chunk)
            else:
                batches.append(list(chunk))
    return batches


def scored_rows(prompt_ids, response_ids, batch_size: int, pad_id: int, device, score, batch_tokens: int = 0) -> list[list[float]]:
    """`score(packed batch)` → [B, T] over length-ordered batches (`batches_by_length`), each row
    cut to its response length and put back in the caller's order."""
    return scored_rows_each(prompt_ids, response_ids, batch_size, pad_id, device, lambda batch: (score(batch),), batch_tokens)[0]


def scored_rows_each(
    prompt_ids, response_ids, batch_size: int, pad_id: int, device, score, batch_tokens: int = 0, *, outputs: int = 1,
) -> tuple[list[list[float]], ...]:
    """`scored_rows` for a `score` that returns `outputs` [B, T] tensors: a list of rows each."""
    results: tuple[list[list[float]], ...] = tuple([[] for _ in prompt_ids] for _ in range(outputs))
    for rows in batches_by_length(prompt_ids, response_ids, batch_size, batch_tokens):
        batch = pack([prompt_ids[i] for i in rows], [response_ids[i] for i in rows], pad_id, device)
        lengths = batch.response_mask.sum(-1).tolist()
        for result, tensor in zip(results, score(batch)):
            for i, row, n in zip(rows, tensor.float().cpu().tolist(), lengths):
                result[i] = row[:n]
    return results


def response_logits(logits: torch.Tensor, batch: PackedBatch, *, offset: int = 0) -> torch.Tensor:
    """logits [B, L - offset, V] (positions from `offset` on) → the logits predicting each
    response token [B, T, V]. Padded response slots read position `offset` (masked later)."""
    index = (batch.logit_index - offset).clamp(min=0).unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    return logits.gather(1, index)


def first_response_logit(batch: PackedBatch) -> int:
    """The first sequence position whose logits predict a response token, over the batch."""
    if not bool(batch.response_mask.any()):
        return 0
    return int(batch.logit_index[batch.response_mask].min())


def response_hidden(hidden: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """hidden [B, L, H] → the hidden state before each response token [B, T, H]."""
    index = batch.logit_index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
    return hidden.gather(1, index)


def _generations(tokens: torch.Tensor, logprobs: torch.Tensor, lengths: torch.Tensor, stopped: torch.Tensor) -> list[Generation]:
    """Per row: its first `lengths` tokens and log-probs, and why it ended."""
    return [
        Generation(row_tokens[:n], row_logprobs[:n], "stop" if row_stopped else "length")
        for row_tokens, row_logprobs, n, row_stopped in zip(tokens.tolist(), logprobs.tolist(), lengths.tolist(), stopped.tolist())
    ]


def positions_to_keep(first: int, length: int, device: torch.device) -> dict:
    """transformers' `logits_to_keep` for positions first … length − 1. On the CPU as indices: a
    count hands the LM head a strided view of the hidden states, whose batch torch's matmul
    cannot fold into one product, and in bf16 its batched CPU product then copies the head's
    weight once per row (272 MB a row at Qwen2.5-0.5B's shape); the indices make the head's input
    a contiguous [B, length − first, H] copy. Elsewhere the count (a GPU's batched product reads
    the broadcast weight in place, and some models, Gemma 4, skip work for a count only)."""
    if torch.device(device).type != "cpu":
        return {"logits_to_keep": length - first}
    return {"logits_to_keep": torch.arange(first, length, device=device)}


def accepts_logits_to_keep(model) -> bool:
    """Whether the causal LM's forward computes logits for the last N positions only."""
    base = transformers_model(model)  # a peft model passes it on
    try:
        return "logits_to_keep" in inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        return False


def stop_ids_of(generation_config, tokenizer) -> list[int]:
    """The token ids generation ends at: the generation config's eos id(s) and the tokenizer's."""
    gen_eos = getattr(generation_config, "eos_token_id", None)
    stops = set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    if tokenizer.eos_token_id is not None:
        stops.add(tokenizer.eos_token_id)
    return sorted(stops)


def folder_stop_ids(uri: str, tokenizer) -> list[int]:
    """`stop_ids_of` a model folder without loading its weights (a LoRA folder: its base's config)."""
    from transformers import GenerationConfig

    from rlctl.lora import adapter_base, is_adapter_dir

    path = Path(uri)
    folder = adapter_base(path) if is_adapter_dir(path) else path
    try:
        config = GenerationConfig.from_pretrained(folder)
    except (OSError, ValueError):
        config = None
    return stop_ids_of(config, tokenizer)


class HFPolicy:
    """A causal LM + tokenizer that generates, scores and trains."""

    def __init__(self, model, tokenizer, device: torch.device, *, bf16_copy: bool = True) -> None:
        """`bf16_copy=False`: bf16 scoring under autocast on this module, for a module that
        lives for one call (a reference gathered from shards), where a copy would not pay."""
        self.model = cpu_linear.install(model)
        self.tokenizer = tokenizer
        self.device = device
        self.stop_ids = stop_ids_of(model.generation_config, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]
        self._keeps_logits = accepts_logits_to_keep(model)
        self._parameters: int | None = None  # counted on first use (shares_prompts)
        self._bf16 = Bf16Copy()
        self._scores_from_copy = bf16_copy

    @property
    def context_length(self) -> int | None:
        """The longest sequence (prompt + response) the model's positions cover."""
        return context_length_of(self.model)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().num_embeddings)

    @classmethod
    def load(cls, uri: str, device: str = "auto") -> HFPolicy:
        dev = resolve_device(device)
        model, tokenizer = load_causal_lm(uri, dev)
        return cls(model, tokenizer, dev)

    # -- generation --------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        batch_size: int = 64,
        on_tokens: Callable[[int], None] | None = None,
        compute_dtype: str = "fp32",
        first_row: int = 0,
        row_ids: Sequence[int] | None = None,
    ) -> list[Generation]:
        """Sample one response per prompt (repeat a prompt for n samples). Deterministic for a
        seed: row i draws from its own stream (`row_uniforms(seed, [first_row + i], ...)`, or
        `row_ids[i]` for the rows of a subset), so the
        rows do not depend on the batch size or on how rows are split across workers.
        `compute_dtype="bf16"` generates with a bf16 copy of the weights (the trained ones,
        shared with training, stay fp32; "auto": bf16 where the hardware has it natively)."""
        from rlctl.backends import cuda_graphs

        model = self._bf16.of(self.model) if decide_dtype(self.device, compute_dtype) == "bf16" else self.model
        results: list[Generation | None] = [None] * len(prompt_ids)
        streams = stream_rows(len(prompt_ids), first_row, row_ids)
        with decoding_attention(model, self.device):
            graphed = cuda_graphs.decode_mode(model, self.device) is not None
            products = None if graphed else self._decode_products(model, rows=min(batch_size, len(prompt_ids)))
            # where the direct step decodes, the model is plain (no hooks, no adapters: nothing
            # keeps a tensor the loop makes): its tensor operations skip autograd's bookkeeping
            with torch.inference_mode(graphed or products is not None):
                for rows in batches_by_length(prompt_ids, [()] * len(prompt_ids), batch_size):  # prompts of similar length pad less
                    uniforms = row_uniforms(params.seed, [streams[i] for i in rows], params.max_new_tokens)
                    generations = self._generate_batch(model, [prompt_ids[i] for i in rows], params, uniforms, on_tokens, products, graphed)
                    for i, generation in zip(rows, generations):
                        results[i] = generation
        return results

    def _decode_products(self, model, rows: int):
        """The direct decode step's products for this `generate` call (weights packed once for
        all its batches: rlctl.backends.decode_products), or None where the step does not run."""
        from rlctl.backends import decode_products, decode_step

        if not (decode_step.enabled() and decode_step.supports(model)):
            return None
        return decode_products.for_generation(model, self.device, rows)

    def _generate_batch(self, model, prompt_ids, params: SamplingParams, uniforms: torch.Tensor, on_tokens, products=None, graphed=False) -> list[Generation]:
        """`uniforms` [B, max_new_tokens]: row i's random numbers, one per step. The loop's work
        per step is tensor operations over the rows still generating; the rows' Python lists are
        built once at the end. `products`: the direct decode step's (`_decode_products`);
        `graphed`: decode by replaying a CUDA graph of the step (`_decode_static`) where the
        batch's static cache fits."""
        from rlctl.backends import cuda_graphs, decode_step
        from rlctl.backends.kv_cache import decoding_cache

        B, steps = len(prompt_ids), params.max_new_tokens
        stop = torch.tensor(self.stop_ids, device=self.device)
        stops = StopStrings(self.tokenizer, params.stop)
        tokens = torch.zeros((B, steps), dtype=torch.long, device=self.device)
        logprobs = torch.zeros((B, steps), dtype=torch.float32, device=self.device)
        lengths = torch.zeros(B, dtype=torch.long, device=self.device)
        stopped = torch.zeros(B, dtype=torch.bool, device=self.device)
        uniforms = uniforms.to(self.device)
        logits, cache, attention_mask, position_ids = self._prompt_pass(model, prompt_ids, decoding_cache(self.model.config))
        seen = seen_tokens(prompt_ids, logits.shape[-1], self.device) if params.repetition_penalty != 1.0 else None  # rollout.repetition_penalty's
        if graphed and cuda_graphs.fits(cache, B, attention_mask.shape[1] + steps, self.device):
            # captured on a GPU; elsewhere (the CPU's tests) the same operations run as they are
            decoder = cuda_graphs.StaticDecoder(model, cache, attention_mask, steps, graph=self.device.type == "cuda")
            del cache  # the decoder holds the prompt's keys and values in its own buffers
            self._decode_static(decoder, logits, position_ids[:, -1] + 1, params, uniforms, on_tokens, (tokens, logprobs, lengths, stopped), stops, seen)
            return _generations(tokens, logprobs, lengths, stopped)
        active = torch.arange(B, device=self.device)  # original row of each batch row
        cache_kw = self._cache_keyword()
        direct_step = decode_step.for_model(model, cache, products)  # None: the model's own forward decodes
        next_position = position_ids[:, -1] + 1
        for step in range(steps):
            new_tokens, new_logprobs = sample_next(
                logits=logits, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, uniform=uniforms[active, step], min_p=params.min_p,
                seen=seen, repetition_penalty=params.repetition_penalty,
            )
            if seen is not None:
                seen[torch.arange(len(active), device=self.device), new_tokens] = True
            tokens[active, step] = new_tokens
            logprobs[active, step] = new_logprobs.float()
            lengths[active] = step + 1
            if on_tokens:
                on_tokens(len(active))
            done = torch.isin(new_tokens, stop)
            if stops:
                done |= self._stop_string_hits(stops, tokens, active, step, looked_back=1)
            stopped[active[done]] = True
            if step == steps - 1:
                break
            keep = ~done
            if not keep.any():
                break
            if not keep.all():  # finished rows stop costing work
                keep_idx = keep.nonzero().squeeze(-1)
                cache.batch_select_indices(keep_idx)
                active, attention_mask = active[keep_idx], attention_mask[keep_idx]
                new_tokens, next_position = new_tokens[keep_idx], next_position[keep_idx]
                seen = seen[keep_idx] if seen is not None else None
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(active), 1))], dim=1)
            if direct_step is not None:
                logits = direct_step(new_tokens, next_position, attention_mask)
            else:
                out = model(
                    input_ids=new_tokens.unsqueeze(-1), attention_mask=attention_mask,
                    position_ids=next_position.unsqueeze(-1), use_cache=True, **{cache_kw: cache},
                )
                logits = out.logits[:, -1, :]
            next_position = next_position + 1
        return _generations(tokens, logprobs, lengths, stopped)

    def _decode_static(
        self, decoder, logits, first_position, params: SamplingParams, uniforms, on_tokens, out, stops: StopStrings, seen: torch.Tensor | None = None,
    ) -> None:
        """The decode loop over a static batch (`decoder`: rlctl.backends.cuda_graphs): every row
        stays in the batch; a row's tokens count until it stops. Fills `out` = (tokens [B, T],
        log-probs [B, T], lengths [B], stopped [B]) in place. It waits for the device only every
        CHECK_EVERY steps, to report tokens, to look for `stops` in the rows' new tokens and to
        end a batch whose rows have all stopped."""
        from rlctl.backends.cuda_graphs import CHECK_EVERY

        tokens, logprobs, lengths, stopped = out
        stop = torch.tensor(self.stop_ids, device=self.device)
        counted = torch.zeros((), dtype=torch.long, device=self.device)  # tokens not yet reported to on_tokens
        steps = params.max_new_tokens
        for step in range(steps):
            new_tokens, new_logprobs = sample_next(
                logits=logits, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, uniform=uniforms[:, step], min_p=params.min_p,
                seen=seen, repetition_penalty=params.repetition_penalty,
            )
            if seen is not None:
                seen[torch.arange(len(new_tokens), device=self.device), new_tokens] = True
            live = ~stopped
            tokens[:, step] = new_tokens
            logprobs[:, step] = new_logprobs.float()
            lengths.masked_fill_(live, step + 1)
            stopped |= live & torch.isin(new_tokens, stop)
            counted += live.sum()
            last = step == steps - 1
            if last or (step + 1) % CHECK_EVERY == 0:
                if on_tokens:
                    on_tokens(int(counted))
                    counted.zero_()
                if stops and not last:
                    live = (~stopped).nonzero().squeeze(-1)
                    stopped[live[self._stop_string_hits(stops, tokens, live, step, looked_back=CHECK_EVERY)]] = True
                if last or bool(stopped.all()):
                    break
            logits = decoder(new_tokens, first_position + step, step)

    def _stop_string_hits(self, stops: StopStrings, tokens: torch.Tensor, rows: torch.Tensor, step: int, looked_back: int) -> torch.Tensor:
        """Which of `rows` hold a stop string now that step `step` is sampled, looking at the
        tokens of the last `looked_back` steps and the stop strings' length before them. Saves
        the work of generating past a stop string; the cut itself is rlctl.stages.rollout's."""
        first = max(0, step + 1 - looked_back - stops.tail)
        tails = tokens[rows, first:step + 1].tolist()
        hit = stops.hits(tails, lambda i: tokens[rows[i], :step + 1].tolist())
        return torch.tensor(hit, dtype=torch.bool, device=tokens.device)

    def _prompt_pass(self, model, prompt_ids, cache=None):
        """Each distinct prompt's forward once, left-padded, logits at the last position only
        (never [B, L, V] over the prompts); its rows continue from copies of its KV cache
        (`cache`: transformers' DynamicCache unless given). Returns per row: (next-token logits
        [B, V], the cache, attention mask [B, L], positions [B, L])."""
        from transformers import DynamicCache

        distinct, source = distinct_prompts(prompt_ids)
        ids, mask, positions = left_padded(distinct, self.pad_id, self.device)
        cache = DynamicCache() if cache is None else cache
        last_only = positions_to_keep(ids.shape[1] - 1, ids.shape[1], self.device) if self._keeps_logits else {}
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{self._cache_keyword(): cache}, **last_only)
        logits = out.logits[:, -1, :]
        if len(distinct) < len(prompt_ids):
            rows_of = torch.tensor(source, device=self.device)
            cache.batch_select_indices(rows_of)
            logits, mask, positions = logits[rows_of], mask[rows_of], positions[rows_of]
        return logits, cache, mask, positions

    def _cache_keyword(self) -> str:
        """transformers renamed `past_key_values` to `cache`; use whichever forward takes (a
        peft model's forward takes **kwargs and passes them on to its base model's)."""
        base = transformers_model(self.model)
        return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"

    # -- scoring and training ---------------------------------------------------------

    def forward(self, batch: PackedBatch, *, temperature: float, statistic: str | None = None, model=None):
        """Differentiable (log-probs [B, T], each position's `statistic` [B, T] or None: its
        entropy, or Σ p² (rlctl.algos.logprobs.POSITION_STATISTICS)) of the response tokens.
        Over the real tokens only where rlctl.backends.unpadded applies (the LM head at the
        predicting positions only); otherwise transformers' forward, its LM head from the first
        position that predicts a response token on (`logits_to_keep`): never [B, L, V] over the
        prompts. `model`: another copy of the weights to run (the bf16 copy)."""
        model = model or self.model
        direct = unpadded.for_model(model)
        if direct is not None:
            return unpadded.run_as_forward(
                model, lambda: direct.logprobs(direct.states(batch), batch.response_ids, batch.response_mask, temperature=temperature, statistic=statistic),
            )
        start = first_response_logit(batch)
        kept = positions_to_keep(start, batch.input_ids.shape[1], self.device) if start and self._keeps_logits else {}
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids, use_cache=False, **kept)
        logits = response_logits(out.logits, batch, offset=start if kept else 0)
        del out  # the model's logits: the response positions' copy is all that is needed
        return logprobs_and_statistic(logits=logits, tokens=batch.response_ids, temperature=temperature, statistic=statistic)

    def logprobs(
        self, prompt_ids, response_ids, *, temperature: float, batch_size: int = 16, compute_dtype: str = "fp32", as_trained: bool = False,
        batch_tokens: int = 0,
    ) -> list[list[float]]:
        """Log-probs of the responses (`logprobs_with_statistic` without a statistic)."""
        return self.logprobs_with_statistic(
            prompt_ids, response_ids, statistic=None, temperature=temperature, batch_size=batch_size, compute_dtype=compute_dtype,
            as_trained=as_trained, batch_tokens=batch_tokens,
        )[0]

    @torch.no_grad()
    def logprobs_with_statistic(
        self, prompt_ids, response_ids, *, statistic: str | None, temperature: float, batch_size: int = 16, compute_dtype: str = "fp32",
        as_trained: bool = False, batch_tokens: int = 0,
    ) -> tuple[list[list[float]], list[list[float]] | None]:
        """Log-probs of the responses and, from the same forward, each position's `statistic`
        (None: none; "sum_pi_squared": Σ p², the optimal token baseline's), in passes of at
        most `batch_size` rows and `batch_tokens` padded tokens (0: no cap). In bf16 they come
        from a bf16 copy of the weights (the reference: 30% faster than autocast, measured; on
        the CPU with the update's eager attention for short sequences, 7% faster than SDPA's
        kernel), or with `as_trained` under bf16 autocast over the fp32 weights, as the update
        computes them (the old log-probs a PPO ratio divides by; a LoRA reference, the policy's
        module with its adapters disabled). Rows that share a prompt (GRPO's groups) run it
        once (`forward_sharing_prompts`), as the update does."""
        bf16 = decide_dtype(self.device, compute_dtype) == "bf16"
        model = self._bf16.of(self.model) if bf16 and not as_trained and self._scores_from_copy else None
        outputs = 1 if statistic is None else 2

        def score(batch: PackedBatch) -> tuple[torch.Tensor, ...]:
            rows, length = batch.input_ids.shape
            if model is not None:  # the bf16 copy: bf16 weights, the update's bf16 attention
                with bf16_attention(model, self.device, rows=rows, length=length):
                    return self.forward(batch, temperature=temperature, statistic=statistic, model=model)[:outputs]
            with training_forward(self.model, self.device, bf16, rows=rows, length=length):
                return self.forward(batch, temperature=temperature, statistic=statistic)[:outputs]

        def score_sharing_prompts(prompts, responses) -> tuple[torch.Tensor, ...]:
            rows, length = len(prompts), max(len(p) + len(r) for p, r in zip(prompts, responses))
            if model is not None:
                with bf16_attention(model, self.device, rows=rows, length=length):
                    return self.forward_sharing_prompts(prompts, responses, temperature=temperature, statistic=statistic, model=model)[:outputs]
            with training_forward(self.model, self.device, bf16, rows=rows, length=length):
                return self.forward_sharing_prompts(prompts, responses, temperature=temperature, statistic=statistic)[:outputs]

        if self.shares_prompts(prompt_ids):  # as the update runs such rows (Trainer)
            results = tuple([[] for _ in prompt_ids] for _ in range(outputs))
            for rows in batches_by_prompt(prompt_ids, response_ids, batch_size, batch_tokens):
                scores = score_sharing_prompts([prompt_ids[i] for i in rows], [response_ids[i] for i in rows])
                for result, tensor in zip(results, scores):
                    for i, row in zip(rows, tensor.float().cpu().tolist()):
                        result[i] = row[: len(response_ids[i])]
        else:
            results = scored_rows_each(prompt_ids, response_ids, batch_size, self.pad_id, self.device, score, batch_tokens, outputs=outputs)
        return results[0], (results[1] if statistic is not None else None)

    def shares_prompts(self, prompt_ids) -> bool:
        """Whether rows with these prompts run each distinct prompt once (`worth_sharing_prompts`)."""
        if self._parameters is None:  # FSDP2's DTensors count their whole (global) size, so every rank agrees
            self._parameters = sum(p.numel() for p in self.model.parameters())
        return worth_sharing_prompts(prompt_ids, parameters=self._parameters, device_type=self.device.type)

    def forward_sharing_prompts(
        self, prompt_ids, response_ids, *, temperature: float, statistic: str | None = None, model=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward` for rows given as token lists, each distinct prompt's forward run once
        (`_prompt_pass`): its KV cache is copied to the prompt's rows and the responses run on
        top of it; in training the prompt's gradients sum over its rows. The same function as
        one full-sequence forward per row by other kernels (fp32: within ~3e-6). Returns
        [B, T] right-padded to the longest response, as `forward` does for `pack`'s batch."""
        model = model or self.model
        length = max((len(r) for r in response_ids), default=0)
        width = max(length, 1)  # no response token at all: the same two calls (FSDP ranks keep step), cut to [B, 0]
        responses = torch.full((len(prompt_ids), width), self.pad_id, dtype=torch.long)
        response_mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
        for i, r in enumerate(response_ids):
            responses[i, : len(r)] = torch.tensor(list(r), dtype=torch.long)
            response_mask[i, : len(r)] = 1
        responses, response_mask = responses.to(self.device), response_mask.to(self.device)
        direct = unpadded.for_model(model)
        if direct is not None:
            distinct, source = distinct_prompts(prompt_ids)

            def compute():
                states = direct.states_sharing_prompts(left_padded(distinct, self.pad_id, self.device), source, responses, response_mask)
                return direct.logprobs(states, responses, response_mask, temperature=temperature, statistic=statistic)

            logp, value = unpadded.run_as_forward(model, compute)
            return logp[:, :length], (value[:, :length] if statistic is not None else None)
        first, cache, prompt_mask, prompt_positions = self._prompt_pass(model, prompt_ids)
        positions = prompt_positions[:, -1:] + 1 + torch.arange(width, device=self.device)
        out = model(
            input_ids=responses, attention_mask=torch.cat([prompt_mask, response_mask], dim=1),
            position_ids=positions, use_cache=True, **{self._cache_keyword(): cache},
        )
        logits = torch.cat([first.unsqueeze(1), out.logits[:, : length - 1]], dim=1)[:, :length]  # position t predicts token t + 1
        del out, first
        return logprobs_and_statistic(logits=logits, tokens=responses[:, :length], temperature=temperature, statistic=statistic)


class ValueModel(torch.nn.Module):
    """A causal LM's decoder with a scalar value head: the critic for GAE."""

    def __init__(self, lm) -> None:
        super().__init__()
        self.lm = lm
        self.value_head = torch.nn.Linear(lm.config.hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)
        cpu_linear.install(self)

    @classmethod
    def load(cls, uri: str, device: torch.device) -> ValueModel:
        from safetensors.torch import load_file

        lm, _ = load_causal_lm(uri, device)
        critic = cls(lm).to(device)
        head = Path(uri) / VALUE_HEAD_FILE
        if head.exists():  # a fresh critic (a plain LM folder) starts from a zero head
            critic.value_head.load_state_dict(load_file(str(head), device=str(device)))
        critic.eval()
        return critic

    @property
    def vocab_size(self) -> int:
        return int(self.lm.get_input_embeddings().num_embeddings)

    def save(self, directory: str | Path) -> None:
        from safetensors.torch import save_file

        self.lm.save_pretrained(directory)
        state = {k: v.detach().cpu().contiguous() for k, v in self.value_head.state_dict().items()}
        save_file(state, str(Path(directory) / VALUE_HEAD_FILE))

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """Values [B, T] of the state before each response token (zeros in padded slots where
        the unpadded forward runs)."""
        direct = unpadded.for_model(self.lm)
        if direct is not None:
            return unpadded.scattered(batch.response_mask, self.value_head(direct.states(batch).float()).squeeze(-1))
        out = self.lm.base_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids, use_cache=False)
        hidden = response_hidden(out.last_hidden_state, batch)
        return self.value_head(hidden.float()).squeeze(-1)

    @torch.no_grad()
    def values(
        self, prompt_ids, response_ids, *, pad_id: int, batch_size: int = 16, compute_dtype: str = "fp32", batch_tokens: int = 0,
    ) -> list[list[float]]:
        """Values as the update computes them (its forward context: the old values it clips to),
        in passes as `HFPolicy.logprobs` makes them."""
        device = self.value_head.weight.device
        bf16 = decide_dtype(device, compute_dtype) == "bf16"

        def score(batch: PackedBatch) -> torch.Tensor:
            rows, length = batch.input_ids.shape
            with training_forward(self.lm, device, bf16, rows=rows, length=length):
                return self.forward(batch)

        return scored_rows(prompt_ids, response_ids, batch_size, pad_id, device, score, batch_tokens)


def read_trainer_step(uri: str) -> int:
    """The optimizer step of these weights: a checkpoint's trainer state, or the step that
    `reshard` recorded for rollout weights; 0 for a plain HF folder."""
    from rlctl import trainer_state
    from rlctl.checkpoint import STATE_DIR, verify_checkpoint
    from rlctl.shards import read_manifest

    verify_checkpoint(uri)
    if (Path(uri) / STATE_DIR).is_dir():
        return trainer_state.read_document(Path(uri) / STATE_DIR)["step"]
    if (Path(uri) / "_manifest.json").exists():
        value = read_manifest(uri)[0].state.get("policy_version", 0)
        return value if isinstance(value, int) else 0
    return 0
