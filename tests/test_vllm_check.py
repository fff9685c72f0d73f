"""The check of vLLM's speculative samples (trl_tlt/vllm/check.py) has power and no false alarms, on synthetic rollouts
whose exact distribution is known (no vLLM needed)."""

import pytest
import torch

from trl_tlt.engine.sampling import SamplingParams, process_logits, sample_inverse_cdf
from trl_tlt.vllm.check import SAMPLE_Z_THRESHOLD, SAMPLING_LOGPROB_TOLERANCE, sample_moments, seen_before


def rollout(
    params: SamplingParams, seed: int, sample_with: SamplingParams | None = None, batch=32, length=48, vocab=64
):
    """Logits of a policy at every completion position and tokens sampled from `sample_with`'s processed distribution
    (default: `params`, the policy's own sampling), with the processed logprobs vLLM would report for them."""
    g = torch.Generator().manual_seed(seed)
    logits = 2.5 * torch.randn(batch, length, vocab, generator=g)
    sampler = process_logits(logits, sample_with or params).exp()
    u = torch.rand(batch * length, generator=g)
    tokens = sample_inverse_cdf(sampler.reshape(-1, vocab), u).view(batch, length)
    reported = process_logits(logits, params).gather(-1, tokens[..., None]).squeeze(-1)
    return logits, tokens, torch.ones_like(tokens, dtype=torch.bool), reported


HEALTHY = [
    SamplingParams(),
    SamplingParams(temperature=0.7),
    SamplingParams(top_p=0.8, top_k=20),
    SamplingParams(temperature=1.2, min_p=0.05),
]


@pytest.mark.parametrize("params", HEALTHY, ids=["T1", "T0.7", "top_p0.8-top_k20", "T1.2-min_p"])
def test_healthy_rollouts_are_not_flagged(params):
    """No false alarm on the policy's own samples, whatever the sampling settings: |z| stays small over 10 rollouts and
    the processed logprobs agree. (Against TRL's unprocessed `old_per_token_logps`, the check the trainer ran before,
    a healthy top_p = 0.8 rollout reads a mean gap above the tolerance: shown below.)"""
    zs = []
    for seed in range(10):
        logits, tokens, mask, reported = rollout(params, seed)
        moments = sample_moments(logits, tokens, mask, params, reported_logprobs=reported)
        assert not moments.faulty, moments.describe()
        assert moments.mean_logprob_diff < 1e-5 and moments.tokens > 0.9 * tokens.numel()
        zs.append(moments.z)
    assert max(abs(z) for z in zs) < 4.5 and abs(sum(zs) / len(zs)) < 1.0  # about standard normal
    if params.top_p < 1.0:
        unprocessed = torch.log_softmax(logits / params.temperature, -1).gather(-1, tokens[..., None]).squeeze(-1)
        assert (unprocessed - reported).abs().mean() > SAMPLING_LOGPROB_TOLERANCE  # the old comparison's false alarm


def test_samples_that_are_not_the_policys_are_caught():
    """A rollout sampled at T = 0.8 that reports the policy's (T = 1) logprobs: the logprob comparison sees nothing,
    the sample test does (z far past the threshold, on one rollout)."""
    params = SamplingParams()
    logits, tokens, mask, reported = rollout(params, seed=0, sample_with=SamplingParams(temperature=0.8))
    moments = sample_moments(logits, tokens, mask, params, reported_logprobs=reported)
    assert moments.mean_logprob_diff < 1e-5  # the logprobs are the policy's: no comparison of them can tell
    assert moments.z > SAMPLE_Z_THRESHOLD and moments.faulty


def test_a_mild_bias_is_caught_and_a_broken_logprob_is_a_fault():
    """A sampler at T = 0.9 (a 10% temperature error) is caught on one rollout of 6,144 tokens (64 completions of 96); a
    NaN logprob, a token outside top-k, and logprobs nats off are faults."""
    params = SamplingParams(top_k=20)
    biased = SamplingParams(temperature=0.9, top_k=20)
    logits, tokens, mask, reported = rollout(params, seed=1, sample_with=biased, batch=64, length=96)
    assert sample_moments(logits, tokens, mask, params, reported_logprobs=reported).faulty
    logits, tokens, mask, reported = rollout(params, seed=2)
    nan = reported.clone()
    nan[0, 3] = float("nan")
    assert sample_moments(logits, tokens, mask, params, reported_logprobs=nan).nans == 1
    outside = tokens.clone()
    outside[0, 0] = process_logits(logits, params)[0, 0].argmin()  # filtered out by top-k
    assert sample_moments(logits, outside, mask, params).impossible == 1
    off = sample_moments(logits, tokens, mask, params, reported_logprobs=reported - 1.0)
    assert off.mean_logprob_diff == pytest.approx(1.0) and off.faulty


def test_the_repetition_penalty_is_applied_as_vllm_applies_it():
    """With a repetition penalty, each position's distribution penalises the prompt and the completion so far: the
    policy's own samples pass, samples drawn without the penalty are caught."""
    params = SamplingParams(repetition_penalty=2.0)
    g = torch.Generator().manual_seed(3)
    batch, length, vocab = 64, 64, 16
    logits = 2.0 * torch.randn(batch, length, vocab, generator=g)
    prompt = torch.randint(0, vocab, (batch, 5), generator=g)
    tokens = torch.zeros(batch, length, dtype=torch.long)
    for t in range(length):  # sampled position by position, each with what it has seen so far
        seen = seen_before(prompt, torch.ones_like(prompt), tokens[:, :t], vocab)[:, -1] if t else None
        if seen is None:
            seen = torch.zeros(batch, vocab, dtype=torch.bool).scatter_(1, prompt, True)
        probs = process_logits(logits[:, t], params, seen).exp()
        tokens[:, t] = sample_inverse_cdf(probs, torch.rand(batch, generator=g))
    seen = seen_before(prompt, torch.ones_like(prompt), tokens, vocab)
    mask = torch.ones_like(tokens, dtype=torch.bool)
    assert not sample_moments(logits, tokens, mask, params, seen).faulty
    plain = sample_inverse_cdf(torch.softmax(logits, -1).reshape(-1, vocab), torch.rand(batch * length, generator=g))
    assert sample_moments(logits, plain.view(batch, length), mask, params, seen).faulty


def test_vllms_sampling_logprobs_reach_the_off_policy_mask_as_in_grpo_trainer(monkeypatch):
    """With vLLM and the importance-sampling correction off, GRPOTrainer's off-policy mask (`off_policy_mask_threshold`)
    reads vLLM's sampling logprobs: TLTGRPOTrainer hands them on once the check passed. Mutation caught: they were
    dropped there (the mask then read the trainer's own logprobs and never triggered on a sampler's drift)."""
    from collections import defaultdict
    from types import SimpleNamespace

    from trl import GRPOTrainer

    from trl_tlt import TLTGRPOTrainer
    from trl_tlt.vllm.check import SampleMoments

    logps = torch.tensor([[-0.5, -1.0]])
    monkeypatch.setattr(
        GRPOTrainer, "_generate_and_score_completions", lambda self, inputs: {"sampling_per_token_logps": logps}
    )
    trainer = object.__new__(TLTGRPOTrainer)
    trainer.tlt = SimpleNamespace()
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, False
    trainer.args = SimpleNamespace(drafter_type="eagle3", vllm_mode="colocate")
    trainer.model = SimpleNamespace(training=True)
    trainer.state = SimpleNamespace(num_input_tokens_seen=0)
    trainer._metrics = {"train": defaultdict(list)}
    trainer._check_vllm_samples = lambda output: SampleMoments(tokens=2.0, deviation=0.1, variance=1.0)
    output = trainer._generate_and_score_completions([{"prompt": "p"}])
    assert output["sampling_per_token_logps"] is logps
