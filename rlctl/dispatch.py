"""The one rule for spreading rows over ranks: contiguous slices, results back in row order.

Rank r of N gets rows [start_r, stop_r): the first `rows % N` ranks get one row more. Results
are concatenated in rank order, so what a worker group returns (and commits) has the rows in
the order a single process would have produced them.

    slices = row_slices(10, 3)        # [slice(0, 4), slice(4, 7), slice(7, 10)]
    gather([[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]) == list(range(10))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def row_slices(rows: int, ranks: int) -> list[slice]:
    base, extra = divmod(rows, ranks)
    slices, start = [], 0
    for rank in range(ranks):
        stop = start + base + (rank < extra)
        slices.append(slice(start, stop))
        start = stop
    return slices


def split(items: Sequence[T], ranks: int) -> list[Sequence[T]]:
    return [items[s] for s in row_slices(len(items), ranks)]


def gather(parts: Sequence[Sequence[T]]) -> list[T]:
    return [item for part in parts for item in part]
