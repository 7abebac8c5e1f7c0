"""Tensor-parallel split plans, computed once from parameter names and shapes and reusable in
memory (the pipeline can push weights without touching disk).

Column-parallel (split the output dim 0): q/k/v/gate/up projections and their biases.
Row-parallel (split the input dim 1): o/down projections (their biases are replicated).
Vocabulary-parallel (dim 0): the embedding and the output head, zero-padded to a multiple
of N rows; the plan records the padding and `merge` strips it. Everything else is replicated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from rlctl.errors import InputError

COLUMN_PARALLEL = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
ROW_PARALLEL = re.compile(r"\.(o_proj|down_proj)\.weight$")
VOCAB_PARALLEL = re.compile(r"(embed_tokens\.weight|lm_head\.weight)$")


@dataclass(frozen=True)
class ParamSplit:
    name: str
    shape: tuple[int, ...]
    dim: int | None  # None: replicated
    padded_rows: int = 0  # vocab padding added before splitting


@dataclass(frozen=True)
class TPPlan:
    tp: int
    params: tuple[ParamSplit, ...]

    def split(self, state: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(self.tp)]
        for p in self.params:
            tensor = state[p.name]
            if p.dim is None:
                for shard in shards:
                    shard[p.name] = tensor.clone()
                continue
            if p.padded_rows:
                pad = tensor.new_zeros((p.padded_rows, *tensor.shape[1:]))
                tensor = torch.cat([tensor, pad], dim=0)
            for rank, piece in enumerate(torch.chunk(tensor, self.tp, dim=p.dim)):
                shards[rank][p.name] = piece.contiguous()
        return shards

    def merge(self, shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        merged = {}
        for p in self.params:
            if p.dim is None:
                merged[p.name] = shards[0][p.name]
                continue
            tensor = torch.cat([s[p.name] for s in shards], dim=p.dim)
            merged[p.name] = tensor[: p.shape[0]] if p.padded_rows else tensor
        return merged

    def to_json(self) -> dict:
        return {"tp": self.tp, "params": {p.name: {"shape": list(p.shape), "dim": p.dim, "padded_rows": p.padded_rows} for p in self.params}}


def plan_tp(shapes: dict[str, tuple[int, ...]], tp: int, *, num_heads: int, num_kv_heads: int) -> TPPlan:
    """The split of every parameter over `tp` ranks; refuses layouts that do not divide."""
    if tp < 1:
        raise InputError(f"tp must be ≥ 1, got {tp}")
    for what, count in (("attention heads", num_heads), ("key/value heads", num_kv_heads)):
        if count % tp:
            raise InputError(f"tp={tp} does not divide the model's {count} {what}")
    params = []
    for name, shape in sorted(shapes.items()):
        if VOCAB_PARALLEL.search(name):
            params.append(ParamSplit(name, tuple(shape), 0, (-shape[0]) % tp))
        elif COLUMN_PARALLEL.search(name):
            params.append(ParamSplit(name, tuple(shape), _divisible(name, shape, 0, tp)))
        elif ROW_PARALLEL.search(name):
            params.append(ParamSplit(name, tuple(shape), _divisible(name, shape, 1, tp)))
        else:
            params.append(ParamSplit(name, tuple(shape), None))
    return TPPlan(tp, tuple(params))


def _divisible(name: str, shape, dim: int, tp: int) -> int:
    if shape[dim] % tp:
        raise InputError(f"tp={tp} does not divide dim {dim} of {name} (shape {list(shape)})")
    return dim


def parse_target(to: str) -> int | None:
    """'hf' → None; 'tp=N' → N."""
    if to == "hf":
        return None
    match = re.fullmatch(r"tp=(\d+)", to)
    if not match:
        raise InputError(f"--to must be hf or tp=N, got {to!r}")
    return int(match.group(1))
