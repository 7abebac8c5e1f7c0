"""How the update cuts a mini-batch into forward/backward passes: at most `micro_batch_size`
rows, and at most `micro_batch_tokens` padded tokens (rows × the pass's longest row).

The token cap is for the CPU. There a pass whose activations outgrow the caches spends its
time moving them: small preset, 64 rows × ~270 tokens in one pass (~17k padded tokens), the
update took 28–29 s, the same rows in passes of 8 or 16 (2–4k tokens) 19–21 s, with the same
gradients to float rounding (bench/RESULTS.md "Passes capped by tokens"); at 64 × 76 tokens
(~4.9k) the pass size made no difference. A GPU wants its passes as large as memory allows, so
"auto" caps only the CPU. The loss normalisers are the mini-batch's, so how the passes are cut
changes no gradient beyond float rounding (rlctl.trainer).
"""

from __future__ import annotations

from collections.abc import Sequence

from rlctl.dtypes import AUTO

CPU_MICRO_BATCH_TOKENS = 4096  # flat from 1k to 4k tokens per pass on the runs above, slower from ~8k


def decided_micro_batch_tokens(value: str, device: str) -> str:
    """`update.micro_batch_tokens` with "auto" decided for `device` ("cpu", "cuda", ...), as the
    config spells it: the CPU's cap, or "0" (no cap) on a GPU."""
    if value != AUTO:
        return value
    return str(CPU_MICRO_BATCH_TOKENS) if device == "cpu" else "0"


def as_recorded(value: str) -> str:
    """A recorded `update.micro_batch_tokens` as the run used it: "auto" was recorded only before
    the key existed (since then a run records what it decided), and those runs had no cap."""
    return "0" if value == AUTO else value


def token_cap(value: str, device: str) -> int:
    """The padded tokens a pass may hold on `device`; 0: no cap."""
    return int(decided_micro_batch_tokens(value, device))


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
