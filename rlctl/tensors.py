"""Conversions between Arrow list columns and padded torch tensors."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from rlctl.errors import InputError


def list_lengths(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    return pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)


def padded(column: pa.ChunkedArray | pa.Array, *, width: int | None = None, dtype=torch.float64, fill: float = 0.0) -> torch.Tensor:
    """A list column → [B, width] tensor, right-padded with `fill`."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    lengths = list_lengths(column)
    width = int(lengths.max(initial=0)) if width is None else width
    values = column.flatten().to_numpy(zero_copy_only=False)
    out = np.full((len(lengths), width), fill, dtype=np.float64)
    rows = np.repeat(np.arange(len(lengths)), lengths)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else np.zeros(0, dtype=np.int64)
    cols = np.arange(len(values)) - np.repeat(offsets, lengths)
    out[rows, cols] = values
    return torch.from_numpy(out).to(dtype)


def mask_from_lengths(lengths: np.ndarray, width: int) -> torch.Tensor:
    return torch.arange(width).unsqueeze(0) < torch.as_tensor(lengths).unsqueeze(1)


def unpad(tensor: torch.Tensor, lengths: np.ndarray, type_: pa.DataType = pa.float32()) -> pa.Array:
    """[B, T] tensor → list column holding the first `lengths[i]` values of each row."""
    matrix = tensor.detach().cpu().numpy()
    flat = np.concatenate([matrix[i, :n] for i, n in enumerate(lengths)]) if len(lengths) else np.zeros(0)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(flat.astype(type_.to_pandas_dtype()), type_))


def list_column(rows: list[list], type_: pa.DataType) -> pa.Array:
    return pa.array(rows, type=pa.list_(type_))


def set_columns(table: pa.Table, columns: dict[str, pa.Array]) -> pa.Table:
    """`table` with these columns replaced or appended (in order), metadata kept."""
    for name, column in columns.items():
        if name in table.column_names:
            table = table.set_column(table.column_names.index(name), name, column)
        else:
            table = table.append_column(name, column)
    return table


def check_token_ids(table: pa.Table, vocab_size: int, source: str = "input") -> None:
    """Every prompt and response token id is a row of the model's embedding (exit 2 if not)."""
    for name in ("prompt_ids", "response_ids"):
        if name not in table.column_names:
            continue
        column = table.column(name)
        flat = pc.list_flatten(column)
        if not len(flat):
            continue
        outside = pc.or_(pc.less(flat, 0), pc.greater_equal(flat, vocab_size))
        if pc.any(outside).as_py():
            row = pc.filter(pc.list_parent_indices(column), outside)[0].as_py()
            value = pc.filter(flat, outside)[0].as_py()
            raise InputError(f"{source}: column {name!r} row {row} holds token id {value}, outside the model's vocabulary of {vocab_size}")


def sampled_mask(table: pa.Table, lengths: np.ndarray, width: int) -> torch.Tensor | None:
    """[B, width] bool: the response tokens the policy sampled, where the table's `loss_mask`
    says a tool wrote others (rollout.tool); None where every response token is the policy's."""
    if "loss_mask" not in table.column_names:
        return None
    return mask_from_lengths(lengths, width) & padded(table.column("loss_mask"), width=width, dtype=torch.bool)


class PolicyTokens:
    """The response tokens the policy sampled, moved to the front of each row: a tool's tokens
    (rollout.tool; `loss_mask` False) are context, not actions, so per-token returns and
    advantages are computed over the policy's tokens alone — as if the tool's text were part of
    the next state — and are 0 at the tool's. Without a loss mask it changes nothing."""

    def __init__(self, keep: torch.Tensor) -> None:  # [B, W] bool: the response tokens the policy sampled
        self.width = keep.shape[1]
        self.lengths = keep.sum(1).numpy().astype(np.int64)
        self.order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices  # kept positions first, in order
        self.compact_width = int(self.lengths.max(initial=0))
        self.mask = mask_from_lengths(self.lengths, self.compact_width)

    def compact(self, tensor: torch.Tensor) -> torch.Tensor:
        """[B, W] → [B, compact width]: row i's policy tokens first, 0 after them."""
        return torch.where(self.mask, tensor.gather(1, self.order[:, : self.compact_width]), 0)

    def spread(self, compacted: torch.Tensor) -> torch.Tensor:
        """[B, compact width] → [B, W]: back to the tokens' places, 0 at a tool's tokens."""
        out = torch.zeros((compacted.shape[0], self.width), dtype=compacted.dtype)
        return out.scatter(1, self.order[:, : self.compact_width], torch.where(self.mask, compacted, 0))
