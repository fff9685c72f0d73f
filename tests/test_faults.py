"""A drafter fault costs speed, never correctness (docs/reliability.md): broken proposals leave rollouts lossless,
non-finite drafter losses, gradients or weights are dropped or rolled back, and the policy trains as without them."""

import pytest
import torch
from datasets import Dataset
from test_engine import (
    EOS,
    chi_square_pvalue,
    exact_sequence_distribution,
    hf_greedy,
    peaked_model,
    random_prompts,
)
from test_trainer import PROMPTS, config_kwargs, reward_len
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

from trl_tlt import TLTConfig, TLTGRPOTrainer
from trl_tlt.drafters import Draft, ModelDrafter
from trl_tlt.drafters.eagle3 import Eagle3Drafter, Eagle3Model
from trl_tlt.engine import SpeculativeEngine
from trl_tlt.sampling import SamplingParams
from trl_tlt.spot import DataBuffer, SpotSchedule, SpotTrainer


class FaultyDrafter(ModelDrafter):
    """Drafts with a real model, then breaks what it reports: q NaN, q all zero, a token outside the vocabulary, or a
    point mass (q one-hot on a fixed token, which is then drafted: a valid, deterministic, useless drafter)."""

    def __init__(self, model, vocab_size, fault):
        super().__init__(model, vocab_size)
        self.fault = fault

    def propose(self, ctx, k):
        draft = super().propose(ctx, k)
        ids, probs = draft.token_ids.clone(), draft.probs.clone()
        if self.fault == "nan_q":
            probs[0::2] = float("nan")  # every other row
        elif self.fault == "zero_q":
            probs[1::2] = 0.0
        elif self.fault == "out_of_range":
            ids[:, -1] = self.vocab_size + 5
        elif self.fault == "point_mass":
            ids[:] = 7
            probs = torch.zeros_like(probs)
            probs[..., 7] = 1.0
        return Draft(ids, draft.num_tokens, probs)


FAULTS = ["nan_q", "zero_q", "out_of_range", "point_mass", "nan_weights"]


def faulty_drafter(fault, model, tokenizer):
    if fault == "nan_weights":  # an EAGLE-3 head whose weights went NaN: its logits are NaN
        head = Eagle3Model.for_policy(model)
        with torch.no_grad():
            head.fc.weight.fill_(float("nan"))
        return Eagle3Drafter(head)
    return FaultyDrafter(peaked_model(tokenizer, noise=0.3), model.config.vocab_size, fault)


@pytest.mark.parametrize("fault", FAULTS)
def test_broken_proposals_leave_sampling_exact(tokenizer, fault):
    """Chi-square of 3-token completions against the exact distribution, with every fault (8,000 samples)."""
    model = peaked_model(tokenizer)
    prompt = [11, 12, 13, 11, 12]
    params = SamplingParams(temperature=1.3, top_p=0.6, max_new_tokens=3)
    expected = exact_sequence_distribution(model, prompt, params, length=3)
    engine = SpeculativeEngine(model, drafter=faulty_drafter(fault, model, tokenizer), num_speculative_tokens=3)
    out = engine.generate([prompt] * 8000, params, generator=torch.Generator().manual_seed(5))
    assert chi_square_pvalue([tuple(c) for c in out.completion_ids], expected) > 1e-3
    if fault in ("nan_q", "zero_q", "out_of_range"):
        assert out.stats.num_invalid_drafts > 0  # the broken rows were dropped, not verified


@pytest.mark.parametrize("fault", FAULTS)
def test_broken_proposals_leave_greedy_exact(tiny_model_f64, tokenizer, fault):
    model = tiny_model_f64
    prompts = random_prompts(6, model.config.vocab_size)
    expected = hf_greedy(model, prompts, max_new_tokens=16)
    drafter = faulty_drafter(fault, model, tokenizer)
    if isinstance(drafter, FaultyDrafter):
        drafter.model.to(torch.float64)
    params = SamplingParams(do_sample=False, max_new_tokens=16, eos_token_ids=(EOS,))
    out = SpeculativeEngine(model, drafter=drafter, num_speculative_tokens=3).generate(prompts, params)
    assert out.completion_ids == expected


def spot_trainer(policy):
    buffer = DataBuffer(window=2)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, policy.config.vocab_size, (12, 4), generator=g).tolist()
    completions = torch.randint(3, policy.config.vocab_size, (12, 16), generator=g).tolist()
    buffer.add(prompts, completions)
    schedule = SpotSchedule(learning_rate=3e-3, warmup_steps=1)
    return SpotTrainer(Eagle3Model.for_policy(policy), buffer, schedule=schedule, tokens_per_step=128)


def test_non_finite_drafter_step_is_dropped_or_rolled_back(tokenizer, monkeypatch):
    policy = peaked_model(tokenizer).float()
    spot = spot_trainer(policy)
    assert spot.step(policy) is not None
    good = [p.detach().clone() for p in spot.params]
    # a NaN loss (a poisoned distillation batch): the step is dropped, nothing changes
    original = SpotTrainer._loss

    def nan_loss(self, policy, features):
        loss, metrics = original(self, policy, features)
        return loss * float("nan"), metrics

    monkeypatch.setattr(SpotTrainer, "_loss", nan_loss)
    assert spot.step(policy) is None and spot.total_resets == 1
    assert all(torch.equal(a, b) for a, b in zip(good, spot.params, strict=True))
    monkeypatch.setattr(SpotTrainer, "_loss", original)
    # weights that went NaN (here: injected): the next phase rolls them back to the last good ones and goes on
    with torch.no_grad():
        spot.drafter.fc.weight.fill_(float("inf"))
    stats = spot.run_between_rollouts(policy)
    assert stats.resets == 1 and stats.summary["resets"] == 1 and stats.steps == 4 and spot.total_resets == 2
    assert all(bool(torch.isfinite(p).all()) for p in spot.params)
    assert all(p.grad is None for p in policy.parameters())


def greedy_run(model_dir, tmp_path, trainer_cls, config_cls, poison_after_step=None, **extra):
    args = config_cls(**config_kwargs(tmp_path, max_steps=3, generation_kwargs={"do_sample": False}), **extra)
    trainer = trainer_cls(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=reward_len,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 6}),
    )
    if poison_after_step is not None:
        from transformers import TrainerCallback

        class Poison(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == poison_after_step:
                    with torch.no_grad():
                        trainer.tlt_drafter.model.midlayer.mlp.down_proj.weight.fill_(float("nan"))

        trainer.add_callback(Poison())
    trainer.train()
    return trainer


def test_drafter_poisoned_mid_run_the_policy_trains_as_without(tiny_model_dirs, tmp_path):
    """NaN drafter weights after step 1 (spot training on): rollouts stay exact, the drafter is rolled back (logged
    as tlt/drafter_resets) and the policy's weights after 3 steps equal GRPOTrainer's (greedy: the completions do
    not depend on the drafter)."""
    model_dir = tiny_model_dirs["qwen2"]
    grpo = greedy_run(model_dir, tmp_path / "grpo", GRPOTrainer, GRPOConfig)
    tlt = greedy_run(
        model_dir, tmp_path / "tlt", TLTGRPOTrainer, TLTConfig, poison_after_step=1, speculative_selector="fixed"
    )
    resets = [h.get("tlt/drafter_resets") for h in tlt.state.log_history if "tlt/drafter_resets" in h]
    assert resets[0] == 0 and resets[1] >= 1
    assert all(bool(torch.isfinite(p).all()) for p in tlt.tlt_spot.params)
    for (name, p_base), (_, p_tlt) in zip(grpo.model.named_parameters(), tlt.model.named_parameters(), strict=True):
        torch.testing.assert_close(p_tlt, p_base, msg=name)
