"""Scoring and training forwards over a batch's real tokens only: no product, norm or MLP runs
on padding.

A batch padded to its longest row runs every linear layer on its padded slots too: at TRL's
harness shape (64 responses of at most 64 tokens, some ending early) 5–12% of the update's and
the reference's products, and far more where response lengths spread, as they do once a policy
learns when to stop (verl removes padding for the same reason). Here the real tokens of the
Llama layout's models (rlctl.backends.llama_layers) are packed into one sequence [1, N, D] and
the model's own decoder layers run on it as modules (their products, norms, gated MLPs, a LoRA
adapter's layers, FSDP2's hooks); only the attention (`packed_attention`, which the layers are
given for the forward) pads q, k and v to [B, H, T, d], zeros in the padded slots, and attends
with the model's own attention function and a mask per row (on the CPU with
rlctl.backends.grouped_attention's, which repeats no keys or values; with `update.compile` the
layers run compiled, rlctl.backends.compiled_layers). The final norm and the LM head (or a
critic's value head) run only on the positions that predict a response token. The same function
as transformers' forward with other row blockings in the products (fp32 log-probs within
~1.4e-6; tests/unit/test_unpadded.py). Small preset, 64 rows: a training pass 0.95× / 0.82× /
0.53× transformers' time at 1% / 22% / 50% padding (bench/unpadded_bench.py, bench/RESULTS.md).

`HFPolicy.forward`, `HFPolicy.forward_sharing_prompts` and `ValueModel.forward` run it wherever
it applies (`for_model`): the update, the reference and old log-probs of `score`, the critic's
values, in fp32 and in bf16, in one process and on FSDP2 ranks, with or without LoRA. Elsewhere
(other model classes or attention kernels, activation checkpointing) transformers' forward runs.
`RLCTL_UNPADDED_FORWARD=transformers` keeps transformers' forward (to compare, or to debug).
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from rlctl.algos.logprobs import logprobs_and_statistic
from rlctl.backends import compiled_layers, decode_attention, grouped_attention
from rlctl.backends.llama_layers import MODEL_CLASSES, SCORER_CLASSES, layout_class, llama_layout
from rlctl.errors import InputError
from rlctl.lora import transformers_model

OVERRIDE_ENV = "RLCTL_UNPADDED_FORWARD"
CHOICES = ("rlctl", "transformers")
NAME = "rlctl_unpadded"  # the packed attention's name among transformers' attention functions
COMPILED_NAME = "rlctl_unpadded_compiled"  # the same, called from compiled layers (rlctl.backends.compiled_layers)
FSDP_METHOD = "_rlctl_unpadded_forward"  # the forward method registered with an FSDP2 module (run_as_forward)
T = TypeVar("T")
# transformers' attention functions whose masks this module builds: SDPA's (and rlctl's CPU
# decode attention, which hands anything but one eval-mode query token to SDPA) take a bool
# mask, the eager one an additive mask in the model's dtype
ATTENTION = ("sdpa", "eager", decode_attention.NAME)
LAYOUTS = MODEL_CLASSES + SCORER_CLASSES  # causal LMs, and reward models on their decoders


@dataclass(frozen=True)
class Slots:
    """Where the real tokens of a [B, T] block sit (`valid`), and the two layouts of its
    tokens: compact [N, ...] (row-major order) and padded [B, T, ...] (zeros where invalid)."""

    valid: torch.Tensor  # [B, T] bool
    index: torch.Tensor  # [N] the real tokens' flat positions in the block
    rank: torch.Tensor  # [B * T] each flat position's place among the real tokens

    @classmethod
    def of(cls, valid: torch.Tensor) -> Slots:
        valid = valid.bool()
        flat = valid.flatten()
        return cls(valid, flat.nonzero().squeeze(-1), flat.long().cumsum(0) - 1)

    @property
    def full(self) -> bool:
        return self.index.numel() == self.valid.numel()

    def compact(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] → [N, ...]"""
        flat = x.reshape(-1, *x.shape[2:])
        return flat if self.full else flat.index_select(0, self.index)

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] → [B, T, ...], zeros in the padded slots."""
        rows, width = self.valid.shape
        if not self.full:
            x = x.new_zeros(rows * width, *x.shape[1:]).index_copy(0, self.index, x)
        return x.view(rows, width, *x.shape[1:])


@dataclass(frozen=True)
class Past:
    """Keys and values every row attends to before its own tokens (a shared prompt's, copied to
    its rows): per layer [B, H_kv, P, d], and which of the P positions are real [B, P]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    valid: torch.Tensor


def for_model(model) -> UnpaddedForward | None:
    """The unpadded forward of `model` (a LoRA model's base model with its adapters, an FSDP2
    module: `run_as_forward`), or None where transformers' forward must run: another model
    class or layer kind, activation checkpointing, an attention implementation other than
    ATTENTION, or RLCTL_UNPADDED_FORWARD."""
    choice = os.environ.get(OVERRIDE_ENV, "").strip().lower() or "rlctl"
    if choice not in CHOICES:
        raise InputError(f"{OVERRIDE_ENV}={choice!r}: use one of {', '.join(CHOICES)}")
    base = transformers_model(model)
    implementation = getattr(base.config, "_attn_implementation", None)
    if choice != "rlctl" or implementation not in ATTENTION or not llama_layout(base, LAYOUTS):
        return None
    # a checkpointed layer reruns its attention in the backward, after the forward has put the
    # model's own attention back. The packed attention is switched on through the model's
    # config, which every layer must read.
    if checkpointing(base) or any(a.config is not base.config for a in attention_modules(base)):
        return None
    return UnpaddedForward(base, implementation)


def run_as_forward(module: torch.nn.Module, compute: Callable[[], T]) -> T:
    """compute() as a forward of `module`: for an FSDP2 module inside its forward hooks (its own
    parameters, the embeddings, final norm and LM head, gathered before; resharded and their
    gradients reduced after, as for `module(...)`); otherwise simply compute(). The decoder
    layers are called as modules, so their own FSDP2 hooks run in any case."""
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    if not isinstance(module, FSDPModule):
        return compute()
    if FSDP_METHOD not in vars(module):
        setattr(module, FSDP_METHOD, types.MethodType(lambda self, f: f(), module))
        register_fsdp_forward_method(module, FSDP_METHOD)
    return getattr(module, FSDP_METHOD)(compute)


class UnpaddedForward:
    """A causal LM of the Llama layout run over real tokens (see the module's docstring). Made
    per forward: the attention implementation in force (`training_forward`'s) is the one the
    packed attention pads for."""

    def __init__(self, model, implementation: str) -> None:
        self.model = model
        self.decoder, self.lm_head = model.model, getattr(model, "lm_head", None)  # a reward model has a `score` head instead
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        code = sys.modules[layout_class(model, LAYOUTS).__module__]
        self.implementation = implementation
        self.attend = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, code.eager_attention_forward)

    def states(self, batch) -> torch.Tensor:
        """The final norm's output at the positions predicting a `pack`ed batch's response tokens
        [M, D] (the M tokens of `response_mask`, row-major)."""
        slots = Slots.of(batch.attention_mask)
        hidden, _ = self.hidden(batch.input_ids, slots, batch.position_ids)
        rows, length = batch.input_ids.shape
        predicting = (torch.arange(rows, device=hidden.device).unsqueeze(-1) * length + batch.logit_index)[batch.response_mask]
        return self.decoder.norm(hidden.index_select(0, slots.rank[predicting]))

    def states_sharing_prompts(
        self, prompts: tuple[torch.Tensor, torch.Tensor, torch.Tensor], rows_of: Sequence[int], responses: torch.Tensor, response_mask: torch.Tensor,
    ) -> torch.Tensor:
        """`states` for rows whose prompts run once each: `prompts` the distinct prompts left-
        padded (ids, attention mask, positions [P, L]), `rows_of` each row's prompt, `responses`
        and `response_mask` [B, T] right-padded. The prompts' keys and values are copied to their
        rows (in training their gradients sum over the rows)."""
        ids, mask, positions = prompts
        prompt_slots = Slots.of(mask)
        prompt_hidden, kv = self.hidden(ids, prompt_slots, positions, keep_kv=True)
        rows = None if list(rows_of) == list(range(len(ids))) else torch.tensor(list(rows_of), device=ids.device)

        def per_row(t: torch.Tensor) -> torch.Tensor:
            return t if rows is None else t.index_select(0, rows)

        past = Past([per_row(k) for k, _ in kv], [per_row(v) for _, v in kv], per_row(mask).bool())
        batch_rows, width = responses.shape
        response_positions = per_row(positions)[:, -1:] + 1 + torch.arange(width, device=ids.device)
        slots = Slots.of(response_mask)
        hidden, _ = self.hidden(responses, slots, response_positions, past=past)
        # response token 0 is predicted at its prompt's last position (left padding: the last
        # column), token t ≥ 1 at response position t − 1
        last = prompt_hidden.index_select(0, prompt_slots.rank[torch.arange(1, len(ids) + 1, device=ids.device) * ids.shape[1] - 1])
        candidates = torch.cat([per_row(last), hidden])
        flat = torch.arange(batch_rows * width, device=ids.device).view(batch_rows, width)
        previous = batch_rows + slots.rank[(flat - 1).clamp(min=0)]
        first = torch.arange(batch_rows, device=ids.device).unsqueeze(-1).expand(-1, width)
        where = torch.where(torch.arange(width, device=ids.device) == 0, first, previous)
        return self.decoder.norm(candidates.index_select(0, where[response_mask.bool()]))

    def logprobs(
        self, states: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor, *, temperature: float, statistic: str | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The LM head on `states` [M, D] (`states`' output for the M response tokens of `mask`
        [B, T]): (log-probs, the `statistic` (its entropy, Σ p²) or None) [B, T], zeros in the
        padded slots."""
        mask = mask.bool()
        logp, value = logprobs_and_statistic(logits=self.lm_head(states), tokens=tokens[mask], temperature=temperature, statistic=statistic)
        return scattered(mask, logp), (scattered(mask, value) if statistic is not None else None)

    def hidden(
        self, ids: torch.Tensor, slots: Slots, positions: torch.Tensor, *, past: Past | None = None, keep_kv: bool = False,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """The last decoder layer's output at the real tokens of `ids` [B, T] ([N, D], before the
        final norm), attending to `past` first; with `keep_kv` each layer's keys and values
        [B, H_kv, T, d] (zeros in the padded slots). The layers run as modules (their hooks, a
        LoRA adapter's layers) on the real tokens packed as one sequence [1, N, D]."""
        from rlctl.backends.hf import attention_implementation

        if slots.index.numel() == 0:  # no real token (a pass of empty responses): one padded slot
            # runs instead, its output never read, so every layer is still called (FSDP ranks gather together)
            only_first = torch.zeros_like(slots.valid)
            only_first[0, 0] = True
            slots = Slots.of(only_first)
        hidden = self.decoder.embed_tokens(slots.compact(ids)).unsqueeze(0)
        position_embeddings = self.decoder.rotary_emb(hidden, slots.compact(positions).unsqueeze(0))
        rows, width = slots.valid.shape
        keys = width + (0 if past is None else past.valid.shape[1])
        instead = grouped_attention.for_forward(self.implementation, hidden.device, rows * self.model.config.num_attention_heads * width * keys)
        attend, additive = instead or (self.attend, self.implementation == "eager")
        mask = self._mask(slots.valid, None if past is None else past.valid, hidden.dtype, additive=additive)
        packing = Packing(slots, mask, attend, past, keep_kv)
        compiled = compiled_layers.compiled_forward(self.model)
        if compiled is not None:
            with attention_implementation(self.model, register(compiled=True)), compiled_layers.attending(packing):
                for layer in self.decoder.layers:
                    hidden = compiled(layer, hidden, *position_embeddings)
        else:
            with attention_implementation(self.model, register()):
                for layer in self.decoder.layers:
                    hidden = layer(hidden, attention_mask=packing, position_embeddings=position_embeddings)
        kv = None if packing.kept is None else [packing.kept[i] for i in range(len(self.decoder.layers))]
        return hidden[0], kv

    @staticmethod
    def _mask(valid: torch.Tensor, past_valid: torch.Tensor | None, dtype: torch.dtype, *, additive: bool) -> torch.Tensor:
        """[B, 1, T, P + T]: a token attends to the real `past` positions, then causally to the
        real tokens of its row. A padded slot also attends to itself, so no row of the softmax is
        empty (its output is dropped)."""
        width = valid.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool, device=valid.device).tril()
        allowed = (causal & valid.unsqueeze(1)) | torch.eye(width, dtype=torch.bool, device=valid.device)
        if past_valid is not None:
            allowed = torch.cat([past_valid.unsqueeze(1).expand(-1, width, -1), allowed], dim=-1)
        allowed = allowed.unsqueeze(1)
        if not additive:
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=valid.device).masked_fill_(~allowed, torch.finfo(dtype).min)


class Packing:
    """What the packed attention needs besides q, k and v; handed to the layers as their
    `attention_mask`, which they pass on to the attention function untouched. A plain class, not
    a dataclass: FSDP2's forward hooks rebuild the dataclasses, lists and dicts in a module's
    arguments, so the keys and values `kept` here would go to a copy."""

    __slots__ = ("slots", "mask", "attend", "past", "kept")

    def __init__(self, slots: Slots, mask: torch.Tensor, attend: Callable, past: Past | None, keep_kv: bool) -> None:
        self.slots = slots
        self.mask = mask  # [B, 1, T, P + T] for `attend`
        self.attend = attend  # the model's own attention function (SDPA's, eager, rlctl's decode attention)
        self.past = past
        self.kept: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = {} if keep_kv else None  # layer index → its padded keys and values


def packed_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Packing,
    dropout: float = 0.0, scaling: float | None = None, **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over the packed layout: query [1, H, N, d],
    key/value [1, H_kv, N, d] → [1, N, H, d]. Pads q, k and v to [B, H, T, d] (zeros in the
    padded slots), prepends the past's keys and values, attends with the packing's function
    and keeps the real tokens' outputs. Compiled layers pass no mask: theirs is
    rlctl.backends.compiled_layers' current packing."""
    packing = attention_mask if attention_mask is not None else compiled_layers.current_packing()
    if not isinstance(packing, Packing):
        raise TypeError(f"{NAME} attends only within rlctl's unpadded forward (got a {type(packing).__name__} mask)")
    q, k, v = (packing.slots.padded(t[0].transpose(0, 1)).transpose(1, 2) for t in (query, key, value))
    layer = module.layer_idx
    if packing.past is not None:
        k, v = torch.cat([packing.past.keys[layer], k], dim=2), torch.cat([packing.past.values[layer], v], dim=2)
    if packing.kept is not None:
        packing.kept[layer] = (k, v)
    attended, _ = packing.attend(module, q, k, v, packing.mask, dropout=dropout, scaling=scaling)
    return packing.slots.compact(attended).unsqueeze(0), None


def register(*, compiled: bool = False) -> str:
    """Make NAME a transformers attention implementation (idempotent); returns it. `compiled`:
    COMPILED_NAME, the same attention left out of torch.compile's graphs (its packing is
    Python state that changes with every batch)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if compiled:
        if COMPILED_NAME not in ALL_ATTENTION_FUNCTIONS:
            ALL_ATTENTION_FUNCTIONS.register(COMPILED_NAME, torch.compiler.disable(packed_attention))
        return COMPILED_NAME
    ALL_ATTENTION_FUNCTIONS.register(NAME, packed_attention)
    return NAME


def checkpointing(model) -> bool:
    """Whether `model`'s layers checkpoint their activations, by transformers' newer name for
    the flag or, before it (transformers ≤ 5.19), the older one."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):  # on the class: the older name warns when read where both exist
            return bool(getattr(model, name))
    return False


def attention_modules(model) -> list[torch.nn.Module]:
    return [layer.self_attn for layer in model.model.layers]


def scattered(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """values [M] of the M True slots of `mask` [B, T] (row-major) → [B, T], zeros elsewhere."""
    return values.new_zeros(mask.shape).masked_scatter(mask.bool(), values)
