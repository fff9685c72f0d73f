"""Sampling settings and the logits processing the engine applies (the same order as `transformers.generate`).

Order: suppressed tokens and repetition penalty, then (sampling only) temperature, top-k, top-p, min-p. The result is a log-probability
distribution over the vocabulary; filtered tokens get -inf. Log-probabilities returned to the trainer are taken
from this processed distribution.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """What GRPO samples with.

    Args:
        do_sample: False means greedy decoding (argmax after the repetition penalty; temperature and the
            filters are ignored, as in `transformers.generate`).
        temperature: Softmax temperature (> 0).
        top_k: Keep the k most likely tokens (0 or None = off).
        top_p: Nucleus filtering (1.0 = off).
        min_p: Drop tokens below `min_p` times the top probability (0 or None = off).
        repetition_penalty: CTRL-style penalty on tokens already in the prompt or completion (1.0 = off).
        max_new_tokens: Token budget of each completion.
        eos_token_ids: Ids that end a completion (kept in the output).
        suppress_token_ids: Ids never generated (`generate`'s `suppress_tokens`: their logits are set to -inf).

    Example:
        >>> SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=256, eos_token_ids=(2,))
    """

    do_sample: bool = True
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    max_new_tokens: int = 256
    eos_token_ids: tuple[int, ...] = ()
    suppress_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.temperature <= 0 and self.do_sample:
            raise ValueError(f"`temperature` must be > 0 when sampling, got {self.temperature}; use do_sample=False.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"`top_p` must be in (0, 1], got {self.top_p}.")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"`top_k` must be >= 0, got {self.top_k}.")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"`min_p` must be in [0, 1], got {self.min_p}.")
        if self.repetition_penalty <= 0:
            raise ValueError(f"`repetition_penalty` must be > 0, got {self.repetition_penalty}.")
        if self.max_new_tokens < 1:
            raise ValueError(f"`max_new_tokens` must be >= 1, got {self.max_new_tokens}.")

    @property
    def uses_repetition_penalty(self) -> bool:
        return self.repetition_penalty != 1.0


def upcast_logits(logits: torch.Tensor) -> torch.Tensor:
    """Process logits in float32 at least (float64 models stay float64)."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """`RepetitionPenaltyLogitsProcessor` with a boolean mask of seen tokens. logits, seen: (..., V)."""
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def process_logits(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None) -> torch.Tensor:
    """Processed log-probabilities (..., V) from raw logits (..., V); `seen` (..., V) for the repetition penalty."""
    if params.suppress_token_ids:
        suppressed = torch.tensor(params.suppress_token_ids, device=logits.device)
        logits = logits.index_fill(-1, suppressed, float("-inf"))
    if params.uses_repetition_penalty:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if not params.do_sample:
        return torch.log_softmax(logits, dim=-1)
    if params.temperature != 1.0:
        logits = logits / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.size(-1)), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - params.top_p)
        remove_sorted[..., -1] = False  # keep at least one token
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    if params.min_p:
        probs = logits.softmax(dim=-1)
        threshold = params.min_p * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def sample_draft_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """A drafter's distribution q as log-probabilities (..., V), from policy-vocabulary logits (..., V).

    q may be any distribution (verification stays exact), so the repetition penalty, which needs the full history,
    is skipped. A row whose distribution is not one (a drafter with NaN or infinite weights) becomes uniform:
    speculation then costs speed, never correctness.
    """
    return _draft_distribution(logits, params)[0]


def _draft_distribution(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_draft_logprobs` and its exponential."""
    if params.uses_repetition_penalty:
        params = dataclasses.replace(params, repetition_penalty=1.0)
    logprobs = process_logits(upcast_logits(logits), params)
    probs = logprobs.exp()
    if not math.isfinite(probs.sum()):  # NaN or inf anywhere (filtered tokens are 0, fine): find the broken rows
        broken = ~(torch.isfinite(probs).all(dim=-1, keepdim=True) & (probs.sum(dim=-1, keepdim=True) > 0))
        logprobs = torch.where(broken, torch.full_like(logprobs, -math.log(logprobs.size(-1))), logprobs)
        probs = logprobs.exp()
    return logprobs, probs


def sample_inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row (B,) from a distribution (B, V) (unnormalised, finite, non-negative, with mass) and one
    uniform per row (B,) in [0, 1]: the first token whose cumulative probability exceeds u x total, or where none
    does (u = 1, or rounding), the last token that adds mass. Either way a token of positive probability. Exact, and
    a few times cheaper than `torch.multinomial` on CPU. `kernels/verify.py` computes the same, in blocks."""
    cumulative = probs.cumsum(dim=-1)
    total = cumulative[:, -1:]
    first_above = (cumulative <= uniform[:, None] * total).sum(dim=-1)
    last_adding_mass = (cumulative < total).sum(dim=-1)
    return torch.minimum(first_above, last_adding_mass)


def sample_categorical(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """`sample_inverse_cdf` on a fresh uniform per row, drawn from `generator`."""
    uniform = torch.rand((probs.size(0), 1), generator=generator, device=probs.device, dtype=probs.dtype)
    return sample_inverse_cdf(probs, (1 - uniform)[:, 0])


def sample_draft(logits: torch.Tensor, params: SamplingParams, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft tokens (B,) and q (B, V) from policy-vocabulary logits (B, V) (`sample_draft_logprobs`); greedy
    drafts the argmax (verification then ignores q)."""
    probs = _draft_distribution(logits, params)[1]
    if not params.do_sample:
        return probs.argmax(dim=-1), probs
    return sample_categorical(probs, generator), probs
