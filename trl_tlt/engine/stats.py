"""`GenerationStats`: the counters of one `SpeculativeEngine.generate` call (names as in vLLM's spec-decode metrics)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from .draft import DRAFT_SOURCES


@dataclass
class GenerationStats:
    """Counters of one `generate` call (names as in vLLM's spec-decode metrics).

    `mean_acceptance_length` = 1 + num_accepted_tokens / num_drafts: tokens emitted per speculative row-step,
    bonus included. For a tree step, `num_draft_tokens` counts the nodes verified and `num_accepted_tokens` the
    accepted path's length. `num_accepted_tokens_by_source[s]` / `num_draft_tokens_by_source[s]`: accepted and
    drafted tokens that came from source s (`DRAFT_SOURCES`). `active_batch_sizes[i]`, `num_speculative_tokens[i]`,
    `drafter_names[i]`, `step_emitted_tokens[i]` and `step_seconds[i]` describe decode step i.
    """

    num_prompts: int = 0
    num_target_forwards: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    num_invalid_drafts: int = 0  # row-steps whose draft was cut at a fault: token out of range, q not a distribution
    num_tree_steps: int = 0  # decode steps that verified a draft tree
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    active_batch_sizes: list[int] = field(default_factory=list)
    num_speculative_tokens: list[int] = field(default_factory=list)
    drafter_names: list[str | None] = field(default_factory=list)
    step_emitted_tokens: list[int] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    num_accepted_tokens_by_source: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DRAFT_SOURCES, 0))
    num_draft_tokens_by_source: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DRAFT_SOURCES, 0))
    lockstep: bool = False  # the ranks were kept in lockstep (a sharded policy: `sharding.py`)
    num_placeholder_forwards: int = 0  # lockstep: forwards this rank ran for the others, its own rows done
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def observe_step(
        self,
        active: int,
        k: int,
        name: str | None,
        tree: bool,
        emitted: int,
        num_drafts,
        num_accepted,
        seconds,
        source=None,
    ) -> None:
        """Record one decode step: `active` rows, `k` the arm's draft length (0: no draft), `num_drafts` /
        `num_accepted` (per row) the tokens drafted and accepted, `emitted` tokens in `seconds`, `source` (B, L)
        each draft's source (`Draft.source`; None: all learned)."""
        self.num_target_forwards += 1
        self.num_tree_steps += tree
        self.num_emitted_tokens += emitted
        self.active_batch_sizes.append(active)
        self.num_speculative_tokens.append(k)
        self.drafter_names.append(name)
        self.step_emitted_tokens.append(emitted)
        self.step_seconds.append(seconds)
        if k == 0:
            return
        drafted, accepted, rows, longest = torch.stack(
            [num_drafts.sum(), num_accepted.sum(), (num_drafts > 0).sum(), num_drafts.max()]
        ).tolist()  # one device sync
        self.num_drafts += rows
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        width = k if tree else max(k, longest)  # a tree is k deep whatever its nodes; a lookup may draft past k
        per_pos = torch.bincount(num_accepted, minlength=width + 1).flip(0).cumsum(0).flip(0)[1:]
        if len(self.num_accepted_tokens_per_pos) < width:
            self.num_accepted_tokens_per_pos += [0] * (width - len(self.num_accepted_tokens_per_pos))
        if source is None:
            self.num_accepted_tokens_by_source["learned"] += accepted
            self.num_draft_tokens_by_source["learned"] += drafted
        else:
            position = torch.arange(source.size(1), device=source.device)[None]
            for mask, counts in (
                (position < num_accepted[:, None], self.num_accepted_tokens_by_source),
                (position < num_drafts[:, None], self.num_draft_tokens_by_source),
            ):
                totals = torch.bincount(source[mask], minlength=len(DRAFT_SOURCES)).tolist()
                for src, total in zip(DRAFT_SOURCES, totals, strict=True):
                    counts[src] += total
        for j, count in enumerate(per_pos.tolist()):
            self.num_accepted_tokens_per_pos[j] += count

    def to_dict(self) -> dict:
        out = asdict(self)
        out["mean_acceptance_length"] = self.mean_acceptance_length
        out["draft_acceptance_rate"] = self.draft_acceptance_rate
        return out
