"""Fused speculative verification: one Triton program per row, one launch per decode step.

Computes what `trl_tlt.rejection_sampler.verify_reference` computes, from the same inputs and uniforms: the target's
probabilities at the drafted tokens, the acceptance tests, the accepted length n, the residual (or bonus)
distribution at position n, its inverse-CDF sample (`trl_tlt.sampling.sample_inverse_cdf`; where rounding leaves
no token above u x total, the last of positive probability) and the log-probabilities of the emitted tokens. The
torch version takes ~15 kernel launches per step; at the small batches of the long tail, launches dominate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _target_and_draft_block(lp_next, q_row, v, V, rejected, d_next, HAS_Q: tl.constexpr):
    """p and q over the vocabulary block `v` at the next-token position (q = 0 unless a draft was rejected there)."""
    p = tl.exp(tl.load(lp_next + v, mask=v < V, other=float("-inf")))
    if HAS_Q:
        q = tl.where(rejected, tl.load(q_row + v, mask=v < V, other=0.0), 0.0)
    else:
        q = tl.where(v == d_next, 1.0, 0.0)
    return p, q


@triton.jit
def _sample_next_token(
    lp_next, q_ptr, draft_ptr, u_sample_ptr, row, n, n_valid, K, V, zero, V_BLOCK: tl.constexpr, HAS_Q: tl.constexpr
):
    """The next token at position n (row `row`): from the residual max(p - q, 0) after a rejection, else from p (the
    bonus token), by inverse CDF over the vocabulary in blocks."""
    rejected = n < n_valid
    at = tl.maximum(tl.minimum(n, K - 1), 0)  # a valid draft index (n when rejected)
    d_next = tl.where(rejected, tl.maximum(tl.load(draft_ptr + row * K + at), 0), -1)
    total_residual = zero
    total_p = zero
    for start in range(0, V, V_BLOCK):
        v = start + tl.arange(0, V_BLOCK)
        p, q = _target_and_draft_block(lp_next, q_ptr + (row * K + at) * V, v, V, rejected, d_next, HAS_Q)
        total_residual += tl.sum(tl.maximum(p - q, 0.0), axis=0)
        total_p += tl.sum(p, axis=0)
    use_residual = rejected & (total_residual > 0)  # round-off guard, as in the reference
    target = tl.load(u_sample_ptr + row) * tl.where(use_residual, total_residual, total_p)
    prefix = zero
    first = tl.full([], V, tl.int64)
    last_positive = tl.full([], -1, tl.int64)
    for start in range(0, V, V_BLOCK):
        v = start + tl.arange(0, V_BLOCK)
        p, q = _target_and_draft_block(lp_next, q_ptr + (row * K + at) * V, v, V, rejected, d_next, HAS_Q)
        r = tl.where(use_residual, tl.maximum(p - q, 0.0), p)
        positive = (r > 0) & (v < V)
        hit = ((prefix + tl.cumsum(r, axis=0)) > target) & positive
        first = tl.minimum(first, tl.min(tl.where(hit, v, V), axis=0).to(tl.int64))
        last_positive = tl.maximum(last_positive, tl.max(tl.where(positive, v, -1), axis=0).to(tl.int64))
        prefix += tl.sum(r, axis=0)
    return tl.where(first < V, first, last_positive)


@triton.jit
def _argmax(lp_next, V, V_BLOCK: tl.constexpr):
    """The first argmax of a row of V log-probabilities, in blocks."""
    best_value = tl.full([], float("-inf"), lp_next.dtype.element_ty)
    token = tl.full([], 0, tl.int64)
    for start in range(0, V, V_BLOCK):
        v = start + tl.arange(0, V_BLOCK)
        block = tl.load(lp_next + v, mask=v < V, other=float("-inf"))
        block_max = tl.max(block, axis=0)
        block_index = tl.argmax(block, axis=0).to(tl.int64) + start
        better = block_max > best_value
        token = tl.where(better, block_index, token)
        best_value = tl.where(better, block_max, best_value)
    return token


@triton.jit
def _verify_kernel(
    logp_ptr,  # (B, K + 1, V) processed target log-probabilities
    draft_ptr,  # (B, K) int64 draft tokens
    num_drafts_ptr,  # (B,) int64 valid drafts per row
    q_ptr,  # (B, K, V) draft probabilities (read only if HAS_Q)
    u_accept_ptr,  # (B, K) uniforms of the acceptance tests (read only if DO_SAMPLE)
    u_sample_ptr,  # (B,) uniforms of the final sample (read only if DO_SAMPLE)
    accepted_ptr,  # out (B,) int64
    token_ptr,  # out (B,) int64
    emitted_ptr,  # out (B, K + 1) log-probabilities of the emitted tokens
    K,
    V,
    K_BLOCK: tl.constexpr,
    V_BLOCK: tl.constexpr,
    HAS_Q: tl.constexpr,
    DO_SAMPLE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    lp_row = logp_ptr + row * (K + 1) * V
    zero = tl.sum(tl.zeros([V_BLOCK], dtype=logp_ptr.dtype.element_ty), axis=0)  # a scalar of the input dtype
    j = tl.arange(0, K_BLOCK)
    is_draft = j < K
    n_valid = tl.load(num_drafts_ptr + row)
    in_draft = j < n_valid
    drafts = tl.maximum(tl.load(draft_ptr + row * K + j, mask=is_draft, other=0), 0)
    lp_draft = tl.load(lp_row + j * V + drafts, mask=is_draft, other=float("-inf"))

    # 1. acceptance tests and the accepted length
    if DO_SAMPLE:
        u = tl.load(u_accept_ptr + row * K + j, mask=in_draft, other=2.0)
        if HAS_Q:
            q_draft = tl.load(q_ptr + (row * K + j) * V + drafts, mask=in_draft, other=1.0)
            accepted = (u * q_draft < tl.exp(lp_draft)) & in_draft  # strict: u = 0 never accepts p = 0
        else:
            accepted = (u < tl.exp(lp_draft)) & in_draft
    else:  # greedy: the draft must be its position's first argmax
        best = tl.full([K_BLOCK], float("-inf"), logp_ptr.dtype.element_ty)
        best_index = tl.zeros([K_BLOCK], dtype=tl.int64)
        for start in range(0, V, V_BLOCK):
            v = start + tl.arange(0, V_BLOCK)
            block = tl.load(
                lp_row + j[:, None] * V + v[None, :], mask=in_draft[:, None] & (v[None, :] < V), other=float("-inf")
            )
            block_max = tl.max(block, axis=1)
            block_index = tl.argmax(block, axis=1).to(tl.int64) + start
            better = block_max > best
            best_index = tl.where(better, block_index, best_index)
            best = tl.where(better, block_max, best)
        accepted = (best_index == drafts) & in_draft
    n = tl.min(tl.where(accepted, K_BLOCK, j), axis=0).to(tl.int64)  # leading accepted drafts
    lp_next = lp_row + n * V

    # 2. the next token at position n: from the residual max(p - q, 0) after a rejection, else from p (bonus)
    if DO_SAMPLE:
        token = _sample_next_token(
            lp_next, q_ptr, draft_ptr, u_sample_ptr, row, n, n_valid, K, V, zero, V_BLOCK, HAS_Q
        )
    else:
        token = _argmax(lp_next, V, V_BLOCK)

    # 3. outputs; emitted log-probs laid out as the reference's (drafts, with the next token at n and at K)
    tl.store(accepted_ptr + row, n)
    tl.store(token_ptr + row, token)
    lp_token = tl.load(lp_row + j * V + token, mask=j <= K, other=0.0)
    emitted = tl.where((j == n) | (j == K), lp_token, lp_draft)
    tl.store(emitted_ptr + row * (K + 1) + j, emitted, mask=j <= K)


def verify_triton(
    target_logprobs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniform_accept: torch.Tensor | None,
    uniform_sample: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same arguments and results as `trl_tlt.rejection_sampler.verify_reference`, in one kernel launch."""
    batch, k_plus_1, vocab = target_logprobs.shape
    k = k_plus_1 - 1
    logp = target_logprobs.contiguous()
    device = logp.device
    do_sample = uniform_accept is not None
    placeholder = logp.new_zeros(1)
    drafts = draft_token_ids.to(torch.int64).contiguous() if k else torch.zeros(1, dtype=torch.int64, device=device)
    accepted = torch.empty(batch, dtype=torch.int64, device=device)
    tokens = torch.empty(batch, dtype=torch.int64, device=device)
    emitted = torch.empty((batch, k_plus_1), dtype=logp.dtype, device=device)
    if batch == 0:
        return accepted, tokens, emitted
    _verify_kernel[(batch,)](
        logp,
        drafts,
        num_draft_tokens.to(torch.int64).contiguous(),
        draft_probs.to(logp.dtype).contiguous() if draft_probs is not None and k else placeholder,
        uniform_accept.contiguous() if do_sample and k else placeholder,
        uniform_sample.contiguous() if do_sample else placeholder,
        accepted,
        tokens,
        emitted,
        k,
        vocab,
        K_BLOCK=max(triton.next_power_of_2(k_plus_1), 2),
        V_BLOCK=min(triton.next_power_of_2(vocab), 1024),
        HAS_Q=draft_probs is not None and k > 0,
        DO_SAMPLE=do_sample,
    )
    return accepted, tokens, emitted
