"""Drafter training: the chunked liger KL equals the plain one, only completion tokens count, training helps."""

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model

from trl_tlt.drafters import ModelDrafter
from trl_tlt.drafters.eagle3 import Eagle3Drafter, Eagle3Model, eagle3_config
from trl_tlt.engine.sampling import SamplingParams
from trl_tlt.tooling.tiny import build_tiny_model
from trl_tlt.training.distillation import DistillConfig, DrafterSample, distill_kl, pack, policy_features
from trl_tlt.training.warm_start import evaluate_acceptance, generate_samples, train_drafter


def test_chunked_kl_equals_full_kl():
    torch.manual_seed(0)
    s_in, t_in = torch.randn(50, 16), torch.randn(50, 8)
    s_w, t_w = torch.randn(30, 16), torch.randn(30, 8)
    expected = (
        F.kl_div(
            torch.log_softmax(s_in @ s_w.t(), -1),
            torch.log_softmax(t_in @ t_w.t(), -1),
            log_target=True,
            reduction="sum",
        )
        / 50
    )
    torch.testing.assert_close(distill_kl(s_in, s_w, t_in, t_w, chunk_size=16), expected)


def test_pack_masks_completion_tokens_and_separates_samples(tokenizer):
    policy = build_tiny_model(tokenizer, hidden_size=64, num_hidden_layers=2, num_attention_heads=2).eval()
    samples = [DrafterSample(list(range(3, 13)), 4), DrafterSample(list(range(20, 27)), 3)]
    batch = pack(policy_features(policy, samples, [0, 1, 1]), max_tokens=64)
    assert len(batch) == 1
    b = batch[0]
    assert b.input_ids.shape == (1, 9 + 6)
    # Index t predicts token t+2: exactly the completion tokens are predicted, once each.
    assert int(b.loss_mask.sum()) == (10 - 4) + (7 - 3)
    assert b.seq_ids[0].tolist() == [1] * 9 + [2] * 6 and b.position_ids[0, 9] == 0
    assert pack(policy_features(policy, samples, [0, 1, 1]), max_tokens=10).__len__() == 2


@pytest.fixture(scope="module")
def trained_setup(tokenizer):
    torch.manual_seed(0)
    policy = build_tiny_model(tokenizer, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, seed=3).eval()
    params = SamplingParams(temperature=0.7, max_new_tokens=24, eos_token_ids=(tokenizer.eos_token_id,))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (5,), generator=g).tolist() for _ in range(160)]
    samples = generate_samples(policy, prompts[:128], params)
    return policy, params, samples, prompts[128:]


@pytest.mark.slow
def test_eagle3_training_raises_acceptance(trained_setup):
    policy, params, samples, held_out = trained_setup
    head = Eagle3Model(
        eagle3_config(policy.config, aux_hidden_state_layer_ids=[0, 1, 1]), policy.get_input_embeddings()
    )
    before = evaluate_acceptance(policy, Eagle3Drafter(head), held_out, params, k=3)
    history = train_drafter(
        policy,
        head,
        samples,
        epochs=6,
        learning_rate=3e-3,
        config=DistillConfig(ttt_length=3, max_tokens_per_batch=512),
        progress=False,
    )
    after = evaluate_acceptance(policy, Eagle3Drafter(head), held_out, params, k=3)
    assert history[-1]["loss"] < history[0]["loss"] / 2
    assert after["mean_acceptance_length"] > before["mean_acceptance_length"] + 0.5, (before, after)


def test_lora_lm_drafter_training(trained_setup, tokenizer):
    policy, params, samples, held_out = trained_setup
    small = build_tiny_model(tokenizer, hidden_size=64, num_hidden_layers=1, num_attention_heads=2, seed=9)
    lora = get_peft_model(small, LoraConfig(r=8, target_modules="all-linear", lora_alpha=16))
    frozen = {n: p.clone() for n, p in lora.named_parameters() if not p.requires_grad}
    history = train_drafter(policy, lora, samples, epochs=3, learning_rate=3e-3, progress=False)
    assert history[-1]["loss"] < history[0]["loss"]
    assert all(torch.equal(p, frozen[n]) for n, p in lora.named_parameters() if not p.requires_grad)
    stats = evaluate_acceptance(policy, ModelDrafter(lora, policy.config.vocab_size), held_out[:8], params, k=2)
    assert stats["num_drafts"] > 0
