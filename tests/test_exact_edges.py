"""Exactness at the edges: draws the tests rarely see, faults past the first draft position, the repetition penalty on
left-padded rows. Each test names the mutation it catches (run once against the mutated code: it failed)."""

import os

import pytest
import torch

from trl_tlt.drafters import Draft, Drafter
from trl_tlt.engine import SpeculativeEngine
from trl_tlt.rejection_sampler import verify_reference
from trl_tlt.sampling import SamplingParams
from trl_tlt.tree import DraftTree, checked_tree, depths_from_ancestors, verify_tree


def impossible_draft_case(has_q: bool):
    """One row, two draft positions, the draft at position 0 has target probability 0 (outside top-k, say)."""
    logp = torch.log_softmax(torch.tensor([[[0.0, 1.0, 2.0, 3.0]] * 3]), dim=-1)
    logp[0, 0, 1] = float("-inf")
    drafts = torch.tensor([[1, 2]])
    q = torch.full((1, 2, 4), 0.25) if has_q else None
    zeros_accept, zeros_sample = torch.zeros(1, 2), torch.zeros(1)
    return logp, drafts, torch.tensor([2]), q, zeros_accept, zeros_sample


@pytest.mark.parametrize("has_q", [True, False], ids=["sampled", "one-hot"])
def test_a_zero_uniform_never_accepts_an_impossible_draft(has_q):
    """Mutation caught: the acceptance test written `u * q <= p` (torch.rand returns exactly 0.0 about once in 2^24
    float32 draws; then a draft with p = 0 was accepted and emitted with logprob -inf)."""
    case = impossible_draft_case(has_q)
    num_accepted, _, emitted = verify_reference(*case)
    assert num_accepted.tolist() == [0]
    assert torch.isfinite(emitted[0, 0])
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        from trl_tlt.kernels import verify_triton

        assert verify_triton(*case)[0].tolist() == [0]


def test_a_zero_uniform_never_accepts_an_impossible_tree_node(monkeypatch):
    """Mutation caught: the tree walk's backbone test written `u * q <= p`."""
    vocab = 4
    logp = torch.log_softmax(torch.tensor([[[0.0, 1.0, 2.0, 3.0]] * 2]), dim=-1)
    logp[0, 0, 1] = float("-inf")  # the backbone's token has p = 0 at the root
    tree = DraftTree(
        token_ids=torch.tensor([[1]]),
        parents=torch.tensor([[0]]),
        valid=torch.tensor([[True]]),
        sampled=torch.tensor([[True]]),
        probs=torch.full((1, 1, vocab), 0.25),
    )
    tree, ancestors, _ = checked_tree(tree, vocab, max_depth=1)
    monkeypatch.setattr(torch, "rand", lambda *shape, **kwargs: torch.zeros(*shape, dtype=kwargs.get("dtype")))
    _, num_accepted, next_tokens, emitted = verify_tree(logp, tree, depths_from_ancestors(ancestors), 1, True)
    assert num_accepted.tolist() == [0]
    assert next_tokens.tolist() != [1] and torch.isfinite(emitted[0, 0])
