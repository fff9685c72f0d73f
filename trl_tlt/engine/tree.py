"""Tree speculation: draft a tree of continuations, verify all its nodes in one policy forward, keep one path.

The drafter grows a dynamic tree (EAGLE-2) around a sampled chain:

- the *backbone*: at every depth one child sampled from the drafter's distribution q, exactly the chain a chain
  arm drafts (greedy: its argmax);
- *side branches*: the other `topk - 1` most likely tokens under each backbone node and the `topk` most likely
  under every other expanded node. At each depth the backbone node and the `topk - 1` best other nodes by
  cumulative draft log-probability are expanded; of the whole pool the backbone and the best other nodes are kept,
  `verify` nodes in all.

Node i (index i+1; index 0 is the root, the row's newest token) sits at position root + depth(i) and attends to
the committed cache and to its ancestors only (a tree attention mask), so one forward scores every node as if its
path had been decoded alone. Verification walks the tree from the root (multi-draft recursive rejection sampling):

    at a backbone node:  accept the sampled child d iff u * q(d) < p(d)               (as for a chain)
                         else x ~ norm(max(p - q, 0)), the residual
    at any other node:   x ~ p
    if a child holds x, move to it and go on; else emit x and stop

Lossless: at a backbone node the first line is one step of speculative sampling, whose output (d or x) is
distributed as p; elsewhere x is drawn from p. Which other children exist only decides whether a drafted
continuation follows x, never x itself, so every emitted token is distributed as the policy's processed
distribution given the tokens before it. (Testing deterministic children one by one, child c accepted with
probability r(c) and r <- r without c after a rejection, is the same as drawing x ~ r once.) Greedy walks the
argmax. The backbone alone is the chain arm's step: a tree accepts at least as much at equal depth.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .sampling import SamplingParams, sample_categorical, sample_draft_logprobs, sample_inverse_cdf


@dataclass
class DraftTree:
    """A draft tree per active row, nodes in topological order (every parent before its children).

    Attributes:
        token_ids: (B, N) node tokens (entries of invalid nodes are ignored).
        parents: (B, N) index of each node's parent: 0 = the root (the row's newest token), i + 1 = node i.
        valid: (B, N) real nodes; a row drafts `valid[b].sum()` nodes.
        sampled: (B, N) backbone nodes: drawn from q of their parent, at most one per depth, each under the root or
            the previous one (None: none, every node is verified by the walk against p alone).
        probs: (B, D, V) q of the backbone node at depth d + 1 (None without a backbone).
    """

    token_ids: torch.Tensor
    parents: torch.Tensor
    valid: torch.Tensor
    sampled: torch.Tensor | None = None
    probs: torch.Tensor | None = None


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
    an earlier valid node, or a node deeper than `max_depth` drafts nothing this step; a row whose backbone is not a
    chain from the root keeps its nodes but loses the backbone (all its nodes are walked against p alone, still
    exact), and a backbone is cut at its first depth whose q is not a distribution with mass on its node (the nodes
    below are walked against p alone): whether a backbone node is tested against q never depends on a deeper one.

    Returns the tree made safe, its ancestor relation (`tree_ancestors`, invalid nodes see themselves only) and the
    valid rows (B,).
    """
    ids, parents, valid = tree.token_ids, tree.parents, tree.valid.bool()
    index = torch.arange(1, ids.size(1) + 1, device=ids.device)[None]
    ok_nodes = (ids >= 0) & (ids < vocab) & (parents >= 0) & (parents < index)
    rows_ok = (ok_nodes | ~valid).all(dim=1)
    parents = torch.where(ok_nodes & rows_ok[:, None], parents, 0)
    # A valid node under an invalid one would hang from nothing.
    with_root = torch.cat([torch.ones_like(valid[:, :1]), valid], dim=1)
    rows_ok &= (with_root.gather(1, parents) | ~valid).all(dim=1)
    ancestors = tree_ancestors(parents, max_depth)
    depths = depths_from_ancestors(ancestors)
    rows_ok &= ((depths <= max_depth) | ~valid).all(dim=1)
    valid = valid & rows_ok[:, None]
    with_root = torch.cat([torch.ones_like(valid[:, :1]), valid], dim=1)
    ancestors &= with_root[:, None, :] | torch.eye(with_root.size(1), dtype=torch.bool, device=valid.device)
    ids, parents = torch.where(valid, ids, 0), torch.where(valid, parents, 0)
    sampled, probs = None, None
    if tree.sampled is not None and tree.probs is not None:
        sampled, probs = tree.sampled.bool() & valid, tree.probs
        # A chain from the root: one backbone node per depth, each under the root or a backbone node.
        on_backbone = torch.cat([torch.ones_like(sampled[:, :1]), sampled], dim=1).gather(1, parents)
        per_parent = torch.zeros_like(with_root, dtype=torch.long).scatter_add_(1, parents, sampled.long())
        chain = ((on_backbone | ~sampled).all(dim=1)) & (per_parent <= 1).all(dim=1)
        chain &= ((depths <= probs.size(1)) | ~sampled).all(dim=1)
        level = (depths - 1).clamp(0, probs.size(1) - 1)  # (B, N) index into probs
        q_node = probs.gather(1, level[..., None].expand(-1, -1, probs.size(2))).gather(2, ids[..., None]).squeeze(2)
        # The backbone is cut at its first depth whose q is not a distribution with mass on its node (as a chain
        # draft is: `draft.checked_draft`); the nodes from there on are walked against p alone.
        level_ok = torch.isfinite(probs).all(dim=2) & (probs >= 0).all(dim=2)  # (B, D)
        level_ok.scatter_reduce_(1, level, (q_node > 0) | ~sampled, reduce="amin")
        first_bad = torch.where(level_ok.all(dim=1), level_ok.size(1), (~level_ok).int().argmax(dim=1))  # (B,)
        sampled = sampled & chain[:, None] & (level < first_bad[:, None])
        probs = torch.where(
            chain[:, None, None] & (torch.arange(probs.size(1), device=ids.device) < first_bad[:, None])[..., None],
            probs,
            0.0,
        )
    safe = DraftTree(ids, parents, valid, sampled, probs)
    return safe, ancestors, rows_ok


def verify_tree(
    target_logprobs: torch.Tensor,
    tree: DraftTree,
    depths: torch.Tensor,
    max_depth: int,
    do_sample: bool,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk each row's tree with tokens drawn from the target (see the module docstring).

    Args:
        target_logprobs: (B, N+1, V) processed log-probabilities at the root (index 0) and at every node.
        tree: The (checked) draft tree.
        depths: (B, N) depth of every node (`depths_from_ancestors`).
        max_depth: Depth of its deepest valid node.
        do_sample: False = greedy (argmax) walk.
        generator: Random generator for the uniforms (two per index and row, always drawn).

    Returns:
        path (B, D): index (1..N) of the accepted node at each depth (garbage past `num_accepted`), num_accepted
        (B,), next_token_ids (B,) and emitted_logprobs (B, D+1): log p of the accepted tokens, then of the next
        token at index num_accepted.
    """
    batch, n_plus_1, vocab = target_logprobs.shape
    device, dtype = target_logprobs.device, target_logprobs.dtype
    # x[n]: the token drawn at index n, should the walk reach it (one draw per node: the walk visits each once).
    if do_sample:
        uniforms = torch.rand((batch, n_plus_1, 2), generator=generator, device=device, dtype=dtype)
        probs = target_logprobs.exp()
        x = sample_inverse_cdf(probs.flatten(0, 1), uniforms[..., 1].flatten()).view(batch, n_plus_1)
    else:
        x = target_logprobs.argmax(dim=-1)  # (B, N+1)
    index = torch.arange(n_plus_1, device=device)
    sampled = None if tree.sampled is None else tree.sampled & tree.valid
    has_backbone = do_sample and sampled is not None and bool(sampled.any())
    if has_backbone:
        # Backbone node at depth j (the root for j = 0): test its sampled child, else draw from the residual.
        levels = tree.probs.size(1)
        child = torch.zeros((batch, levels + 1), dtype=torch.long, device=device)
        at = torch.where(sampled, depths, 0).clamp(max=levels)
        child.scatter_(1, at, torch.where(sampled, index[None, 1:], 0))
        child = child[:, 1:]  # (B, L): index of the sampled node at depth j + 1, 0 = none
        has = child > 0
        parent = torch.cat([torch.zeros_like(tree.parents[:, :1]), tree.parents], dim=1).gather(1, child)
        main = torch.cat([torch.zeros_like(tree.token_ids[:, :1]), tree.token_ids], dim=1).gather(1, child)
        p = probs.gather(1, parent[..., None].expand(-1, -1, vocab))  # (B, L, V)
        q_main = tree.probs.gather(2, main[..., None]).squeeze(2)
        accept = has & (uniforms[..., 0].gather(1, parent) * q_main < p.gather(2, main[..., None]).squeeze(2))
        residual = (p - tree.probs).clamp(min=0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)  # round-off guard
        drawn = sample_inverse_cdf(residual.flatten(0, 1), uniforms[..., 1].gather(1, parent).flatten())
        drawn = torch.where(accept, main, drawn.view(batch, levels))
        spill = torch.where(has, parent, n_plus_1)  # rows without a backbone node write past the end
        x = torch.cat([x, x[:, :1]], dim=1).scatter(1, spill, drawn)[:, :-1]
    # next_index[n]: the child of n holding x[n], 0 = none (the walk stops at n and emits x[n]).
    children = tree.valid[:, None, :] & (tree.parents[:, None, :] == index[None, :, None])  # (B, N+1, N)
    match = children & (tree.token_ids[:, None, :] == x[..., None])
    next_index = torch.where(match.any(dim=2), match.int().argmax(dim=2) + 1, 0)  # (B, N+1)
    if has_backbone:  # an accepted backbone token moves to the sampled child, not to a twin
        following = torch.where(accept, child, next_index.gather(1, parent))
        next_index = torch.cat([next_index, next_index[:, :1]], dim=1).scatter(1, spill, following)[:, :-1]
    x_logprobs = target_logprobs.gather(2, x[..., None]).squeeze(2)  # (B, N+1)

    node = torch.zeros(batch, dtype=torch.long, device=device)
    walking = torch.ones(batch, dtype=torch.bool, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    path = torch.zeros((batch, max_depth), dtype=torch.long, device=device)
    emitted_logprobs = torch.zeros((batch, max_depth + 1), dtype=dtype, device=device)
    for depth in range(max_depth + 1):
        emitted_logprobs[:, depth] = x_logprobs.gather(1, node[:, None]).squeeze(1)
        if depth == max_depth:
            break
        following = next_index.gather(1, node[:, None]).squeeze(1)
        walking = walking & (following > 0)
        path[:, depth] = torch.where(walking, following, 0)
        node = torch.where(walking, following, node)
        num_accepted += walking.long()
    next_tokens = x.gather(1, node[:, None]).squeeze(1)
    return path, num_accepted, next_tokens, emitted_logprobs


def draft_tree(
    root_logits: torch.Tensor,
    step: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor],
    params: SamplingParams,
    depth: int,
    topk: int,
    verify: int,
    generator: torch.Generator | None = None,
) -> DraftTree:
    """Grow a draft tree from a drafter's root logits: a sampled backbone plus EAGLE-2 side branches.

    Args:
        root_logits: (B, V) the drafter's logits for the token after the root.
        step: `step(tokens, parent_slots, visible, depth)` runs the drafter on the frontier: tokens (B, w) at
            depth `depth`, parent_slots (B, w) the draft slot of each one's parent (-1 = the root), visible (B, w, m)
            which of the m draft slots fed so far (these w last) each attends to; returns their logits (B, w, V).
        params: Sampling settings: q is the drafter's distribution processed like the policy's, without the
            repetition penalty (`sample_draft`); the backbone is sampled from it (greedy: its argmax).
        depth, topk, verify: Tree depth, children per expanded node and frontier width, nodes kept.
        generator: Random generator of the backbone's samples.

    Returns:
        The backbone and the best other nodes by cumulative log q, `verify` in all (a subtree: a node never scores
        above its parent), in topological order, with the backbone's q.
    """
    logq = sample_draft_logprobs(root_logits[:, None], params)  # (B, 1, V)
    batch, device = logq.size(0), logq.device
    frontier_pool = torch.zeros((batch, 1), dtype=torch.long, device=device)  # pool index + 1 (0 = root)
    frontier_scores = torch.zeros((batch, 1), dtype=logq.dtype, device=device)
    frontier_slots = torch.full((batch, 1), -1, dtype=torch.long, device=device)
    slot_ancestors = torch.zeros((batch, 0, 0), dtype=torch.bool, device=device)  # (B, m, m)
    pools: list[tuple[torch.Tensor, ...]] = []  # per depth: tokens, scores, parents, backbone flags
    backbone_probs = []
    pool_size = 0
    for d in range(1, depth + 1):
        # Children: top-k of every frontier node; the backbone node (frontier position 0) gets its sampled token first.
        width = logq.size(1)
        scores, tokens = logq.topk(topk, dim=-1)  # (B, w, topk)
        q = logq[:, 0].exp()
        main = sample_categorical(q, generator)[:, None] if params.do_sample else q.argmax(-1, keepdim=True)
        others = logq[:, 0].scatter(-1, main, float("-inf")).topk(topk - 1, dim=-1)
        tokens[:, 0] = torch.cat([main, others.indices], dim=-1)
        scores[:, 0] = torch.cat([logq[:, 0].gather(-1, main), others.values], dim=-1)
        backbone_probs.append(q)
        scores = (frontier_scores[..., None] + scores).flatten(1)  # (B, w * topk)
        tokens = tokens.flatten(1)
        parents = frontier_pool[..., None].expand(batch, width, topk).flatten(1)
        backbone = torch.zeros_like(tokens, dtype=torch.bool)
        backbone[:, 0] = True
        pools.append((tokens, scores, parents, backbone))
        if d == depth:
            break
        # The next frontier: the backbone child, then the best others; fed in one drafter forward.
        best = torch.where(backbone, float("inf"), scores).topk(topk, dim=-1).indices  # (B, topk), backbone first
        parent_slots = frontier_slots.gather(1, best // topk)
        m = slot_ancestors.size(1)
        inherited = slot_ancestors.gather(1, parent_slots.clamp(min=0)[..., None].expand(batch, topk, m))
        inherited &= (parent_slots >= 0)[..., None]
        own = torch.eye(topk, dtype=torch.bool, device=device)[None].expand(batch, -1, -1)
        visible = torch.cat([inherited, own], dim=2)
        slot_ancestors = torch.cat(
            [torch.cat([slot_ancestors, slot_ancestors.new_zeros((batch, m, topk))], dim=2), visible], dim=1
        )
        frontier_pool = pool_size + 1 + best
        frontier_scores = scores.gather(1, best)
        frontier_slots = m + torch.arange(topk, device=device)[None].expand(batch, topk)
        logq = sample_draft_logprobs(step(tokens.gather(1, best), parent_slots, visible, d), params)
        pool_size += tokens.size(1)
    return _keep_best(pools, backbone_probs, verify, params)


def _keep_best(pools: list[tuple[torch.Tensor, ...]], backbone_probs: list, verify: int, params) -> DraftTree:
    """The tree `draft_tree` returns, from its per-depth pools (tokens, scores, parents, backbone flags): the
    backbone, then the best other nodes by score, `verify` in all, in pool (topological) order."""
    tokens, scores, parents, backbone = (torch.cat(x, dim=1) for x in zip(*pools, strict=True))
    batch, device = tokens.size(0), tokens.device
    # The backbone, then the best others; the stable sort keeps a parent before a child of equal score.
    keep = torch.sort(torch.where(backbone, float("inf"), scores), dim=1, descending=True, stable=True).indices
    keep = keep[:, :verify].sort(dim=1).values  # pool order is topological
    new_index = torch.zeros((batch, tokens.size(1) + 1), dtype=torch.long, device=device)
    new_index.scatter_(1, keep + 1, torch.arange(1, keep.size(1) + 1, device=device)[None].expand_as(keep))
    kept_backbone = backbone.gather(1, keep)
    return DraftTree(
        token_ids=tokens.gather(1, keep),
        parents=new_index.gather(1, parents.gather(1, keep)),
        valid=torch.isfinite(scores.gather(1, keep)) | kept_backbone,
        sampled=kept_backbone if params.do_sample else None,
        probs=torch.stack(backbone_probs, dim=1) if params.do_sample else None,
    )
