"""`Eagle3Drafter`: the speculative engine's drafter around an `Eagle3Model`."""

from __future__ import annotations

import torch

from ...engine.draft import Draft, DraftContext, Drafter
from ...engine.kv_cache import RaggedKVModel
from ...engine.sampling import sample_draft
from ...engine.tree import DraftTree, draft_tree
from .lean import _DraftSession, _LeanHead
from .model import Eagle3Model


class Eagle3Drafter(Drafter):
    """Plugs an `Eagle3Model` into the engine: catches up on the policy's hidden states, then drafts k tokens.

    The engine starts it at prefill and calls `accept` after every policy forward (also at steps where another
    drafter or no drafter ran), so it always holds the fused hidden states of every committed position. They
    wait in a pending buffer and enter its cache at the next `propose`, so steps without speculation cost no
    drafter forward.
    """

    needs_hidden_states = True

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return tuple(self.model.aux_layer_ids)

    def __init__(self, model: Eagle3Model):
        self.model = model.eval()
        self.runner = RaggedKVModel(model, output_hidden_states=True)
        self._lean: tuple[tuple, _LeanHead] | None = None

    def _lean_head(self) -> _LeanHead:
        """The head's weights laid out for drafting, rebuilt when they change."""
        version = _LeanHead.version(self.model)
        if self._lean is None or self._lean[0] != version:
            self._lean = (version, _LeanHead(self.model))
        return self._lean[1]

    @torch.no_grad()
    def start(self, ctx: DraftContext) -> None:
        self.model.use_policy_weights(ctx.policy_weights)
        rows = ctx.row_ids.tolist()
        fused = self.model.fuse(ctx.hidden_states)  # (B, W, H), left-padded like the prompts
        # Position t pairs hidden state t with token t+1; the newest token (sampled from the prefill) is the last.
        shifted = [ctx.sequences[r][1:] for r in rows]
        logits = self.runner.prefill(shifted, pad_token_id=0, hidden_states=fused)
        self._last = (logits, self.runner.hidden_states[0][:, -1])
        self._pending = fused.new_zeros((len(rows), 0, fused.size(-1)))
        self._pending_valid = torch.zeros((len(rows), 0), dtype=torch.bool, device=fused.device)

    @torch.no_grad()
    def propose(self, ctx: DraftContext, k: int) -> Draft:
        head = self._lean_head()
        logits, prenorm = self._flush(ctx, head) if self._pending.size(1) else self._last
        session = _DraftSession(head, self.runner, k - 1)
        token_ids, probs = [], []
        for j in range(k):
            tokens, q = sample_draft(logits, ctx.params, ctx.generator)
            token_ids.append(tokens)
            probs.append(q)
            if j < k - 1:
                logits, prenorm = session.step(tokens[:, None], prenorm[:, None], depth=j + 1)
                logits, prenorm = logits[:, 0], prenorm[:, 0]
        num_tokens = torch.full((len(token_ids[0]),), k, dtype=torch.long, device=token_ids[0].device)
        return Draft(token_ids=torch.stack(token_ids, dim=1), num_tokens=num_tokens, probs=torch.stack(probs, dim=1))

    @torch.no_grad()
    def propose_tree(self, ctx: DraftContext, depth: int, topk: int, verify: int) -> DraftTree:
        """A draft tree (`trl_tlt.tree.draft_tree`): each expanded node is fed with its parent's pre-norm output."""
        head = self._lean_head()
        logits, prenorm = self._flush(ctx, head) if self._pending.size(1) else self._last
        session = _DraftSession(head, self.runner, depth - 1, width=topk)
        slots = prenorm[:, None]  # (B, 1 + m, H): the root's pre-norm output, then those of the m draft slots fed

        def step(tokens, parent_slots, visible, d):
            nonlocal slots
            hidden = slots.gather(1, (parent_slots + 1)[..., None].expand(-1, -1, slots.size(-1)))
            out, prenorm = session.step(tokens, hidden, depth=d, visible=visible)
            slots = torch.cat([slots, prenorm], dim=1)
            return out

        return draft_tree(logits, step, ctx.params, depth, topk, verify, ctx.generator)

    def _flush(self, ctx: DraftContext, head: _LeanHead):
        """Feed the pending (token t+1, hidden t) pairs; returns the last position's logits and pre-norm output."""
        valid = self._pending_valid
        counts = valid.sum(1).tolist()
        starts = (self.runner.lengths + 1).tolist()  # cache position c holds token c+1
        tokens = [
            t
            for r, s, n in zip(ctx.row_ids.tolist(), starts, counts, strict=True)
            for t in ctx.sequences[r][s : s + n]
        ]
        input_ids = torch.zeros(valid.shape, dtype=torch.long, device=valid.device)
        input_ids[valid] = torch.tensor(tokens, dtype=torch.long, device=valid.device)
        logits, prenorm = _DraftSession.commit(head, self.runner, input_ids, self._pending, valid)
        self._pending = self._pending[:, :0]
        self._pending_valid = self._pending_valid[:, :0]
        return logits, prenorm

    @torch.no_grad()
    def accept(self, ctx: DraftContext, num_accepted_tokens: torch.Tensor) -> None:
        """After every policy forward: queue the hidden states of the kept positions (drafting wrote no cache)."""
        fused = self.model.fuse(ctx.hidden_states)  # (B, k+1, H)
        kept = torch.arange(fused.size(1), device=fused.device)[None] <= num_accepted_tokens[:, None]
        pending = torch.cat([self._pending, fused], dim=1)
        valid = torch.cat([self._pending_valid, kept], dim=1)
        width = int(valid.sum(1).max())
        if width < valid.size(1):  # squeeze out the rejected positions
            order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices[:, :width]
            pending = pending.gather(1, order[..., None].expand(-1, -1, pending.size(-1)))
            valid = valid.gather(1, order)
        self._pending, self._pending_valid = pending, valid

    def select(self, rows: torch.Tensor) -> None:
        rows = rows.to(self.runner.device)
        self.runner.select(rows)
        self._pending, self._pending_valid = self._pending[rows], self._pending_valid[rows]
        self._last = tuple(x[rows] for x in self._last)
