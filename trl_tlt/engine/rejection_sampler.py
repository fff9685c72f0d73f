"""Rejection sampling (speculative verification): accept a prefix of each row's draft, emit one corrected or bonus token.

Leviathan et al. 2023, Chen et al. 2023. For row b with draft tokens d_1..d_L (L = num_draft_tokens[b] <= k),
draft distributions q_j and target (processed) distributions p_j, j = 1..L+1:

    accept d_j  iff  u_j * q_j(d_j) < p_j(d_j),  u_j ~ U[0, 1)        (probability min(1, p_j / q_j))
    n = number of leading accepted drafts
    n < L:  emit x ~ norm(max(p_{n+1} - q_{n+1}, 0))                   (corrected token)
    n = L:  emit x ~ p_{L+1}                                            (bonus token)

The emitted tokens d_1..d_n, x are then distributed exactly as n+1 tokens sampled from p one by one.
A deterministic drafter (n-gram) has q_j = onehot(d_j): acceptance probability p_j(d_j), and the residual is
p_{n+1} with d_{n+1} removed. Greedy decoding accepts d_j iff d_j = argmax p_j and emits argmax p_{n+1}.

`verify_reference` is the torch implementation (the CPU path); `trl_tlt.kernels.verify_triton` fuses the same
computation into one Triton launch for CUDA. This is also the speculation-off path (k = 0: every row emits one
token from p_1).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from .sampling import sample_inverse_cdf


def verify_drafts(
    target_logprobs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    do_sample: bool,
    generator: torch.Generator | None = None,
    one_hot: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verify a batch of drafts against the target.

    Args:
        target_logprobs: (B, k+1, V) processed target log-probabilities at the k+1 verified positions.
        draft_token_ids: (B, k) proposed tokens (entries at j >= num_draft_tokens[b] are ignored).
        num_draft_tokens: (B,) number of valid drafts per row, in [0, k].
        draft_probs: (B, k', V) draft distributions q_j (k' <= k), or None for a deterministic drafter (one-hot q).
        do_sample: False = greedy verification.
        generator: Random generator for the uniforms (acceptance tests and the final sample).
        one_hot: (B, k) drafts whose q is one-hot whatever `draft_probs` holds (a deterministic source among
            sampled ones, `HybridDrafter`); every draft at j >= k' must be one of them.

    Returns:
        num_accepted_tokens (B,), next_token_ids (B,) (the corrected or bonus token), and
        emitted_logprobs (B, k+1): log p_j of d_1..d_n then of the next token at index n (the rest is garbage).

    The uniforms are drawn here, then one implementation runs: the fused Triton kernel (`trl_tlt.kernels`) on CUDA,
    `verify_reference` elsewhere; `TRL_TLT_KERNELS=torch|triton` forces one (triton on CPU needs
    `TRITON_INTERPRET=1`). Both give the same tokens for the same uniforms. Drafts mixing sampled and one-hot q
    (`one_hot` with `draft_probs`) are verified by `verify_reference` only.
    """
    batch, k_plus_1, _ = target_logprobs.shape
    device, dtype = target_logprobs.device, target_logprobs.dtype
    if do_sample:
        uniform_accept = torch.rand((batch, k_plus_1 - 1), generator=generator, device=device, dtype=dtype)
        uniform_sample = torch.rand((batch,), generator=generator, device=device, dtype=dtype)
    else:
        uniform_accept = uniform_sample = None
    args = (target_logprobs, draft_token_ids, num_draft_tokens, draft_probs, uniform_accept, uniform_sample)
    if one_hot is not None and draft_probs is not None:
        return verify_reference(*args, one_hot=one_hot)
    if use_triton(device):
        # The repository's top-level kernels/ folder, installed as trl_tlt.kernels (pyproject's package-dir): imported
        # here only, lazily, so that CPU runs never import Triton.
        from ..kernels import verify_triton

        return verify_triton(*args)
    return verify_reference(*args)


def use_triton(device: torch.device) -> bool:
    """Which verification runs: `TRL_TLT_KERNELS` (auto, torch, triton); auto = Triton on CUDA when importable."""
    choice = os.environ.get("TRL_TLT_KERNELS", "auto")
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(f"TRL_TLT_KERNELS must be auto, torch or triton, got {choice!r}.")
    if choice != "auto":
        return choice == "triton"
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def verify_reference(
    target_logprobs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniform_accept: torch.Tensor | None,
    uniform_sample: torch.Tensor | None,
    one_hot: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch implementation of `verify_drafts` given its uniforms (None: greedy verification) and one-hot mask.

    The next token is sampled by inverse CDF (`sample_inverse_cdf`, with `uniform_sample`).
    """
    do_sample = uniform_accept is not None
    batch, k_plus_1, vocab = target_logprobs.shape
    k = k_plus_1 - 1
    device = target_logprobs.device
    positions = torch.arange(k, device=device)
    valid = positions[None, :] < num_draft_tokens[:, None]  # (B, k)
    drafts = draft_token_ids.clamp(min=0)

    if do_sample:
        p_draft = target_logprobs[:, :k].gather(-1, drafts[..., None]).squeeze(-1).exp()  # (B, k)
        q_draft = torch.ones_like(p_draft)
        if draft_probs is not None:
            sampled = draft_probs.size(1)
            q_draft[:, :sampled] = draft_probs.gather(-1, drafts[:, :sampled, None]).squeeze(-1)
            if one_hot is not None:
                q_draft = torch.where(one_hot, 1.0, q_draft)
        # Strict: torch.rand returns exactly 0.0 about once in 2^24 draws, and `<=` would then accept a draft with p = 0.
        accepted = (uniform_accept * q_draft < p_draft) & valid
    else:
        accepted = (target_logprobs[:, :k].argmax(dim=-1) == drafts) & valid
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # (B,)

    # Distribution of the next token at index n: residual if a draft was rejected there, else p (bonus).
    index = num_accepted[:, None, None].expand(batch, 1, vocab)
    next_logprobs = target_logprobs.gather(1, index).squeeze(1)  # (B, V)
    if do_sample:
        next_probs = next_logprobs.exp()
        rejected = num_accepted < num_draft_tokens  # (B,)
        if rejected.any():
            at = num_accepted.clamp(max=max(k - 1, 0))
            q_next = torch.zeros_like(next_probs).scatter_(-1, drafts.gather(1, at[:, None]), 1.0)
            if draft_probs is not None:
                from_q = draft_probs.gather(
                    1, at.clamp(max=draft_probs.size(1) - 1)[:, None, None].expand(batch, 1, vocab)
                )
                deterministic = at >= draft_probs.size(1)
                if one_hot is not None:
                    deterministic |= one_hot.gather(1, at[:, None]).squeeze(1)
                q_next = torch.where(deterministic[:, None], q_next, from_q.squeeze(1))
            residual = (next_probs - q_next).clamp(min=0)
            # A rejection implies p != q, so the residual has mass; guard against round-off all the same.
            residual_ok = residual.sum(-1, keepdim=True) > 0
            residual = torch.where(residual_ok, residual, next_probs)
            next_probs = torch.where(rejected[:, None], residual, next_probs)
        next_tokens = sample_inverse_cdf(next_probs, uniform_sample)
    else:
        next_tokens = next_logprobs.argmax(dim=-1)

    # Log-probabilities of the emitted tokens under the (unmodified) processed target distribution.
    emitted = torch.cat([drafts, next_tokens[:, None]], dim=1)  # (B, k+1)
    emitted = emitted.scatter(1, num_accepted[:, None], next_tokens[:, None])
    emitted_logprobs = target_logprobs.gather(-1, emitted[..., None]).squeeze(-1)
    return num_accepted, next_tokens, emitted_logprobs
