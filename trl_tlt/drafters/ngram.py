"""Model-free n-gram drafter: prompt lookup over the row's own text and over its GRPO siblings.

GRPO samples G completions per prompt; siblings that got further (or finished early) are good drafts for the
others. For each group we keep a dict from every n-gram (min_n <= n <= max_n) seen in any row of the group to
the place right after its latest occurrence; a row drafts the k tokens that followed the longest match of its
own suffix. Indexing is incremental: each new token costs max_n - min_n + 1 dict writes.
"""

from __future__ import annotations

import torch

from .base import Draft, DraftContext, Drafter


class NgramDrafter(Drafter):
    """Deterministic drafter over the prompt, the completion so far and the sibling completions.

    Args:
        max_n: Longest suffix to match.
        min_n: Shortest suffix to match (below it, the row drafts nothing this step).

    Example:
        >>> engine = SpeculativeEngine(model, drafter=NgramDrafter(max_n=4, min_n=2), num_speculative_tokens=4)
    """

    def __init__(self, max_n: int = 4, min_n: int = 2):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"NgramDrafter needs 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}.")
        self.max_n, self.min_n = max_n, min_n

    def start(self, ctx: DraftContext) -> None:
        self._index: dict[int, dict[tuple[int, ...], tuple[int, int]]] = {g: {} for g in set(ctx.group_ids)}
        self._indexed = [0] * len(ctx.sequences)  # n-grams ending before this position are indexed, per row

    def _update(self, row: int, group: int, seq: list[int]) -> None:
        index = self._index[group]
        # Index n-grams ending at position e <= len - 2, so that every entry has a continuation.
        for end in range(self._indexed[row], len(seq) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                index[tuple(seq[end - n + 1 : end + 1])] = (row, end + 1)
        self._indexed[row] = max(self._indexed[row], len(seq) - 1)

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        rows = ctx.row_ids.tolist()
        token_ids = torch.zeros((len(rows), k), dtype=torch.long)
        num_tokens = torch.zeros(len(rows), dtype=torch.long)
        # Index every row of each active group first, so that siblings see each other's newest tokens.
        groups = {ctx.group_ids[r] for r in rows}
        for row, seq in enumerate(ctx.sequences):
            if ctx.group_ids[row] in groups:
                self._update(row, ctx.group_ids[row], seq)
        for i, row in enumerate(rows):
            seq, index = ctx.sequences[row], self._index[ctx.group_ids[row]]
            for n in range(min(self.max_n, len(seq)), self.min_n - 1, -1):
                hit = index.get(tuple(seq[-n:]))
                if hit is not None:
                    src_row, start = hit
                    cont = ctx.sequences[src_row][start : start + k]
                    token_ids[i, : len(cont)] = torch.tensor(cont, dtype=torch.long)
                    num_tokens[i] = len(cont)
                    break
        device = ctx.row_ids.device
        return Draft(token_ids=token_ids.to(device), num_tokens=num_tokens.to(device))
