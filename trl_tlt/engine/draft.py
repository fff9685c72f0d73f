"""The drafter interface of the speculative engine.

Per `generate` call the engine calls `start` once (at its first use; at prefill for drafters with
`needs_hidden_states = True`), then `propose` (k tokens per active row from the current state) at the steps it
drafts, and `accept` after every policy forward once started (how many drafts each row kept; drafters that did
not draft that step ignore it or, like EAGLE, record the policy's hidden states). `select` follows whenever
finished rows leave the batch. Drafters read what they need from `DraftContext`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams
from .sharding import PolicyWeights


# Where a drafted token came from: the drafter's model (sampled from its q), the row's own text and its GRPO siblings
# in this rollout, or the prompt's earlier rollouts (`PromptHistory`). The last two are deterministic (q one-hot).
DRAFT_SOURCES = ("learned", "siblings", "history")


@dataclass
class DraftContext:
    """The engine's view of the active batch, shared with the drafter.

    Attributes:
        sequences: Token ids of every row of the call (prompt + completion so far, including the newest token,
            which the policy has not consumed yet), indexed by original row id.
        row_ids: (B,) original row id of each active row, in batch order.
        group_ids: Group of every original row: rows with the same prompt (GRPO's siblings) share a group.
        params: The sampling settings.
        generator: Random generator for stochastic drafters.
        prompt_lengths: Prompt length of every original row (its first tokens in `sequences`; empty: unknown).
        hidden_states: The policy's hidden states from its last forward, indexed by layer id (`Drafter.hidden_layers`;
            for EAGLE drafters).
        policy_weights: Whole copies of the policy's embedding and LM head, for a sharded policy (`PolicyWeights`):
            what a drafter reads instead of the policy's modules, whose weights are shards between forwards. None: the
            policy is whole; read its modules.
    """

    sequences: list[list[int]]
    row_ids: torch.Tensor
    group_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    prompt_lengths: list[int] = field(default_factory=list)
    hidden_states: tuple[torch.Tensor, ...] | dict[int, torch.Tensor] | None = field(default=None, repr=False)
    policy_weights: PolicyWeights | None = field(default=None, repr=False)


@dataclass
class Draft:
    """Proposed tokens per active row: k of them, or more where a deterministic source continues (`source`).

    Attributes:
        token_ids: (B, L) draft token ids (entries past `num_tokens` are ignored).
        num_tokens: (B,) number of valid drafts per row, in [0, L].
        probs: (B, k, V) the distributions the drafts were sampled from (k <= L), or None if the drafter is
            deterministic (then q is one-hot on the draft, which keeps rejection sampling exact).
        source: (B, L) index into `DRAFT_SOURCES` of each draft's source; drafts from a source other than "learned"
            are deterministic (q one-hot, whatever `probs` holds there), and positions >= k must be. None: all
            "learned" (all deterministic if `probs` is None).
    """

    token_ids: torch.Tensor
    num_tokens: torch.Tensor
    probs: torch.Tensor | None = None
    source: torch.Tensor | None = None


class Drafter:
    """Base class: override `propose`; the hooks default to no-ops for stateless drafters.

    Attributes:
        needs_hidden_states: The drafter reads `DraftContext.hidden_states` (the engine then keeps them).
        hidden_layers: The layer ids it reads there (Hugging Face's `hidden_states` indices: id i < L is the input of
            decoder layer i, id L the final norm's output); the engine keeps only these. None: every layer.
    """

    needs_hidden_states: bool = False
    hidden_layers: tuple[int, ...] | None = None

    def start(self, ctx: DraftContext) -> None:
        """A new batch begins (every row holds its prompt and its first sampled token)."""

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        raise NotImplementedError

    def accept(self, ctx: DraftContext, num_accepted_tokens: torch.Tensor) -> None:
        """After every policy forward (whoever drafted); `ctx.sequences` already hold the emitted tokens."""

    def select(self, rows: torch.Tensor) -> None:
        """Only `rows` (indices into the current batch) stay active."""


def checked_draft(
    draft, vocab: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """A drafter fault must never reach verification: each row's draft is cut at its first invalid position, a token
    outside the vocabulary or a source `DRAFT_SOURCES` does not name, or a sampled draft whose q is not a distribution
    with mass on it (NaN, infinite, negative, zero; missing past q's length). The drafts before it are verified as
    usual; a row cut at 0 drafts nothing this step (it emits one token sampled from the policy, exactly).

    Cutting, never dropping the whole row: whether d_1..d_j are verified may then depend on d_1..d_{j+1} (a draft
    length chosen as the draft goes: lossless), never on a later position's fault, which may itself depend on d_j (a
    user drafter whose q at j + 1 breaks after some d_j): rows dropped whole for it would be a biased selection of
    their first tokens. Exact for a drafter whose tokens are samples of the q it reports; one that drafts a token
    outside the vocabulary or of probability 0 under its own q is not sampling from it, and no check can make its
    drafts exact (they are cut; only their speed is lost when such faults do not depend on the token drawn). Returns token ids, q and sources made safe, the drafts kept per row (B,) and the rows cut
    (B,)."""
    ids = draft.token_ids  # (B, L)
    width = ids.size(1)
    position = torch.arange(width, device=ids.device)[None, :]
    used = position < draft.num_tokens[:, None]  # (B, L)
    ok = (ids >= 0) & (ids < vocab)
    source, sampled = draft.source, used
    if source is not None:
        ok &= (source >= 0) & (source < len(DRAFT_SOURCES))
        sampled = used & (source == DRAFT_SOURCES.index("learned"))
    probs = draft.probs
    if probs is not None:  # (B, k, V)
        k = min(probs.size(1), width)
        finite = torch.isfinite(probs[:, :k]).all(dim=-1) & (probs[:, :k] >= 0).all(dim=-1)  # (B, k)
        mass = probs[:, :k].gather(-1, ids[:, :k, None].clamp(0, probs.size(-1) - 1)).squeeze(-1) > 0
        has_q = torch.zeros_like(ok)
        has_q[:, :k] = finite & mass
        ok &= has_q | ~sampled  # a sampled draft past q's length has no q
    bad = used & ~ok
    cut = bad.any(dim=1)
    num_tokens = torch.where(cut, bad.int().argmax(dim=1), draft.num_tokens)  # (B,) drafts before the first fault
    kept = position < num_tokens[:, None]
    ids = torch.where(kept, ids, 0)
    if probs is not None:
        probs = torch.where(kept[:, : probs.size(1), None], probs, 0.0)
    if source is not None:
        source = torch.where(kept, source, 0)
    return ids, probs, source, num_tokens, cut
