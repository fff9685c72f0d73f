"""Small causal-LM drafter: any Hugging Face model that shares the policy's tokenizer.

It keeps its own ragged KV cache (`RaggedKVModel`). At each step it first consumes the tokens the policy
emitted since its last step (1 or 2 per row, ragged), then drafts k tokens one by one, sampling from its own
processed distribution q (same temperature/top-k/top-p as the policy: closer q means more acceptances; any q
keeps verification exact because q is passed along). Rejected drafts are cut from its cache after verification.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..engine.draft import Draft, DraftContext, Drafter
from ..engine.kv_cache import RaggedKVModel
from ..engine.sampling import sample_draft
from ..engine.tree import DraftTree, draft_tree


class ModelDrafter(Drafter):
    """Draft with a small causal LM (fully trained or a PEFT-LoRA model).

    Args:
        model: The drafter LM; its vocabulary must cover the policy's (extra rows are never drafted).
        vocab_size: The policy's vocabulary size (the size of the verified distributions).

    Example:
        >>> drafter = ModelDrafter(AutoModelForCausalLM.from_pretrained("my-small-lm"), policy.config.vocab_size)
    """

    def __init__(self, model: PreTrainedModel, vocab_size: int):
        self.model = model.eval()
        self.vocab_size = vocab_size
        self.runner = RaggedKVModel(model)

    def _to_policy_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Slice or -inf-pad the drafter's logits (..., V_d) to the policy's vocabulary (..., V)."""
        if logits.size(-1) >= self.vocab_size:
            return logits[..., : self.vocab_size]
        pad = logits.new_full((*logits.shape[:-1], self.vocab_size - logits.size(-1)), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    @torch.no_grad()
    def start(self, ctx: DraftContext) -> None:
        # Prefill every row's prompt (all but the newest token, which `propose` feeds).
        prompts = [ctx.sequences[r][:-1] for r in ctx.row_ids.tolist()]
        self.runner.prefill(prompts, pad_token_id=0)
        self._step_start = None
        self._tree = False

    @torch.no_grad()
    def propose(self, ctx: DraftContext, k: int) -> Draft:
        last = self._catch_up(ctx)
        token_ids, probs = [], []
        for j in range(k):
            tokens, q = sample_draft(self._to_policy_vocab(last), ctx.params, ctx.generator)
            token_ids.append(tokens)
            probs.append(q)
            if j < k - 1:
                last = self.runner.extend(tokens[:, None], torch.ones_like(tokens[:, None], dtype=torch.bool))[:, 0]
        token_ids = torch.stack(token_ids, dim=1)  # (B, k)
        num_tokens = torch.full((token_ids.size(0),), k, dtype=torch.long, device=token_ids.device)
        return Draft(token_ids=token_ids, num_tokens=num_tokens, probs=torch.stack(probs, dim=1))

    @torch.no_grad()
    def propose_tree(self, ctx: DraftContext, depth: int, topk: int, verify: int) -> DraftTree:
        """A draft tree (`trl_tlt.tree.draft_tree`); its drafted positions are dropped again at `accept`."""
        root_logits = self._to_policy_vocab(self._catch_up(ctx))
        self._tree = True

        def step(tokens, parent_slots, visible, d):
            positions = (self._step_start + d - 1)[:, None].expand_as(tokens)
            valid = torch.ones_like(tokens, dtype=torch.bool)
            return self._to_policy_vocab(self.runner.extend_tree(tokens, valid, positions, visible))

        return draft_tree(root_logits, step, ctx.params, depth, topk, verify, ctx.generator)

    def _catch_up(self, ctx: DraftContext) -> torch.Tensor:
        """Feed the policy's tokens not yet in the cache; returns the logits after the newest one (B, V_d)."""
        rows = ctx.row_ids.tolist()
        device = self.runner.device
        lengths = self.runner.lengths.tolist()
        pending = [ctx.sequences[r][n:] for r, n in zip(rows, lengths, strict=True)]
        width = max(len(p) for p in pending)
        input_ids = torch.zeros((len(rows), width), dtype=torch.long)
        valid = torch.zeros((len(rows), width), dtype=torch.bool)
        for i, tokens in enumerate(pending):
            input_ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            valid[i, : len(tokens)] = True
        input_ids, valid = input_ids.to(device), valid.to(device)
        logits = self.runner.extend(input_ids, valid)  # (B, width, V_d)
        self._step_start = self.runner.lengths.clone()  # the policy's tokens so far, newest included
        return logits.gather(1, (valid.sum(1) - 1)[:, None, None].expand(-1, 1, logits.size(-1))).squeeze(1)

    def accept(self, ctx: DraftContext, num_accepted_tokens: torch.Tensor) -> None:
        # Cached: the policy's tokens plus the first k-1 drafts; keep those drafts that were accepted (a chain's),
        # none of a tree's (its accepted path is fed again with the policy's tokens at the next step).
        if self._step_start is not None:
            k_fed = self.runner.lengths - self._step_start
            kept = (
                torch.zeros_like(k_fed) if self._tree else torch.minimum(num_accepted_tokens.to(k_fed.device), k_fed)
            )
            self.runner.truncate(self._step_start + kept)
            self._step_start = None
            self._tree = False

    def select(self, rows: torch.Tensor) -> None:
        self.runner.select(rows.to(self.runner.device))
