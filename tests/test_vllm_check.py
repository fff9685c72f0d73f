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
    trainer.tlt = SimpleNamespace(
        spot_waits_for_check=lambda training, speculating: False, defer_spot_training=False, deferred_turns=None,
        reads_step_features=lambda *flags: False,
    )  # fmt: skip
    trainer.model_wrapped = torch.nn.Linear(1, 1)
    trainer.vllm_generation = SimpleNamespace(speculating=True)
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, False
    trainer.args = SimpleNamespace(drafter_type="eagle3", vllm_mode="colocate")
    trainer.model = SimpleNamespace(training=True)
    trainer.state = SimpleNamespace(num_input_tokens_seen=0)
    trainer._metrics = {"train": defaultdict(list)}
    trainer._check_vllm_samples = lambda output, sink: SampleMoments(tokens=2.0, deviation=0.1, variance=1.0)
    output = trainer._generate_and_score_completions([{"prompt": "p"}])
    assert output["sampling_per_token_logps"] is logps


@pytest.mark.parametrize("case", ["passes", "faulty", "raises"])
def test_spot_training_on_vllms_rollouts_waits_for_the_check_and_reads_its_forward(monkeypatch, tokenizer, case):
    """`spot_feature_source="rollout"` (the stack's own default; the config's "auto" reads the training step's with
    vLLM): vLLM returns no hidden states: spot training waits until the check of the batch has run its forward, trains
    on the states that forward recorded (no forward of its own: `rerun_samples` 0) and pushes the drafter; on a batch
    that fails the check it trains on nothing (the batch is generated again, speculation off); a batch that raises
    leaves no turns behind for a later call. Mutations caught: train at the rollout's end as before (the drafter
    trains before the check, and reruns the policy); keep the stash after an exception."""
    from collections import defaultdict
    from contextlib import contextmanager
    from types import SimpleNamespace

    from trl import GRPOTrainer

    from trl_tlt import TLTGRPOTrainer
    from trl_tlt.drafters.eagle3 import Eagle3Model
    from trl_tlt.engine import FixedSpeculation
    from trl_tlt.tooling.tiny import build_tiny_model
    from trl_tlt.trainer.stack import RolloutStack, RolloutTurn
    from trl_tlt.training.spot import DataBuffer, SpotTrainer
    from trl_tlt.vllm.check import SampleMoments

    policy = build_tiny_model(tokenizer, hidden_size=64, num_hidden_layers=4, num_attention_heads=2).eval()
    spot = SpotTrainer(Eagle3Model.for_policy(policy), DataBuffer(window=1), steps_per_phase=1)
    stack = RolloutStack(None, None, FixedSpeculation(0), FixedSpeculation(0), spot, torch.Generator())
    prompts, completions = [[5, 9, 17], [3, 40]], [[21, 22, 23, 24], [8, 8, 9]]
    output = {  # GRPOTrainer's layout: prompts left-padded, completions right-padded
        "prompt_ids": torch.tensor([[5, 9, 17], [0, 3, 40]]),
        "prompt_mask": torch.tensor([[1, 1, 1], [0, 1, 1]]),
        "completion_ids": torch.tensor([[21, 22, 23, 24], [8, 8, 9, 0]]),
        "completion_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]),
    }

    class Generation:
        speculating = True
        pushes = 0

        def sync_drafter(self):
            self.pushes += 1

        def disable_speculation(self, reason=None):
            self.speculating = False

    def parent(self, inputs):
        self.tlt.open_rollout()
        stats = {"verify_steps": 4, "mean_acceptance_length": 1.5} if self.vllm_generation.speculating else None
        self.tlt.record(RolloutTurn(prompts, completions, 1.0, stats))
        self._end_rollout()
        assert spot.total_steps == 0  # not at the rollout's end: after the check
        if case == "raises":
            raise RuntimeError("a reward function failed")
        return output

    def check(output, sink):  # the check's forward, as `policy_sample_moments` runs it
        with torch.no_grad(), sink.recording(policy):
            policy(
                input_ids=torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1),
                attention_mask=torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1),
            )
        return SampleMoments(tokens=7.0, deviation=100.0 if case == "faulty" else 0.1, variance=1.0)

    @contextmanager
    def unwrapped():
        yield policy

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", parent)
    trainer = object.__new__(TLTGRPOTrainer)
    trainer.tlt, trainer.use_vllm, trainer.vllm_generation = stack, True, Generation()
    trainer.args = SimpleNamespace(drafter_type="eagle3", vllm_mode="colocate", report_to=[])
    trainer.model, trainer.model_wrapped = SimpleNamespace(training=True), policy
    trainer.accelerator = SimpleNamespace(unwrap_model=lambda model: policy, is_main_process=True)
    trainer.state = SimpleNamespace(num_input_tokens_seen=0, global_step=3)
    trainer._metrics = {"train": defaultdict(list)}
    trainer._check_vllm_samples, trainer._unwrapped_for_generation = check, unwrapped
    if case == "raises":
        with pytest.raises(RuntimeError, match="reward"):
            trainer._generate_and_score_completions([{"prompt": "p"}])
        assert stack.deferred_turns is None and not stack.defer_spot_training
        assert spot.total_steps == 0 and not spot.buffer.samples
        return
    assert trainer._generate_and_score_completions([{"prompt": "p"}]) is output
    if case == "faulty":  # generated again without speculation; nothing trained on, nothing buffered
        assert not trainer.vllm_generation.speculating and trainer.tlt.vllm_spec_faults == 1
        assert spot.total_steps == 0 and not spot.buffer.samples and trainer.vllm_generation.pushes == 0
        return
    assert spot.total_steps == 1 and spot.rerun_samples == 0 and trainer.vllm_generation.pushes == 1
    assert trainer._metrics["train"]["tlt/drafter_rerun_samples"] == [0.0]
    recorded = {tuple(s.token_ids): s.features for s in [*spot.buffer.samples, *spot.buffer.held_out]}
    reference = policy(torch.tensor([prompts[1] + completions[1]]), output_hidden_states=True).hidden_states
    expected = torch.stack([reference[i][0, :-1] for i in spot.feature_layers(policy)], dim=1)
    torch.testing.assert_close(recorded[tuple(prompts[1] + completions[1])], expected, rtol=1e-4, atol=1e-4)
