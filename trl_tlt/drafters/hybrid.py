"""`HybridDrafter`: per row, per step, the draft of the source that predicts it best, all verified in one forward.

Three sources (`DRAFT_SOURCES`):

- *learned*: the learned drafter (an EAGLE-3 head or a drafter LM), k tokens sampled from its q;
- *siblings*: suffix lookup over the row's own text and its GRPO siblings in this rollout (as `NgramDrafter`);
- *history*: suffix lookup over the prompt's completions from its latest earlier rollout (`PromptHistory`).

A step's k (the speculation policy's choice) bounds every row's draft, and so the width of the one verification. The
learned drafter drafts chains of `learned_tokens` (or k, if smaller) for every row, in one batched forward per
position, and keeps seeing every policy forward. Then each row picks:

- a lookup that matches the row's suffix (the longer of the two matches; the siblings on a tie) drafts instead of
  the learned drafter where, on rows whose lookups matched alike (same source and match length, steps of the same
  k), lookups have lately accepted more tokens per draft than the learned drafter: running means of both over
  those rows, kept across calls. Where the learned drafter drafts, the lookup is scored in its shadow, for free: its draft against
  the tokens the row emitted (these are the policy's samples, so the leading matches are distributed as the
  tokens a one-hot draft would have had accepted, cut at the emitted count: a low estimate, which favours the
  learned drafter). Where the lookup drafts, the learned drafter is scored again at one step in `EXPLORE_EVERY`.
  A new head thus loses to the lookups within steps, a warm one keeps every row where a match says little.
  A lookup drafts at most 2 + twice the tokens such drafts accepted lately: one that pays climbs to long drafts,
  one that does not stays cheap to verify. With no learned drafter a lookup drafts where it has accepted more than
  `NO_DRAFT_VALUE` tokens per draft (tried while untried, and at one step in `EXPLORE_EVERY` where it has not);
- otherwise the row drafts the learned chain, and where k leaves room past it, the chain's last `min_match` tokens
  match a lookup and such lookups accept more than `NO_DRAFT_VALUE` tokens per draft, that lookup's continuation
  extends it (as far as it would draft on its own).

Lossless: which source a row uses, and how a learned chain is extended, depends only on tokens emitted and drafts
accepted before this step and on the learned chain's own samples (an extension is a deterministic function of them:
a one-hot q), never on the verification's draws; each drafted token is verified against its own q (one-hot for
lookups), so every emitted token is distributed as the policy's.
"""

from __future__ import annotations

import torch

from ..engine.draft import DRAFT_SOURCES, Draft, DraftContext, Drafter
from .history import PromptHistory
from .lookup import SuffixIndex
from .ngram import SiblingLookup


LEARNED, SIBLINGS, HISTORY = range(len(DRAFT_SOURCES))
EXPLORE_EVERY = 32  # one step in 32 rescores what the running means rank second (see the module docstring)
NO_DRAFT_VALUE = 1.0  # accepted tokens per draft a lookup must beat to draft without a learned drafter, or past it
VALUE_DECAY = 0.1  # weight of a step's mean in the running means (the drafter and the policy move)


class HybridDrafter(Drafter):
    """Learned drafter, sibling lookup and prompt history, chosen per row (see the module docstring).

    Args:
        learned: The learned drafter (None: lookups only, siblings and history).
        history: The prompt history store (None: no history source). The engine reads it; the caller adds each
            rollout's completions to it (`PromptHistory.add`).
        min_match: Shortest suffix match for a lookup to extend the learned chain.
        learned_tokens: Longest chain the learned drafter drafts (None: the step's k). A step's k bounds every
            row's draft (so the verification's width, which the speculation policy chooses); where k exceeds this,
            lookups draft past the learned drafter's reach and extend its chains up to k.
        max_n, min_n: Longest and shortest suffix the lookups match.

    Example:
        >>> drafter = HybridDrafter(Eagle3Drafter(head), PromptHistory(max_tokens=1 << 20))
        >>> engine = SpeculativeEngine(model, drafter=drafter, num_speculative_tokens=6)
    """

    def __init__(
        self,
        learned: Drafter | None,
        history: PromptHistory | None = None,
        min_match: int = 3,
        learned_tokens: int | None = None,
        max_n: int = 4,
        min_n: int = 2,
    ):
        SuffixIndex(min_n, max_n)  # checks the bounds now rather than at the first rollout
        if not min_n <= min_match <= max_n:
            raise ValueError(f"HybridDrafter needs min_n <= min_match <= max_n, got {min_n}, {min_match}, {max_n}.")
        if learned_tokens is not None and learned_tokens < 1:
            raise ValueError(f"`learned_tokens` must be >= 1 or None, got {learned_tokens}.")
        self.learned, self.history = learned, history
        self.min_match, self.learned_tokens, self.max_n, self.min_n = min_match, learned_tokens, max_n, min_n
        # Accepted tokens per draft, running means over rows whose lookup matched: (key, "lookup") and
        # (key, "learned") for each key = (source, match length n, the step's k). Within a key the two compare like
        # for like.
        self.values: dict[tuple, float] = {}
        # Per active row at the last `propose`: (key, choice, the lookup's draft where the learned one was verified
        # instead, the row's length), or None for a row no lookup matched.
        self._chosen: list[tuple | None] | None = None
        self._steps = 0
        self._lookups_only: HybridDrafter | None = None

    def lookups_only(self) -> HybridDrafter:
        """This drafter without its learned part (the same history and settings, its own running means): for the
        rollouts in which the learned drafter is left idle."""
        if self.learned is None:
            return self
        if self._lookups_only is None:
            self._lookups_only = HybridDrafter(
                None, self.history, self.min_match, self.learned_tokens, self.max_n, self.min_n
            )
        return self._lookups_only

    def _lookup_length(self, key: tuple) -> int:
        """How far a lookup drafts at most: twice the tokens its key's lookups accepted lately, plus 2 (2 while
        untried): a lookup that pays climbs to long drafts, one that does not stays cheap."""
        return 2 + int(2 * self.values.get((key, "lookup"), 0.0))

    def _use_lookup(self, key: tuple) -> bool:
        """Whether a row whose lookup matched (key = (source, match length n, k)) drafts from it rather than from
        the learned drafter."""
        lookup = self.values.get((key, "lookup"))
        explore = self._steps % EXPLORE_EVERY == 0
        if self.learned is None:  # a lookup competes with drafting nothing (its draft widens the verification)
            return lookup is None or (lookup > NO_DRAFT_VALUE) != explore
        learned = self.values.get((key, "learned"))
        if lookup is None or learned is None:  # the learned drafter drafts; the lookup is scored in its shadow
            return False
        return lookup > learned and not explore

    @property
    def needs_hidden_states(self) -> bool:
        return getattr(self.learned, "needs_hidden_states", False)

    @property
    def hidden_layers(self) -> tuple[int, ...] | None:
        return getattr(self.learned, "hidden_layers", None)

    def start(self, ctx: DraftContext) -> None:
        if self.learned is not None:
            self.learned.start(ctx)
        self._siblings = SiblingLookup(ctx, self.min_n, self.max_n)
        # Per group: an index over the prompt's earlier completions (each with the prompt before it).
        self._history: dict[int, tuple[SuffixIndex, list[list[int]]]] = {}
        if self.history is None or not ctx.prompt_lengths:
            return
        for row, group in enumerate(ctx.group_ids):
            if group in self._history:
                continue
            prompt = ctx.sequences[row][: ctx.prompt_lengths[row]]
            earlier = [prompt + completion for completion in self.history.get(prompt)]
            index = SuffixIndex(self.min_n, self.max_n)
            for i, tokens in enumerate(earlier):
                index.update(i, tokens)
            self._history[group] = (index, earlier)

    def _lookup(self, ctx: DraftContext, row: int, tokens: list[int], length: int) -> tuple[int, list[int], int]:
        """The longer of the sibling and history matches of `tokens`' suffix: (n, continuation, source)."""
        n, cont = self._siblings.continuation(ctx, row, length, tokens)
        best = (n, cont, SIBLINGS)
        if ctx.group_ids[row] in self._history:
            index, earlier = self._history[ctx.group_ids[row]]
            hit = index.match(tokens)
            if hit is not None and hit.n > n:
                best = (hit.n, earlier[hit.sequence][hit.start : hit.start + length], HISTORY)
        return best

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        rows = ctx.row_ids.tolist()
        learned_k = min(k, self.learned_tokens or k)
        learned = self.learned.propose(ctx, learned_k) if self.learned is not None else None
        if learned is not None:
            learned_ids, learned_n = learned.token_ids.tolist(), learned.num_tokens.tolist()
        self._siblings.update(ctx)
        drafts: list[tuple[list[int], list[int]]] = []  # per row: tokens, sources
        self._chosen = []
        for i, row in enumerate(rows):
            seq = ctx.sequences[row]
            n, cont, source = self._lookup(ctx, row, seq, k)
            key = (source, n, k)
            cont = cont[: self._lookup_length(key)]
            if cont and self._use_lookup(key):
                drafts.append((cont, [source] * len(cont)))
                self._chosen.append((key, "lookup", None, len(seq)))
                continue
            self._chosen.append((key, "learned", cont, len(seq)) if cont else None)
            if learned is None:
                drafts.append(([], []))
                continue
            tokens = learned_ids[i][: learned_n[i]]
            sources = [LEARNED] * len(tokens)
            if len(tokens) == learned_k < k:
                n, cont, source = self._lookup(ctx, row, seq + tokens, k - learned_k)
                if n >= self.min_match and self.values.get(((source, n, k), "lookup"), 0.0) > NO_DRAFT_VALUE:
                    cont = cont[: self._lookup_length((source, n, k))]
                    tokens, sources = tokens + cont, sources + [source] * len(cont)
            drafts.append((tokens, sources))
        self._steps += 1
        width = max([k] + [len(t) for t, _ in drafts])
        device = ctx.row_ids.device
        return Draft(  # one host-to-device copy per tensor: rows padded in Python
            token_ids=torch.tensor([t + [0] * (width - len(t)) for t, _ in drafts], dtype=torch.long, device=device),
            num_tokens=torch.tensor([len(t) for t, _ in drafts], dtype=torch.long, device=device),
            probs=None if learned is None else learned.probs,
            source=torch.tensor(
                [s + [SIBLINGS] * (width - len(s)) for _, s in drafts], dtype=torch.long, device=device
            ),
        )

    def propose_tree(self, ctx: DraftContext, depth: int, topk: int, verify: int):
        """Tree arms draft from the learned drafter alone (`trl_tlt.tree`)."""
        if not hasattr(self.learned, "propose_tree"):
            raise ValueError(f"Tree arms need a learned drafter that drafts trees; this one is {self.learned!r}.")
        return self.learned.propose_tree(ctx, depth, topk, verify)

    def accept(self, ctx: DraftContext, num_accepted_tokens: torch.Tensor) -> None:
        if self.learned is not None:
            self.learned.accept(ctx, num_accepted_tokens)
        if self._chosen is None:  # this drafter did not draft the step
            return
        accepted: dict[tuple, list[int]] = {}
        rows = ctx.row_ids.tolist()
        for row, chosen, n in zip(rows, self._chosen, num_accepted_tokens.tolist(), strict=True):
            if chosen is None:
                continue
            key, choice, shadow, length = chosen
            accepted.setdefault((key, choice), []).append(n)
            if shadow is not None:  # the lookup's draft against the tokens the row emitted instead
                emitted = ctx.sequences[row][length:]
                matched = next(
                    (j for j, (a, b) in enumerate(zip(shadow, emitted)) if a != b), min(len(shadow), len(emitted))
                )
                accepted.setdefault((key, "lookup"), []).append(matched)
        for key, counts in accepted.items():
            mean = sum(counts) / len(counts)
            old = self.values.get(key)
            self.values[key] = mean if old is None else (1 - VALUE_DECAY) * old + VALUE_DECAY * mean
        self._chosen = None

    def select(self, rows: torch.Tensor) -> None:
        if self.learned is not None:
            self.learned.select(rows)

    def state_dict(self) -> dict:
        """The running means and the step count (the history saves itself: `PromptHistory.state_dict`), and those of
        `lookups_only()`'s drafter."""
        state = {"values": list(self.values.items()), "steps": self._steps}
        if self._lookups_only is not None and self._lookups_only is not self:
            state["lookups_only"] = self._lookups_only.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.values = {(tuple(key), choice): value for (key, choice), value in state["values"]}
        self._steps = int(state["steps"])
        if "lookups_only" in state:
            self.lookups_only().load_state_dict(state["lookups_only"])
