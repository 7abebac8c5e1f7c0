"""Stop strings (`rollout.stop`): a response ends at the first token whose text completes one
of them, and keeps it — a reward sees the `</answer>` it looks for, and the tokens are the ones
the engine sampled up to there (vLLM's `stop` with `include_stop_str_in_output`).

Where a response ends is a function of its tokens alone (`StopStrings.end`), so every engine
gives the same rows: rlctl.stages.rollout cuts every generation by it, and the engines stop a
row early only to save work (`StopStrings.hits`, a cheap look at each row's last tokens)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rlctl.backends.base import Generation

TAIL_MARGIN = 8  # tokens looked at beyond a stop string's bytes: tokens of no text, a character split over several


class StopStrings:
    def __init__(self, tokenizer, strings: Sequence[str]) -> None:
        self.tokenizer, self.strings = tokenizer, tuple(strings)
        self.tail = max((len(s.encode()) for s in self.strings), default=0) + TAIL_MARGIN

    def __bool__(self) -> bool:
        return bool(self.strings)

    def _text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def found(self, ids: Sequence[int]) -> bool:
        """Whether the text of `ids` holds a stop string."""
        return self._holds(self._text(ids))

    def end(self, ids: Sequence[int]) -> int | None:
        """The number of tokens up to and including the one that completes the first stop
        string, or None where the text of `ids` holds none. A binary search over prefixes: the
        text of a longer prefix holds what a shorter one's does."""
        if not self.strings or not self.found(ids):
            return None
        shortest_without, longest = 0, len(ids)  # found(ids[:longest]); not found(ids[:shortest_without])
        while longest - shortest_without > 1:
            middle = (shortest_without + longest) // 2
            if self.found(ids[:middle]):
                longest = middle
            else:
                shortest_without = middle
        return longest

    def cut(self, generation: Generation) -> Generation:
        """`generation` ended at its first stop string (finish reason "stop"), or as it was."""
        return self.cut_all([generation])[0][0]

    def cut_all(self, generations: Sequence[Generation]) -> tuple[list[Generation], list[bool]]:
        """Every generation cut at its first stop string, and whether each ended at one."""
        ends = [self.end(g.response_ids) for g in generations]
        cut = [g if end is None else Generation(g.response_ids[:end], g.logprobs[:end], "stop") for g, end in zip(generations, ends)]
        return cut, [end is not None for end in ends]

    def hits(self, tails: list[list[int]], whole: Callable[[int], Sequence[int]]) -> list[bool]:
        """Which rows now hold a stop string, from the last `self.tail` tokens of each (`tails`;
        more where the caller looks less often). A hit is confirmed on the row's whole tokens
        (`whole(i)`), so a tail decoded from the middle of a character never ends a row early;
        a row a tail misses only generates on until the cut."""
        return [self._holds(self._text(tail)) and self.found(whole(i)) for i, tail in enumerate(tails)]

    def _holds(self, text: str) -> bool:
        return any(s in text for s in self.strings)
