"""Tree speculation: draft a tree of continuations, verify all its nodes in one policy forward, keep one path.

A drafter expands the top-k children of its best nodes to a depth (EAGLE-2's dynamic tree: at each depth the
`topk` best nodes by cumulative draft log-probability are expanded, each by its `topk` most likely tokens) and
keeps the `verify` best nodes of the whole pool. Node i (index i+1; index 0 is the root, the row's newest token)
sits at position root + depth(i) and attends to the committed cache and its ancestors only (a tree attention mask),
so one forward scores every node as if its path had been decoded alone.

Verification walks the tree (lossless for sampling and exact for greedy):

    node = root
    repeat:  x ~ p(. | path to node)   (argmax for greedy)
             if a child of node holds x: node = that child (x accepted)  else: emit x and stop

Every emitted token is drawn from the policy's processed distribution given exactly the tokens before it, so the
completion is distributed as plain sampling. This is multi-draft recursive rejection sampling (SpecInfer) with
deterministic drafts: testing the children one by one, child c accepted with probability r(c) and r <- r without
c after a rejection (r = p first), accepts child c with probability p(c) and emits x ~ p outside the children
otherwise, which is what the walk does with one uniform per depth. A node is accepted with probability
p(its token | its path), so a tree pays when p puts its mass on the drafter's top tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .sampling import SamplingParams, process_logits, upcast_logits
from .speculative import sample_inverse_cdf


@dataclass
class DraftTree:
    """A draft tree per active row, nodes in topological order (every parent before its children).

    Attributes:
        token_ids: (B, N) node tokens (entries of invalid nodes are ignored).
        parents: (B, N) index of each node's parent: 0 = the root (the row's newest token), i + 1 = node i.
        valid: (B, N) real nodes; a row drafts `valid[b].sum()` nodes.
    """

    token_ids: torch.Tensor
    parents: torch.Tensor
    valid: torch.Tensor


def tree_ancestors(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """(B, N+1, N+1) bool: [b, i, j] = index j is index i or one of its ancestors (index 0 = the root).

    By repeated squaring of the parent relation (ceil(log2(max_depth + 1)) batched matmuls): exact for nodes at most
    `max_depth` deep; a deeper node gets at least max_depth + 1 ancestors, so `depths` flags it.
    """
    batch, n = parents.shape
    eye = torch.eye(n + 1, device=parents.device)
    reach = eye[None].repeat(batch, 1, 1)
    reach[:, 1:].scatter_(2, parents[..., None], 1.0)
    for _ in range(max(max_depth, 1).bit_length()):
        reach = (reach @ reach).clamp_(max=1.0)
    return reach.bool()


def depths_from_ancestors(ancestors: torch.Tensor) -> torch.Tensor:
    """(B, N) depth of every node (the root's children: 1)."""
    return ancestors[:, 1:].sum(dim=2) - 1


def checked_tree(tree: DraftTree, vocab: int, max_depth: int) -> tuple[DraftTree, torch.Tensor, torch.Tensor]:
    """A drafter fault must never reach verification: a row with a token outside the vocabulary, a parent that is not
    an earlier valid node, or a node deeper than `max_depth` drafts nothing this step.

    Returns the tree made safe, its ancestor relation (`tree_ancestors`, invalid nodes see themselves only) and the
    valid rows (B,).
    """
    ids, parents, valid = tree.token_ids, tree.parents, tree.valid.bool()
    index = torch.arange(1, ids.size(1) + 1, device=ids.device)[None]
    ok_nodes = (ids >= 0) & (ids < vocab) & (parents >= 0) & (parents < index)
    rows_ok = (ok_nodes | ~valid).all(dim=1)
    parents = torch.where(ok_nodes & rows_ok[:, None], parents, 0)
    # A valid node under an invalid one would hang from nothing.
    parent_valid = torch.cat([torch.ones_like(valid[:, :1]), valid], dim=1).gather(1, parents)
    rows_ok &= (parent_valid | ~valid).all(dim=1)
    ancestors = tree_ancestors(parents, max_depth)
    rows_ok &= ((depths_from_ancestors(ancestors) <= max_depth) | ~valid).all(dim=1)
    valid = valid & rows_ok[:, None]
    with_root = torch.cat([torch.ones_like(valid[:, :1]), valid], dim=1)
    ancestors &= with_root[:, None, :] | torch.eye(with_root.size(1), dtype=torch.bool, device=valid.device)
    safe = DraftTree(torch.where(valid, ids, 0), torch.where(valid, parents, 0), valid)
    return safe, ancestors, rows_ok


def verify_tree(
    target_logprobs: torch.Tensor,
    tree: DraftTree,
    max_depth: int,
    do_sample: bool,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk each row's tree with tokens drawn from the target.

    Args:
        target_logprobs: (B, N+1, V) processed log-probabilities at the root (index 0) and at every node.
        tree: The (checked) draft tree.
        max_depth: Depth of its deepest valid node.
        do_sample: False = greedy (argmax) walk.
        generator: Random generator for the uniforms (one per depth and row, always drawn).

    Returns:
        path (B, D): index (1..N) of the accepted node at each depth (garbage past `num_accepted`), num_accepted
        (B,), next_token_ids (B,) and emitted_logprobs (B, D+1): log p of the accepted tokens, then of the next
        token at index num_accepted.
    """
    batch, n_plus_1, _ = target_logprobs.shape
    device = target_logprobs.device
    uniforms = None
    if do_sample:
        uniforms = torch.rand((batch, max_depth + 1), generator=generator, device=device, dtype=target_logprobs.dtype)
    rows = torch.arange(batch, device=device)
    node = torch.zeros(batch, dtype=torch.long, device=device)  # current index (0 = root)
    walking = torch.ones(batch, dtype=torch.bool, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    next_tokens = torch.zeros(batch, dtype=torch.long, device=device)
    path = torch.zeros((batch, max_depth), dtype=torch.long, device=device)
    emitted_logprobs = torch.zeros((batch, max_depth + 1), dtype=target_logprobs.dtype, device=device)
    for depth in range(max_depth + 1):
        logprobs = target_logprobs[rows, node]  # (B, V)
        if do_sample:
            x = sample_inverse_cdf(logprobs.exp(), uniforms[:, depth])
        else:
            x = logprobs.argmax(dim=-1)
        emitted_logprobs[:, depth] = torch.where(walking, logprobs.gather(1, x[:, None]).squeeze(1), 0.0)
        match = tree.valid & (tree.parents == node[:, None]) & (tree.token_ids == x[:, None])  # (B, N)
        found = walking & match.any(dim=1)
        stops = walking & ~found
        next_tokens = torch.where(stops, x, next_tokens)
        if depth < max_depth:
            child = match.int().argmax(dim=1) + 1
            path[:, depth] = torch.where(found, child, 0)
            node = torch.where(found, child, node)
        num_accepted += found.long()
        walking = found
        if not walking.any():
            break
    return path, num_accepted, next_tokens, emitted_logprobs


def draft_tree(
    root_logits: torch.Tensor,
    step: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor],
    params: SamplingParams,
    depth: int,
    topk: int,
    verify: int,
) -> DraftTree:
    """Expand a draft tree from a drafter's root logits (EAGLE-2's dynamic tree).

    Args:
        root_logits: (B, V) the drafter's logits for the token after the root.
        step: `step(tokens, parent_slots, visible, depth)` runs the drafter on the frontier: tokens (B, w) at
            depth `depth`, parent_slots (B, w) the draft slot of each one's parent (-1 = the root), visible (B, w, m)
            which of the m draft slots fed so far (these w last) each attends to; returns their logits (B, w, V).
        params: Sampling settings (the drafter's distribution is processed like the policy's, without the
            repetition penalty; it only ranks the nodes).
        depth, topk, verify: Tree depth, children per expanded node and frontier width, nodes kept.

    Returns:
        The `verify` nodes of highest cumulative draft log-probability (a subtree: a node never scores above its
        parent), in topological order.
    """
    params = SamplingParams(
        do_sample=params.do_sample, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        min_p=params.min_p, max_new_tokens=params.max_new_tokens,
    )
    logq = process_logits(upcast_logits(root_logits), params)  # (B, V)
    scores, tokens = logq.topk(topk, dim=-1)  # (B, topk)
    batch, device = tokens.size(0), tokens.device
    pool_tokens, pool_scores = [tokens], [scores]
    pool_parents = [torch.zeros_like(tokens)]  # pool index + 1 of the parent (0 = root)
    frontier = torch.arange(1, topk + 1, device=device)[None].expand(batch, topk)  # pool index + 1
    frontier_tokens, frontier_scores = tokens, scores
    parent_slots = torch.full_like(tokens, -1)
    slot_ancestors = torch.zeros((batch, 0, 0), dtype=torch.bool, device=device)  # (B, m, m)
    pool_size = topk
    for d in range(1, depth):
        # Feed the frontier: each node sees its ancestors' slots and its own.
        m = slot_ancestors.size(1)
        inherited = slot_ancestors.gather(1, parent_slots.clamp(min=0)[..., None].expand(batch, topk, m))
        inherited = inherited & (parent_slots >= 0)[..., None]
        visible = torch.cat([inherited, torch.eye(topk, dtype=torch.bool, device=device)[None].expand(batch, -1, -1)], 2)
        slot_ancestors = torch.cat(
            [torch.cat([slot_ancestors, slot_ancestors.new_zeros((batch, m, topk))], dim=2), visible], dim=1
        )
        logits = step(frontier_tokens, parent_slots, visible, d)  # (B, topk, V)
        child_logq = process_logits(upcast_logits(logits), params)
        child_scores, child_tokens = child_logq.topk(topk, dim=-1)  # (B, topk, topk)
        child_scores = (frontier_scores[..., None] + child_scores).flatten(1)  # (B, topk^2)
        child_tokens = child_tokens.flatten(1)
        child_parents = frontier[..., None].expand(batch, topk, topk).flatten(1)
        pool_tokens.append(child_tokens)
        pool_scores.append(child_scores)
        pool_parents.append(child_parents)
        best = child_scores.topk(topk, dim=-1).indices  # (B, topk) the next frontier
        frontier = pool_size + 1 + best
        frontier_tokens, frontier_scores = child_tokens.gather(1, best), child_scores.gather(1, best)
        parent_slots = m + best // topk  # the slot of each new frontier node's parent (fed this step)
        pool_size += topk * topk
    tokens, scores, parents = (torch.cat(x, dim=1) for x in (pool_tokens, pool_scores, pool_parents))
    # Best `verify` nodes; the stable sort keeps a parent before a child of equal score, so the choice is a subtree.
    keep = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :verify]
    keep = keep.sort(dim=1).values  # pool order is topological
    new_index = torch.zeros((batch, pool_size + 1), dtype=torch.long, device=device)
    new_index.scatter_(1, keep + 1, torch.arange(1, keep.size(1) + 1, device=device)[None].expand_as(keep))
    kept_parents = new_index.gather(1, parents.gather(1, keep))
    kept_scores = scores.gather(1, keep)
    return DraftTree(
        token_ids=tokens.gather(1, keep), parents=kept_parents, valid=torch.isfinite(kept_scores)
    )
