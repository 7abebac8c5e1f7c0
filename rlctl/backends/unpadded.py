"""Scoring and training forwards over a batch's real tokens only: no product, norm or MLP runs
on padding.

A batch padded to its longest row runs every linear layer on its padded slots too: at TRL's
harness shape (64 responses of at most 64 tokens, some ending early) 5–12% of the update's and
the reference's products, and far more where response lengths spread, as they do once a policy
learns when to stop (verl removes padding for the same reason). Here the decoder layers of the
Llama layout (rlctl.backends.llama_layers) run on the real tokens as one [N, D] matrix, through
the model's own modules (norms, products, gated MLPs, rotary embedding); only the attention sees
the padded [B, H, T, d] layout, through the model's attention function, its padded slots zero
and masked. The final norm and the LM head (or a critic's value head) run only on the positions
that predict a response token. The same function as transformers' forward with other row
blockings in the products (fp32 log-probs within ~1.4e-6; tests/unit/test_unpadded.py). Small
preset, 64 rows: a training pass 0.95× / 0.82× / 0.53× transformers' time at 1% / 22% / 50%
padding (bench/unpadded_bench.py, bench/RESULTS.md).

`HFPolicy.forward`, `HFPolicy.forward_sharing_prompts` and `ValueModel.forward` run it wherever
it applies (`for_model`): the update, the reference and old log-probs of `score`, the critic's
values, in fp32 and in bf16. Elsewhere (LoRA adapters, FSDP's hooks, other model classes or
attention kernels) transformers' forward runs.
`RLCTL_UNPADDED_FORWARD=transformers` keeps transformers' forward (to compare, or to debug).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlctl.algos.logprobs import logprobs_and_entropy
from rlctl.backends import decode_attention
from rlctl.backends.llama_layers import call, layer_parts, plain_layers
from rlctl.errors import InputError

OVERRIDE_ENV = "RLCTL_UNPADDED_FORWARD"
CHOICES = ("rlctl", "transformers")
# transformers' attention functions whose masks this module builds: SDPA's (and rlctl's CPU
# decode attention, which hands anything but one eval-mode query token to SDPA) take a bool
# mask, the eager one an additive mask in the model's dtype
ATTENTION = ("sdpa", "eager", decode_attention.NAME)


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
    """The unpadded forward of `model`, or None where transformers' forward must run: another
    model class or layer kind, hooks (FSDP) or LoRA layers, gradient checkpointing, an
    attention implementation other than ATTENTION, or RLCTL_UNPADDED_FORWARD."""
    choice = os.environ.get(OVERRIDE_ENV, "").strip().lower() or "rlctl"
    if choice not in CHOICES:
        raise InputError(f"{OVERRIDE_ENV}={choice!r}: use one of {', '.join(CHOICES)}")
    if choice != "rlctl" or getattr(model.config, "_attn_implementation", None) not in ATTENTION:
        return None
    if getattr(model, "is_activation_checkpointing", False) or not plain_layers(model):  # transformers ≥ 5's name
        return None
    return UnpaddedForward(model)


class UnpaddedForward:
    """A causal LM of the Llama layout run over real tokens (see the module's docstring). Made
    per forward: the attention implementation in force (`training_forward`'s) is read here."""

    def __init__(self, model) -> None:
        base = model.model
        self.embed, self.rotary, self.norm, self.lm_head = base.embed_tokens, base.rotary_emb, base.norm, model.lm_head
        code = sys.modules[type(model).__module__]
        self.apply_rotary = code.apply_rotary_pos_emb
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        implementation = model.config._attn_implementation
        self.attention = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, code.eager_attention_forward)
        self.additive_mask = implementation == "eager"
        self.layers = [layer_parts(layer) for layer in base.layers]

    def states(self, batch) -> torch.Tensor:
        """The final norm's output at the positions predicting a `pack`ed batch's response tokens
        [M, D] (the M tokens of `response_mask`, row-major)."""
        slots = Slots.of(batch.attention_mask)
        hidden, _ = self.hidden(batch.input_ids, slots, batch.position_ids)
        rows, length = batch.input_ids.shape
        predicting = (torch.arange(rows, device=hidden.device).unsqueeze(-1) * length + batch.logit_index)[batch.response_mask]
        return call(self.norm, hidden.index_select(0, slots.rank[predicting]))

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
        return call(self.norm, candidates.index_select(0, where[response_mask.bool()]))

    def logprobs(
        self, states: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor, *, temperature: float, with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The LM head on `states` [M, D] (`states`' output for the M response tokens of `mask`
        [B, T]): (log-probs, entropy or None) [B, T], zeros in the padded slots."""
        mask = mask.bool()
        logits = call(self.lm_head, states)
        logp, entropy = logprobs_and_entropy(logits=logits, tokens=tokens[mask], temperature=temperature, with_entropy=with_entropy)
        return scattered(mask, logp), (scattered(mask, entropy) if with_entropy else None)

    def hidden(
        self, ids: torch.Tensor, slots: Slots, positions: torch.Tensor, *, past: Past | None = None, keep_kv: bool = False,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """The last decoder layer's output at the real tokens of `ids` [B, T] ([N, D], before the
        final norm), attending to `past` first; with `keep_kv` each layer's keys and values
        [B, H_kv, T, d] (zeros in the padded slots)."""
        hidden = call(self.embed, slots.compact(ids))
        cos, sin = self.rotary(hidden, slots.compact(positions).unsqueeze(0))
        cos, sin = cos[0], sin[0]
        mask = self._mask(slots.valid, None if past is None else past.valid, hidden.dtype)
        kv: list[tuple[torch.Tensor, torch.Tensor]] | None = [] if keep_kv else None
        for i, layer in enumerate(self.layers):
            x = call(layer.input_norm, hidden)
            heads = (-1, layer.head_dim)  # unflattened from a row's width: no token at all (a pass of empty responses) is fine
            q, k, v = (call(proj, x).unflatten(-1, heads) for proj in (layer.q_proj, layer.k_proj, layer.v_proj))
            if layer.q_norm is not None:
                q, k = call(layer.q_norm, q), call(layer.k_norm, k)
            q, k = self.apply_rotary(q, k, cos, sin)
            q, k, v = (slots.padded(t).transpose(1, 2) for t in (q, k, v))
            if past is not None:
                k, v = torch.cat([past.keys[i], k], dim=2), torch.cat([past.values[i], v], dim=2)
            if kv is not None:
                kv.append((k, v))
            attention = layer.attention
            dropout = attention.attention_dropout if attention.training else 0.0
            attended, _ = self.attention(attention, q, k, v, mask, dropout=dropout, scaling=layer.scaling)
            hidden = hidden + call(layer.o_proj, slots.compact(attended).flatten(1))
            hidden = hidden + call(layer.mlp, call(layer.post_norm, hidden))
        return hidden, kv

    def _mask(self, valid: torch.Tensor, past_valid: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, T, P + T]: a token attends to the real `past` positions, then causally to the
        real tokens of its row. A padded slot also attends to itself, so no row of the softmax is
        empty (its output is dropped)."""
        width = valid.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool, device=valid.device).tril()
        allowed = (causal & valid.unsqueeze(1)) | torch.eye(width, dtype=torch.bool, device=valid.device)
        if past_valid is not None:
            allowed = torch.cat([past_valid.unsqueeze(1).expand(-1, width, -1), allowed], dim=-1)
        allowed = allowed.unsqueeze(1)
        if not self.additive_mask:
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=valid.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def scattered(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """values [M] of the M True slots of `mask` [B, T] (row-major) → [B, T], zeros elsewhere."""
    return values.new_zeros(mask.shape).masked_scatter(mask.bool(), values)
