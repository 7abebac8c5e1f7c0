"""The order a run draws its training prompts in.

The prompts form a stream of epochs, each a seeded permutation of the prompts still in play,
and each iteration takes the next data.batch_size of them. With data.retire_pass_rate, a
prompt whose samples passed at that rate when it was drawn is retired: left out of every epoch
that begins after its iteration (Skywork-OR1's online difficulty filtering; POLARIS drops the
prompts its model has learned), so later batches stop spending rollouts on groups whose
rewards are all alike. An epoch already begun keeps its length, so the stream up to a position
depends only on retirements decided before it was drawn: a pure function of the prompt count,
the retirements, the seed and the position, which resume and replay recompute exactly."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping

import numpy as np
import pyarrow as pa

from rlctl.errors import InputError
from rlctl.rewards import given_rewards

IN_PLAY = np.iinfo(np.int64).max  # a prompt's retirement epoch when it is never retired


def retirement_epochs(ids: pa.ChunkedArray | pa.Array, retired: Mapping[str, int] | None) -> np.ndarray:
    """Per row of the prompts (their `id` column): the first epoch without it (IN_PLAY for a
    prompt in play; every row of a retired id). An id the prompts no longer hold (a changed
    dataset on resume) is passed over."""
    epochs = np.full(len(ids), IN_PLAY, dtype=np.int64)
    if retired:
        for row, prompt_id in enumerate(ids.to_pylist()):
            if prompt_id in retired:
                epochs[row] = int(retired[prompt_id])
    return epochs


class PromptStream:
    """Positions of the stream → rows of the prompts, over epochs whose lengths the
    retirements set (`until[row]`: the first epoch without that row)."""

    def __init__(self, until: np.ndarray, *, seed: int, shuffle: bool) -> None:
        self.until, self.seed, self.shuffle = until, seed, shuffle
        self._retired_by = np.sort(until[until != IN_PLAY])

    def epoch_length(self, epoch: int) -> int:
        return len(self.until) - int(np.searchsorted(self._retired_by, epoch, side="right"))

    def locate(self, position: int) -> tuple[int, int]:
        """(epoch, offset in it) of a stream position."""
        epoch, begins = 0, 0
        while True:
            length = self.epoch_length(epoch)
            if length == 0:
                raise InputError(
                    f"every training prompt is retired by epoch {epoch} (data.retire_pass_rate): none is left to draw; "
                    "the policy passes them all (lower data.retire_pass_rate, raise data.pass_threshold, or add harder prompts)"
                )
            if position < begins + length:
                return epoch, position - begins
            epoch, begins = epoch + 1, begins + length

    def holds(self, position: int) -> bool:
        """Whether the stream reaches `position` (not when every prompt is retired before it)."""
        try:
            self.locate(position)
        except InputError:
            return False
        return True

    def epoch_rows(self, epoch: int) -> np.ndarray:
        """The rows of an epoch in their drawn order. With nothing retired this is the seeded
        permutation of all rows that runs have always drawn."""
        playing = np.flatnonzero(self.until > epoch)
        if not self.shuffle:
            return playing
        return playing[np.random.default_rng([self.seed, epoch]).permutation(len(playing))]

    def rows(self, start: int, count: int) -> list[int]:
        """The rows at stream positions start, start + 1, ... start + count − 1."""
        epoch, offset = self.locate(start)
        order, rows = self.epoch_rows(epoch), []
        while len(rows) < count:
            if offset == len(order):
                epoch, offset = self.locate(start + len(rows))
                order = self.epoch_rows(epoch)
            rows.append(int(order[offset]))
            offset += 1
        return rows


def pass_rates(scores: Iterable[pa.Table], pass_threshold: float) -> dict[str, float]:
    """Per prompt id: the share of its samples (over all the tables: dynamic sampling's rounds)
    whose reward, as the reward gave it (before score's overlong and length shaping), is at
    least `pass_threshold`."""
    passed: dict[str, int] = {}
    drawn: dict[str, int] = {}
    for table in scores:
        for prompt_id, reward in zip(table.column("id").to_pylist(), given_rewards(table)):
            drawn[prompt_id] = drawn.get(prompt_id, 0) + 1
            passed[prompt_id] = passed.get(prompt_id, 0) + (reward is not None and reward >= pass_threshold)
    return {prompt_id: passed[prompt_id] / drawn[prompt_id] for prompt_id in drawn}


def newly_retired(retired: Mapping[str, int], rates: Mapping[str, float], *, pass_rate: float, from_epoch: int) -> dict[str, int]:
    """The prompts `rates` retire (those passing at `pass_rate` or more, not yet retired), each
    mapped to `from_epoch`: the first epoch that begins after their iteration."""
    return {prompt_id: from_epoch for prompt_id, rate in sorted(rates.items()) if rate >= pass_rate and prompt_id not in retired}


def retired_digest(retired: Mapping[str, int]) -> str:
    """A short digest of the retirements, for the prompts stage's key."""
    return hashlib.sha256(json.dumps(sorted(retired.items())).encode()).hexdigest()[:16]

