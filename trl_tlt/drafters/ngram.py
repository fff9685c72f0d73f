"""Model-free n-gram drafter: prompt lookup over the row's own text and over its GRPO siblings.

GRPO samples G completions per prompt; siblings that got further (or finished early) are good drafts for the
others. Each group (the rows of one prompt) has a `SuffixIndex` over all its rows; a row drafts the k tokens that
followed the longest match of its own suffix.
"""

from __future__ import annotations

import torch

from ..engine.draft import DRAFT_SOURCES, Draft, DraftContext, Drafter
from .lookup import SuffixIndex


class SiblingLookup:
    """One `SuffixIndex` per group over the rows of the running batch (prompt and completion so far)."""

    def __init__(self, ctx: DraftContext, min_n: int, max_n: int):
        self.indexes = {g: SuffixIndex(min_n, max_n) for g in set(ctx.group_ids)}

    def update(self, ctx: DraftContext) -> None:
        """Index every row of each active group, so that siblings see each other's newest tokens."""
        groups = {ctx.group_ids[r] for r in ctx.row_ids.tolist()}
        for row, seq in enumerate(ctx.sequences):
            if ctx.group_ids[row] in groups:
                self.indexes[ctx.group_ids[row]].update(row, seq)

    def continuation(self, ctx: DraftContext, row: int, length: int, tokens: list[int] | None = None):
        """(match length n, up to `length` tokens that followed the longest match of `tokens` (default: the row's
        text)); (0, []) without a match."""
        tokens = ctx.sequences[row] if tokens is None else tokens
        hit = self.indexes[ctx.group_ids[row]].match(tokens)
        if hit is None:
            return 0, []
        return hit.n, ctx.sequences[hit.sequence][hit.start : hit.start + length]


class NgramDrafter(Drafter):
    """Deterministic drafter over the prompt, the completion so far and the sibling completions.

    Args:
        max_n: Longest suffix to match.
        min_n: Shortest suffix to match (below it, the row drafts nothing this step).

    Example:
        >>> engine = SpeculativeEngine(model, drafter=NgramDrafter(max_n=4, min_n=2), num_speculative_tokens=4)
    """

    def __init__(self, max_n: int = 4, min_n: int = 2):
        SuffixIndex(min_n, max_n)  # checks the bounds now rather than at the first rollout
        self.max_n, self.min_n = max_n, min_n

    def start(self, ctx: DraftContext) -> None:
        self._lookup = SiblingLookup(ctx, self.min_n, self.max_n)

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        rows = ctx.row_ids.tolist()
        token_ids = torch.zeros((len(rows), k), dtype=torch.long)
        num_tokens = torch.zeros(len(rows), dtype=torch.long)
        self._lookup.update(ctx)
        for i, row in enumerate(rows):
            _, cont = self._lookup.continuation(ctx, row, k)
            if cont:
                token_ids[i, : len(cont)] = torch.tensor(cont, dtype=torch.long)
                num_tokens[i] = len(cont)
        device = ctx.row_ids.device
        source = torch.full_like(token_ids, DRAFT_SOURCES.index("siblings"))
        return Draft(token_ids=token_ids.to(device), num_tokens=num_tokens.to(device), source=source.to(device))
