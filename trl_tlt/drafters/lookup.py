"""Suffix lookup: where has the row's newest text occurred before, and what followed it there.

A `SuffixIndex` maps every n-gram (min_n <= n <= max_n) of a set of token sequences to the place right after its
latest occurrence. Indexing is incremental (each new token costs max_n - min_n + 1 dict writes), so the sequences of
a running batch can be indexed as they grow. A row looks up the longest suffix of its own text and drafts what
followed it. The model-free drafters (`NgramDrafter`, and the lookup sources of `HybridDrafter`) are built on it.
"""

from __future__ import annotations

from typing import NamedTuple


class Match(NamedTuple):
    """A lookup hit: `n` tokens of the row's suffix matched; `sequence` (an id of the index) continues at `start`."""

    n: int
    sequence: int
    start: int


class SuffixIndex:
    """n-gram -> (sequence id, position right after its latest occurrence), over sequences indexed by id.

    Args:
        min_n: Shortest suffix to match.
        max_n: Longest suffix to match.
    """

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"A suffix lookup needs 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}.")
        self.min_n, self.max_n = min_n, max_n
        self._places: dict[tuple[int, ...], tuple[int, int]] = {}
        self._indexed: dict[int, int] = {}  # sequence id -> n-grams ending before this position are indexed

    def update(self, sequence: int, tokens: list[int]) -> None:
        """Index the n-grams of `tokens` (sequence `sequence`, which only grows) not indexed yet. Only n-grams with a
        continuation are indexed (those ending before the last token)."""
        places, first = self._places, self._indexed.get(sequence, 0)
        for end in range(first, len(tokens) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                places[tuple(tokens[end - n + 1 : end + 1])] = (sequence, end + 1)
        self._indexed[sequence] = max(first, len(tokens) - 1)

    def match(self, tokens: list[int]) -> Match | None:
        """The longest suffix of `tokens` seen in the index (None below `min_n`)."""
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            hit = self._places.get(tuple(tokens[-n:]))
            if hit is not None:
                return Match(n, *hit)
        return None
