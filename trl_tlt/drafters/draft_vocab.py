"""The draft vocabulary of a new EAGLE-3 head: the policy tokens it drafts over, chosen from what the policy emits.

EAGLE-3 and SpecForge draft over a reduced vocabulary (32k of Qwen's 151,665 or Llama 3's 128,256 tokens): the head's
LM head, its training loss and every draft step then cost the same whatever the policy's vocabulary. The choice is
stored as `d2t` (target id = draft id + d2t[draft id]) and `t2d`, which vLLM and SGLang read from the checkpoint. A
token outside it cannot be drafted; speculation stays lossless.

Before the first rollout the head drafts over the lowest token ids (byte-level BPE vocabularies, Qwen's, Llama 3's and
GPT-2's, number their earliest and most frequent merges first) and the special tokens. Every rollout's completion
tokens are then counted, older rollouts fading (`COUNT_DECAY`), and when the draft vocabulary covers less than
`REVISE_BELOW_COVERAGE` of the latest rollout's tokens it is re-chosen as the most frequent ones (ties keep the
current members): rows of kept tokens keep their training, new rows start from the policy's LM head.
"""

from __future__ import annotations

import torch


DEFAULT_DRAFT_VOCAB_SIZE = 32_768  # what EAGLE-3 and SpecForge use for Qwen2.5 and Llama 3: the largest we fit
MIN_DRAFT_VOCAB_SIZE = 1_024  # the smallest fitted size: room for tokens the first rollout did not use
FIT_HEADROOM = 2  # a fitted draft vocabulary holds twice the distinct tokens of the first rollout
COUNT_DECAY = 0.5  # per rollout: the policy moves, its older rollouts count half as much at each new one
REVISE_BELOW_COVERAGE = 0.995  # of the latest rollout's completion tokens, the share the draft vocabulary must hold
REVISE_MIN_GAIN = 0.001  # a revision must cover at least this much more of the latest rollout: no churn for nothing


def prior_draft_ids(
    vocab_size: int, draft_vocab_size: int, special_ids: list[int] | tuple[int, ...] = ()
) -> torch.Tensor:
    """Ascending ids of the draft vocabulary before any rollout: the special tokens and the lowest ids."""
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"`draft_vocab_size` must be in [1, {vocab_size}], got {draft_vocab_size}.")
    special = sorted({i for i in special_ids if 0 <= i < vocab_size})[:draft_vocab_size]
    score = -torch.arange(vocab_size, dtype=torch.float64)  # lower id first
    score[special] = float("inf")
    return torch.topk(score, draft_vocab_size).indices.sort().values


def fitted_size(counts: torch.Tensor, max_size: int) -> int:
    """Draft vocabulary size for a policy whose first rollout used the tokens counted in `counts` (V,): twice as many
    as it used, in multiples of 1024, at least `MIN_DRAFT_VOCAB_SIZE` and at most `max_size`."""
    distinct = int((counts > 0).sum())
    size = -(-FIT_HEADROOM * distinct // MIN_DRAFT_VOCAB_SIZE) * MIN_DRAFT_VOCAB_SIZE
    return min(max(size, MIN_DRAFT_VOCAB_SIZE), max_size)


class DraftVocabulary:
    """Decayed counts of the policy's completion tokens, and the draft vocabulary they call for.

    Args:
        vocab_size: The policy's vocabulary.
        draft_vocab_size: Tokens in the draft vocabulary.

    Example:
        >>> vocab = DraftVocabulary(151_665, 32_768)
        >>> vocab.observe(torch.bincount(torch.tensor(completion_tokens), minlength=151_665))
        >>> new_ids = vocab.revised(head.draft_ids)  # None while the current ones cover the rollout
    """

    def __init__(self, vocab_size: int, draft_vocab_size: int):
        self.vocab_size, self.draft_vocab_size = vocab_size, draft_vocab_size
        self.counts = torch.zeros(vocab_size, dtype=torch.float64)
        self.latest = torch.zeros(vocab_size, dtype=torch.float64)
        self.num_revisions = 0

    def token_counts(self, completions: list[list[int]]) -> torch.Tensor:
        """Count of every policy token in `completions` (V,)."""
        tokens = [t for ids in completions for t in ids if 0 <= t < self.vocab_size]
        return torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=self.vocab_size).double()

    def observe(self, counts: torch.Tensor) -> None:
        """One rollout's token counts (V,), summed over ranks where there are several."""
        self.latest = counts.detach().double().cpu()
        self.counts = COUNT_DECAY * self.counts + self.latest

    def coverage(self, draft_ids: torch.Tensor) -> float:
        """Share of the latest rollout's completion tokens inside the draft vocabulary (1 before any)."""
        total = float(self.latest.sum())
        return float(self.latest[draft_ids.cpu()].sum()) / total if total else 1.0

    def revised(self, draft_ids: torch.Tensor) -> torch.Tensor | None:
        """Ascending ids of a new draft vocabulary of `draft_vocab_size` tokens if `draft_ids` cover too little of the
        latest rollout and the new ones cover more, else None."""
        coverage = self.coverage(draft_ids)
        if coverage >= REVISE_BELOW_COVERAGE and draft_ids.numel() == self.draft_vocab_size:
            return None
        member = torch.zeros(self.vocab_size, dtype=torch.float64)
        member[draft_ids.cpu()] = 0.5  # ties (e.g. tokens never seen) keep the current members: fewer rows re-learn
        new_ids = torch.topk(self.counts + member, self.draft_vocab_size).indices.sort().values
        resized = new_ids.numel() != draft_ids.numel()
        if not resized and self.coverage(new_ids) < coverage + REVISE_MIN_GAIN:
            return None
        self.num_revisions += 1
        return new_ids

    def state_dict(self) -> dict:
        return {"counts": self.counts, "latest": self.latest, "num_revisions": self.num_revisions}

    def load_state_dict(self, state: dict) -> None:
        self.counts, self.latest = state["counts"].double(), state["latest"].double()
        self.num_revisions = int(state["num_revisions"])
