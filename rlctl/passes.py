"""How the update cuts a mini-batch into forward/backward passes: at most `micro_batch_size`
rows, and at most `micro_batch_tokens` padded tokens (rows × the pass's longest row).

The token cap is for the CPU. There a pass whose activations outgrow the caches spends its
time moving them: small preset, 64 rows × ~270 tokens in one pass (~17k padded tokens), the
update took 28–29 s, the same rows in passes of 8 or 16 (2–4k tokens) 19–21 s, with the same
gradients to float rounding (bench/RESULTS.md "Passes capped by tokens"); at 64 × 76 tokens
(~4.9k) the pass size made no difference. A GPU wants its passes as large as memory allows, so
"auto" caps only the CPU. The loss normalisers are the mini-batch's, so how the passes are cut
changes no gradient beyond float rounding (rlctl.trainer).

On the CPU "auto" also keeps a pass's activations within the machine's memory: a model of
Qwen2.5-0.5B's shape at 4096 tokens held 19.8 GB in one update and its pipeline 24.1 GB of a
24 GB machine (the reference's weights then read from disk again each iteration); at 2048 tokens
the update held 15.5 GB and ran 4% slower. `memory_cap` lowers the cap to what fits
(bench/RESULTS.md "Passes that fit in memory").
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from rlctl.dtypes import AUTO

CPU_MICRO_BATCH_TOKENS = 4096  # flat from 1k to 4k tokens per pass on the runs above, slower from ~8k
TOKEN_STEP = 256  # a memory cap is a multiple of this, and at least this
MEMORY_SHARE = 0.75  # of the machine's memory, what the training state and one pass may take
TRAINING_BYTES_PER_PARAMETER = 16  # fp32 weights, their gradients and AdamW's two moments
REFERENCE_BYTES_PER_PARAMETER = 4  # a reference model's fp32 weights


@dataclass(frozen=True)
class ModelShape:
    """What a decoder's training memory grows with, from its transformers config."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    kv_width: int  # key (= value) heads × head size
    tied: bool

    @classmethod
    def of(cls, config: Mapping) -> ModelShape | None:
        """From a config's fields (config.json's, or a loaded config's `to_dict()`); None where
        one is missing (a model of another layout: no estimate)."""
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            head_dim = int(config.get("head_dim") or hidden // heads)
            return cls(
                vocab=int(config["vocab_size"]), hidden=hidden, intermediate=int(config["intermediate_size"]),
                layers=int(config["num_hidden_layers"]), kv_width=int(config.get("num_key_value_heads") or heads) * head_dim,
                tied=bool(config.get("tie_word_embeddings", True)),
            )
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            return None

    @classmethod
    def of_folder(cls, folder: str | Path) -> ModelShape | None:
        """From a model folder's config.json; None where it has none (a model made later: its
        preset's shape is `of` the preset's config) or it does not parse."""
        try:
            return cls.of(json.loads(Path(folder, "config.json").read_text()))
        except (OSError, ValueError):
            return None

    @classmethod
    def of_model(cls, model) -> ModelShape | None:
        """From a loaded model's config (a LoRA model's is its base model's)."""
        config = getattr(model, "config", None)
        return cls.of(config.to_dict()) if hasattr(config, "to_dict") else None

    @property
    def parameters(self) -> int:
        """Its weights' count: embeddings, and per layer the q/o (hidden²), k/v and gated-MLP
        products (norms and biases left out)."""
        per_layer = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_width + 3 * self.hidden * self.intermediate
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * per_layer

    @property
    def pass_bytes_per_token(self) -> int:
        """The memory a training pass holds per token, fp32: what each layer keeps for the
        backward (~10 hidden-wide and 3 MLP-wide vectors) and the LM head's logits with their
        gradient. Measured: 3.05 MB per token at Qwen2.5-0.5B's shape, this gives 3.48 MB."""
        return 4 * (self.layers * (10 * self.hidden + 3 * self.intermediate) + 2 * self.vocab)


def memory_cap(shape: ModelShape, memory: int, critic: ModelShape | None = None, ranks: int = 1) -> int:
    """The padded tokens a CPU pass may hold so that the training state and one pass's
    activations per rank stay within MEMORY_SHARE of `memory` bytes: a multiple of TOKEN_STEP,
    at least TOKEN_STEP, at most CPU_MICRO_BATCH_TOKENS. The state: the policy's weights,
    gradients and AdamW moments (whole, or FSDP2 shards that add up to it), a reference per rank,
    and a `critic`'s own (with LoRA only the adapters have gradients and moments: the cap comes
    out lower than it needs to be); a pass holds the policy's activations or the critic's (they
    run one after the other), and `ranks` on this machine run their passes at once."""
    state = (TRAINING_BYTES_PER_PARAMETER + REFERENCE_BYTES_PER_PARAMETER * ranks) * shape.parameters
    state += TRAINING_BYTES_PER_PARAMETER * critic.parameters if critic else 0
    per_token = max(shape.pass_bytes_per_token, critic.pass_bytes_per_token if critic else 0) * ranks
    tokens = int((MEMORY_SHARE * memory - state) // per_token) // TOKEN_STEP * TOKEN_STEP
    return max(TOKEN_STEP, min(CPU_MICRO_BATCH_TOKENS, tokens))


def ranks_at_once(workers) -> int:
    """The training ranks that run their passes at once on one machine for a WorkersConfig: a
    Ray group's (all on this machine, as an embedded Ray has them; a cluster's machines each
    hold fewer, so its cap is only lower than it needs to be), or one."""
    return workers.num_workers if workers.backend == "ray" else 1


def machine_memory(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The memory this process's machine offers in bytes: its physical memory, capped by a
    cgroup v2/v1 memory limit; None where unknown."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        return None
    for limit in (root / "memory.max", root / "memory" / "memory.limit_in_bytes"):
        try:
            text = limit.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            return min(physical, int(text))
    return physical


def decided_micro_batch_tokens(
    value: str, device: str, shape: ModelShape | None = None, *, critic: ModelShape | None = None, ranks: int = 1, memory: int | None = None,
) -> str:
    """`update.micro_batch_tokens` with "auto" decided for `device` ("cpu", "cuda", ...), as the
    config spells it: "0" (no cap) on a GPU; on the CPU CPU_MICRO_BATCH_TOKENS, lowered for a
    policy of `shape` (and a `critic`, `ranks` on one machine) to what fits in `memory` bytes
    (None: this machine's, `machine_memory`); unknown shape or memory: no lowering."""
    if value != AUTO:
        return value
    if device != "cpu":
        return "0"
    if shape is None:  # a critic trained alone (the critic's own pool of ranks)
        shape, critic = critic, None
    memory = memory if memory is not None else machine_memory()
    if shape is None or memory is None:
        return str(CPU_MICRO_BATCH_TOKENS)
    return str(memory_cap(shape, memory, critic, ranks))


def as_recorded(value: str) -> str:
    """A recorded `update.micro_batch_tokens` as the run used it: "auto" was recorded only before
    the key existed (since then a run records what it decided), and those runs had no cap."""
    return "0" if value == AUTO else value


def token_cap(value: str, device: str, shape: ModelShape | None = None, critic: ModelShape | None = None) -> int:
    """The padded tokens a pass may hold on `device` for a policy of `shape` (and a `critic`);
    0: no cap."""
    return int(decided_micro_batch_tokens(value, device, shape, critic=critic))


def cut_passes(rows: Sequence[int], micro_batch_size: int, lengths: Sequence[int] | None, max_tokens: int = 0) -> list[list[int]]:
    """`rows`, in their order, cut into passes of at most `micro_batch_size` rows whose padded
    size (rows × the longest row's `lengths`) stays within `max_tokens` (0: no cap). A row longer
    than the cap gets a pass of its own."""
    passes: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for row in rows:
        length = lengths[row] if lengths is not None else 0
        wider = max(longest, length)
        if current and (len(current) == micro_batch_size or (max_tokens and (len(current) + 1) * wider > max_tokens)):
            passes.append(current)
            current, wider = [], length
        current.append(row)
        longest = wider
    if current:
        passes.append(current)
    return passes
