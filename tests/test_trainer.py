"""TLTGRPOTrainer is a drop-in GRPOTrainer: same constructor, same results (greedy), tlt/ metrics, clear errors."""

import inspect

import pytest
import torch
from datasets import Dataset
from testing_utils import PROMPTS, config_kwargs, drafter_args, fake_hub, reward_digits, reward_len, train_one_step
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer
from transformers.generation.utils import GenerationMixin
from trl import GRPOConfig, GRPOTrainer
from trl.generation.vllm_generation import VLLMGeneration
from trl.trainer import grpo_trainer

from trl_tlt import TLTConfig, TLTGRPOTrainer
from trl_tlt.drafters.eagle3 import Eagle3Model
from trl_tlt.engine.speculation import BanditSpeculation, FixedSpeculation
from trl_tlt.trainer.stack import RolloutTurn
from trl_tlt.training.spot.schedule import expected_speedup
from trl_tlt.vllm.generation import speculative_config


def test_the_constructor_accepts_exactly_what_grpo_trainer_accepts(tiny_model_dirs, tmp_path):
    """Mutation caught: a constructor with its own parameters (it required `reward_funcs`, optional in TRL 1.16 where an
    environment may own the reward: TRL's own tests failed with a TypeError instead of GRPOTrainer's ValueError)."""
    assert inspect.signature(TLTGRPOTrainer.__init__) == inspect.signature(GRPOTrainer.__init__)
    errors = []
    for trainer_cls, config_cls in ((GRPOTrainer, GRPOConfig), (TLTGRPOTrainer, TLTConfig)):
        with pytest.raises(ValueError) as error:
            trainer_cls(
                model=AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen2"]),
                args=config_cls(**config_kwargs(tmp_path)),
                train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
            )
        errors.append(str(error.value))
    assert "No reward source provided" in errors[0] and errors[0] == errors[1]


def test_private_hooks_we_override_still_exist():
    params = list(inspect.signature(GRPOTrainer.__init__).parameters)
    assert params[:4] == ["self", "model", "reward_funcs", "args"]  # TLTGRPOTrainer passes these on positionally
    params = list(inspect.signature(GRPOTrainer._generate_single_turn).parameters)
    assert params == ["self", "prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"]
    assert hasattr(GRPOTrainer, "_generate_and_score_completions")
    assert list(inspect.signature(GRPOTrainer._save_checkpoint).parameters) == ["self", "model", "trial"]
    # resume: the rollout state is restored where every backend's resume passes once the policy is loaded (DeepSpeed's
    # goes through `deepspeed_load_checkpoint`, never `_load_from_checkpoint`)
    assert list(inspect.signature(GRPOTrainer._load_optimizer_and_scheduler).parameters) == ["self", "checkpoint"]
    loop_src = inspect.getsource(Trainer._prepare_for_training)
    branches = loop_src[loop_src.index("if self.is_deepspeed_enabled:\n                deepspeed_load_checkpoint") :]
    assert (
        "\n            self._load_optimizer_and_scheduler(resume_from_checkpoint)" in branches.split("\n        #")[0]
    )
    trainer_src = inspect.getsource(GRPOTrainer.__init__)
    # TLTGRPOTrainer swaps the module-level VLLMGeneration that __init__ calls (keyword arguments only) for its own
    assert "self.vllm_generation = VLLMGeneration(\n" in trainer_src and grpo_trainer.VLLMGeneration is VLLMGeneration
    for method in ("_init_vllm", "_iter_named_params", "sync_weights", "generate"):
        assert hasattr(VLLMGeneration, method), method
    assert "LLM(" in inspect.getsource(VLLMGeneration._init_vllm)  # the call TLTVLLMGeneration adds kwargs to
    # sleep mode: generate() re-pushes the weights through sync_weights(), which TLTVLLMGeneration extends with the drafter
    assert "self.sync_weights()" in inspect.getsource(VLLMGeneration.generate)
    # the training phase: every forward over completions goes through this method (positional arguments below; the
    # rest are multimodal tensors, None for text), and _prepare_inputs buffers the split generation batch
    params = inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters
    assert list(params)[:8] == [
        "self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy",
        "compute_aux_loss",
    ]  # fmt: skip
    assert all(p.default is None for p in list(params.values())[8:])
    prepare_src = inspect.getsource(GRPOTrainer._prepare_inputs)
    assert "self._buffered_inputs = " in prepare_src and "split_tensor_dict(" in prepare_src
    assert "self._buffered_inputs[self._step % self.args.steps_per_generation]" in prepare_src
    grpo_src = inspect.getsource(GRPOTrainer)
    for attribute in ("self._entropy_bonus_enabled =", "self.aux_loss_enabled =", "self.top_entropy_quantile ="):
        assert attribute in grpo_src, attribute
    # the sampling settings are merged by transformers' own generate helper, as `generate` merges them
    params = list(inspect.signature(GenerationMixin._prepare_generation_config).parameters)
    assert params[:2] == ["self", "generation_config"]
    for attribute in (
        "self.generation_config",
        "self.generation_kwargs",
        "self._dist",
        "self.use_vllm",
        "self._is_vlm",
    ):
        assert attribute in trainer_src or attribute in inspect.getsource(GRPOTrainer), attribute


@pytest.mark.parametrize("drafter_type", ["eagle3", "eagle3-checkpoint", "ngram", "none", "model"])
def test_trains_one_step_with_tlt_metrics(tiny_model_dirs, tmp_path, drafter_type):
    extra = drafter_args(drafter_type, tiny_model_dirs, tmp_path)
    trainer = train_one_step(TLTGRPOTrainer, TLTConfig, tiny_model_dirs["qwen2"], tmp_path, **extra)
    assert trainer.state.global_step == 1
    logged = trainer.state.log_history[0]
    for key in (
        "tlt/mean_acceptance_length",
        "tlt/spec_step_fraction",
        "tlt/tree_step_fraction",
        "tlt/rollout_seconds",
    ):
        assert key in logged, key
    assert not any(arm.is_tree for arm in getattr(trainer.tlt_speculation, "arms", []))  # chains by default
    stats = trainer.tlt_last_stats
    assert stats.num_prompts == 8
    if drafter_type == "none":
        assert stats.num_drafts == 0 and logged["tlt/spec_step_fraction"] == 0
    # per batch-size bucket: the chosen k and the throughput, for every bucket the rollout went through
    buckets = {1 << max(size - 1, 0).bit_length() for size in stats.active_batch_sizes}
    assert 8 in buckets  # the rollout starts with 8 active sequences
    for bucket in buckets:
        steps = [k for size, k in zip(stats.active_batch_sizes, stats.num_speculative_tokens)
                 if 1 << max(size - 1, 0).bit_length() == bucket]  # fmt: skip
        assert logged[f"tlt/k_bucket_{bucket}"] == pytest.approx(sum(steps) / len(steps))
        assert logged[f"tlt/tokens_per_second_bucket_{bucket}"] > 0
    if isinstance(trainer.tlt_speculation, BanditSpeculation) and drafter_type != "none":
        # the bandit's measured step costs per k, at the bucket most steps ran in
        bucket = int(logged["tlt/verify_cost_bucket"])
        costs = trainer.tlt_speculation.step_costs(bucket)
        assert costs and all(logged[f"tlt/verify_cost_k{k}"] == pytest.approx(c) for k, c in costs.items())
    if drafter_type == "eagle3":  # a new head trains online: the budget weighed its agreement against those costs
        spot = trainer.tlt.spot
        turns = [RolloutTurn([], [], 0.0, batch_sizes=trainer.tlt_last_stats.active_batch_sizes)]
        expected = expected_speedup(spot.agreement, trainer.tlt.verify_costs(turns))
        assert logged["tlt/drafter_expected_speedup"] == pytest.approx(expected) and expected > 0
        assert spot.budget.speedup == pytest.approx(expected)


@pytest.mark.parametrize(
    "drafter_type, draft",
    [
        ("eagle3", "chain"),
        ("model", "chain"),
        ("ngram", "chain"),
        ("eagle3", "tree"),
        ("model", "tree"),
        ("eagle3", "history"),
        ("ngram", "history"),
    ],
)
def test_same_completions_as_grpo_trainer_greedy(tiny_model_dirs, tmp_path, drafter_type, draft):
    """Greedy rollouts (speculating with a drafter, chains or trees; with hybrid drafting over 4 steps in which prompts
    recur, so that the prompt history drafts too) are token-identical to GRPOTrainer's, so training is identical. Shown to fail (trees) with `match = children` in `tree.verify_tree` (a child accepted whatever its
    token)."""
    steps = 4 if draft == "history" else 1
    hybrid = {"hybrid_drafting": True} if draft == "history" else {}
    seen = {"grpo": [], "tlt": []}

    def recorder(name):
        def reward(completions, **kwargs):
            seen[name].extend(completions)
            return [float(len(c)) for c in completions]

        return reward

    results = {}
    for name, trainer_cls, config_cls, extra in (
        ("grpo", GRPOTrainer, GRPOConfig, {}),
        (
            "tlt",
            TLTGRPOTrainer,
            TLTConfig,
            dict(
                **drafter_args(drafter_type, tiny_model_dirs, tmp_path),
                speculative_selector="fixed",
                num_speculative_tokens=3,
                **hybrid,
            ),
        ),
    ):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen2"])
        args = config_cls(
            **config_kwargs(tmp_path / name, generation_kwargs={"do_sample": False}, max_steps=steps, **extra)
        )
        trainer = trainer_cls(
            model=model,
            reward_funcs=recorder(name),
            args=args,
            train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}),
        )
        if name == "tlt" and draft == "tree":  # every step a tree 3 deep, top-2, 6 nodes verified
            trainer.tlt.speculation = FixedSpeculation(3, "default", topk=2, verify=6)
        trainer.train()
        results[name] = trainer
    if draft == "tree":
        assert results["tlt"].tlt_last_stats.num_tree_steps > 0
    if drafter_type != "ngram":  # greedy siblings run in lockstep: the n-gram lookup may find nothing to copy
        assert results["tlt"].tlt_last_stats.num_draft_tokens > 0
    if draft == "history":  # a prompt's earlier completions drafted, and were accepted
        assert max(h.get("tlt/accepted_from_history", 0.0) for h in results["tlt"].state.log_history) > 0
    assert seen["tlt"] == seen["grpo"] and len(seen["tlt"]) == 8 * steps
    for (name, p_base), (_, p_tlt) in zip(
        results["grpo"].model.named_parameters(), results["tlt"].model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p_tlt, p_base, msg=name)


@pytest.mark.parametrize("drafter_type", ["eagle3", "model", "ngram"])
def test_speculative_trees_adds_tree_arms(tiny_model_dirs, tmp_path, drafter_type):
    """With `speculative_trees=True` the bandit holds tree arms beside chains, for drafters that draft trees (greedy
    identity with trees: `test_same_completions_as_grpo_trainer_greedy`)."""
    extra = drafter_args(drafter_type, tiny_model_dirs, tmp_path)
    trainer = train_one_step(
        TLTGRPOTrainer, TLTConfig, tiny_model_dirs["qwen2"], tmp_path, speculative_trees=True, **extra
    )
    tree_arms = [arm for arm in trainer.tlt_speculation.arms if arm.is_tree]
    assert tree_arms == ([("default", 6, 2, 12), ("default", 6, 4, 24)] if drafter_type != "ngram" else [])


def test_plain_grpo_config_gets_tlt_defaults(tiny_model_dirs, tmp_path):
    """A plain GRPOConfig: every TLT field at TLTConfig's default (validated), and the default drafter built from them."""
    import dataclasses

    from trl_tlt.drafters.eagle3 import Eagle3Drafter

    trainer = train_one_step(TLTGRPOTrainer, GRPOConfig, tiny_model_dirs["qwen2"], tmp_path)
    assert isinstance(trainer.args, TLTConfig)
    tlt_fields = [f for f in dataclasses.fields(TLTConfig) if f.name not in GRPOConfig.__dataclass_fields__]
    assert {f.name: getattr(trainer.args, f.name) for f in tlt_fields} == {f.name: f.default for f in tlt_fields}
    assert isinstance(trainer.tlt.drafter, Eagle3Drafter) and trainer.tlt.spot is not None


def test_config_errors_name_the_field(tmp_path):
    base = config_kwargs(tmp_path)
    with pytest.raises(ValueError, match="drafter_type"):
        TLTConfig(**base, drafter_type="medusa")
    with pytest.raises(ValueError, match="drafter_model_name_or_path"):
        TLTConfig(**base, drafter_type="model")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        TLTConfig(**base, num_speculative_tokens=0)
    with pytest.raises(ValueError, match="speculative_selector"):
        TLTConfig(**base, speculative_selector="greedy")
    with pytest.raises(ValueError, match="spot_training"):
        TLTConfig(**base, spot_training=True, drafter_type="ngram")
    with pytest.raises(ValueError, match="spot_tokens_per_step"):
        TLTConfig(**base, spot_training=True, spot_tokens_per_step=0)
    with pytest.raises(ValueError, match="vllm_speculative_max_batch_size"):
        TLTConfig(**base, vllm_speculative_max_batch_size=-1)
    TLTConfig(**base, spot_training=True, use_vllm=True, vllm_mode="colocate")  # online drafter in vLLM: allowed
    TLTConfig(**base, spot_training=True, use_vllm=True, vllm_mode="server")  # pushed into a server: allowed (#62)


def test_vllm_speculative_config_from_tlt_config():
    assert speculative_config("none", None, 4, 32) is None
    assert speculative_config("eagle3", "d", 4, 32) == {  # the default rule is TLTConfig's: probabilistic
        "method": "eagle3",
        "model": "d",
        "draft_sample_method": "probabilistic",
        "num_speculative_tokens": 4,
        "num_speculative_tokens_per_batch_size": [(1, 32, 4), (33, 1 << 20, 0)],
    }
    # always a schedule (speculation is turned off mid-run by zeroing it)
    assert speculative_config("model", "lm", 2, 0, "greedy") == {
        "method": "draft_model",
        "model": "lm",
        "draft_sample_method": "greedy",
        "num_speculative_tokens": 2,
        "num_speculative_tokens_per_batch_size": [(1, 1 << 20, 2)],
    }
    ngram = speculative_config("ngram", None, 3, 0)
    assert ngram["method"] == "ngram" and ngram["prompt_lookup_max"] >= ngram["prompt_lookup_min"] >= 1
    assert "draft_sample_method" not in ngram


def test_drafter_watchdog_repushes_then_turns_off():
    from trl_tlt.vllm.watchdog import DrafterWatchdog

    dog = DrafterWatchdog()
    assert [dog.observe(a) for a in (1.05, 1.0)] == [None, None]  # a head that never accepted: nothing to lose
    dog = DrafterWatchdog()
    assert [dog.observe(a) for a in (3.0, 2.8, 2.9)] == [None, None, None]
    assert dog.observe(1.2) == "repush"  # 0.2 accepted < half of the recent 1.9
    assert dog.observe(2.7) is None  # the push helped: healthy again, and reset
    assert dog.observe(1.1) == "repush"
    assert dog.observe(1.0) == "off"  # still collapsed after the push
    assert DrafterWatchdog().observe(1.0) is None  # no history yet


def test_unreproducible_generation_kwargs_fall_back_to_grpo_generation(tiny_model_dirs, tmp_path, monkeypatch):
    """A plain swap never refuses a GRPOConfig GRPOTrainer accepts: settings the engine cannot reproduce exactly
    (TRL's own test passes num_beams=2 with sampling) generate with GRPOTrainer's code, one warning, no spot training."""
    calls = []
    original = GRPOTrainer._generate_single_turn

    def recorded(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", recorded)
    kwargs = {"do_sample": True, "top_k": 50, "num_beams": 2, "length_penalty": -0.1, "no_repeat_ngram_size": 3}
    trainer = train_one_step(TLTGRPOTrainer, TLTConfig, tiny_model_dirs["qwen2"], tmp_path, generation_kwargs=kwargs)
    assert "num_beams" in trainer.tlt_fallback_reason and "no_repeat_ngram_size" in trainer.tlt_fallback_reason
    assert calls and trainer.tlt_drafter is None and trainer.tlt_spot is None


def test_drafter_saved_with_checkpoints_and_restored_on_resume(tiny_model_dirs, tmp_path):
    # spot training off: the resumed run's step must leave the restored drafter as saved (spot: test_trainer_spot.py)
    trainer = train_one_step(
        TLTGRPOTrainer,
        TLTConfig,
        tiny_model_dirs["qwen2"],
        tmp_path,
        save_strategy="steps",
        save_steps=1,
        spot_training=False,
        hybrid_drafting=True,
    )
    checkpoint = tmp_path / "checkpoint-1"
    saved = Eagle3Model.from_pretrained(checkpoint / "drafter", trainer.model).export_state_dict()
    assert torch.equal(saved["fc.weight"], trainer.tlt_drafter.model.fc.weight)
    history = torch.load(checkpoint / "tlt_state" / "rank0.pt", weights_only=True)["history"]  # the prompt history
    assert history == trainer.tlt_hybrid.history.state_dict() and history["entries"]

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen2"])
    args = TLTConfig(
        **config_kwargs(tmp_path, max_steps=2, save_strategy="no", spot_training=False, hybrid_drafting=True)
    )
    resumed = TLTGRPOTrainer(
        model=model, reward_funcs=reward_len, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2})
    )
    with torch.no_grad():
        resumed.tlt_drafter.model.fc.weight.zero_()
    resumed.tlt.load(checkpoint, 0, resumed.model)
    assert resumed.tlt_hybrid.history.state_dict() == history
    resumed.train(resume_from_checkpoint=str(checkpoint))
    for name, tensor in resumed.tlt_drafter.model.export_state_dict().items():
        assert torch.equal(tensor, saved[name]), name


@pytest.mark.parametrize("hybrid", [False, True], ids=["eagle3", "hybrid"])
def test_a_resumed_run_samples_as_the_uninterrupted_one(tiny_model_dirs, tmp_path, hybrid):
    """Sampled rollouts, spot training on (exact step counts), the bandit's modelled costs: resumed from the checkpoint
    of step 2, steps 3-4 sample the same completions and end with the same policy and drafter as the uninterrupted
    run. Mutations caught (each run once): the engine's generator not restored (the resumed run replayed step 1's
    draws), the bandit's statistics not restored, spot training's state (buffer, optimizer, sampling stream) not
    restored. The hybrid's running means are saved too (their round trip: test_hybrid.py); here they decide alike
    whether restored or not."""
    extra = dict(
        spot_training=True, spot_steps_per_rollout=2, spot_tokens_per_step=64, max_steps=4, save_strategy="steps",
        save_steps=2, hybrid_drafting=hybrid,
    )  # fmt: skip
    # the bandit on its modelled costs; with hybrid drafting a fixed k, so that lookups draft at every step
    extra |= (
        {"speculative_selector": "fixed", "num_speculative_tokens": 3} if hybrid else {"selector_deterministic": True}
    )

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen2"])
    with torch.no_grad():  # hybrid: peaked, siblings repeat each other, so the lookups match and their state matters
        policy.lm_head.weight.mul_(8.0 if hybrid else 1.0)
    policy.save_pretrained(tmp_path / "policy")
    AutoTokenizer.from_pretrained(tiny_model_dirs["qwen2"]).save_pretrained(tmp_path / "policy")

    def run(output_dir, resume=None):
        seen = []

        def reward(completions, **kwargs):
            seen.append(list(completions))
            return [float(len(c)) for c in completions]

        trainer = TLTGRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(tmp_path / "policy"),
            reward_funcs=reward,
            args=TLTConfig(**config_kwargs(output_dir, **extra)),
            train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}),
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer, seen

    full, full_seen = run(tmp_path / "full")
    resumed, resumed_seen = run(tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoint-2"))
    assert len(full_seen) == 4 and resumed_seen == full_seen[2:]
    assert full.tlt_last_stats.num_accepted_tokens > 0  # the drafter drafted, so its state mattered
    assert not hybrid or full.tlt_hybrid.values  # so did the lookups' running means
    for (name, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    for (name, a), (_, b) in zip(
        full.tlt_drafter.model.named_parameters(), resumed.tlt_drafter.model.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name


def test_a_lora_drafter_trains_its_adapters_and_resumes(tiny_model_dirs, tmp_path):
    """drafter_model_name_or_path = a peft adapter folder (LoRA on the drafter LM), every default: spot training trains
    the adapters alone (transformers loads them frozen: spot training refused to start, "no trainable parameters"),
    and a resumed run restores them as saved."""
    from peft import LoraConfig, get_peft_model

    adapter = tmp_path / "lora-drafter"
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"])
    get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(adapter)
    extra = {"drafter_type": "model", "drafter_model_name_or_path": str(adapter), "spot_steps_per_rollout": 2}
    trainer = train_one_step(
        TLTGRPOTrainer, TLTConfig, tiny_model_dirs["qwen2"], tmp_path, save_strategy="steps", save_steps=1, **extra
    )
    drafter = trainer.tlt_drafter.model
    trained = {n: p.detach().clone() for n, p in drafter.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert trainer.tlt_spot.total_steps == 2
    trainer.join_drafter_writes()
    resumed = TLTGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen2"]),
        reward_funcs=reward_len,
        args=TLTConfig(**config_kwargs(tmp_path / "resumed", **extra)),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}),
    )
    resumed.tlt.load(tmp_path / "checkpoint-1", 0, resumed.model)
    for name, param in resumed.tlt_drafter.model.named_parameters():
        if name in trained:
            assert torch.equal(param, trained[name]), name


def test_push_drafter_to_hub_uploads_drafter_and_card(tiny_model_dirs, tmp_path, monkeypatch):
    trainer = train_one_step(TLTGRPOTrainer, TLTConfig, tiny_model_dirs["qwen2"], tmp_path)
    uploaded = fake_hub(monkeypatch)
    assert trainer.push_drafter_to_hub("me/drafter") == "commit"
    assert uploaded["created"] == "me/drafter"
    assert uploaded["files"] == ["README.md", "config.json", "model.safetensors"]
    assert '"method": "eagle3"' in uploaded["texts"]["README.md"]


def test_model_free_drafter_has_nothing_to_save(tiny_model_dirs, tmp_path):
    trainer = train_one_step(TLTGRPOTrainer, TLTConfig, tiny_model_dirs["qwen2"], tmp_path, drafter_type="ngram")
    with pytest.raises(ValueError, match="drafter_type='eagle3' or 'model'"):
        trainer.save_drafter(tmp_path / "d")


# GRPOConfig modes a user can set, each run by the same script with both trainers (docs/trainer.md's matrix).
DROP_IN_CASES = {
    "conversational": {},
    "several_rewards": {"reward_weights": [1.0, 0.5]},
    "normalize_then_sum": {"multi_objective_aggregation": "normalize_then_sum"},
    "lora": {},
    "beta": {"beta": 0.1},
    "beta_bias_correction_kl": {"beta": 0.1, "use_bias_correction_kl": True},
    "num_iterations": {"num_iterations": 2},
    "beta_num_iterations": {"beta": 0.1, "num_iterations": 2},
    "grad_accumulation": {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 4},
    "steps_per_generation": {"steps_per_generation": 2, "per_device_train_batch_size": 4},
    "mask_truncated_completions": {"mask_truncated_completions": True},
    **{f"loss_type_{t}": {"loss_type": t} for t in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo")},
    "loss_type_luspo": {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    "importance_sampling_sequence": {"importance_sampling_level": "sequence", "loss_type": "grpo"},
    "scale_rewards_batch": {"scale_rewards": "batch"},
    "scale_rewards_none": {"scale_rewards": "none"},
    "top_entropy_quantile": {"top_entropy_quantile": 0.2},
    "delta_epsilon_high": {"delta": 2.0, "epsilon_high": 0.28},
    "off_policy_mask": {"off_policy_mask_threshold": 0.5},
    "repetition_penalty": {"repetition_penalty": 1.3},
    "gradient_checkpointing": {"gradient_checkpointing": True},
    "cast_lm_head_to_fp32": {"cast_lm_head_to_fp32": True},
    "harmless_generation_kwargs": {
        "generation_kwargs": {"do_sample": False, "num_beams": 1, "length_penalty": -0.1, "early_stopping": True}
    },
    "suppress_tokens": {"generation_kwargs": {"do_sample": False, "suppress_tokens": list(range(40, 200))}},
}


@pytest.mark.parametrize("case", list(DROP_IN_CASES))
def test_drop_in_script_runs_unchanged(tiny_model_dirs, tmp_path, case):
    """The same script with GRPOTrainer -> TLTGRPOTrainer: greedy completions and trained weights are equal."""
    from peft import LoraConfig

    seen = {"grpo": [], "tlt": []}

    def script(name, trainer_cls, config_cls, **tlt_args):
        def reward(completions, **kwargs):
            seen[name].extend(str(c) for c in completions)
            return reward_len(completions)

        if case == "conversational":
            prompts = [[{"role": "user", "content": p}] for p in PROMPTS * 2]
        else:
            prompts = PROMPTS * 2
        several = case in ("several_rewards", "normalize_then_sum")
        rewards = [reward, reward_digits] if several else reward
        args = config_cls(
            **config_kwargs(
                tmp_path / name, max_steps=2, **{"generation_kwargs": {"do_sample": False}, **DROP_IN_CASES[case]}
            ),
            **tlt_args,
        )
        trainer = trainer_cls(
            model=AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen2"]),
            reward_funcs=rewards,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]) if case == "lora" else None,
        )
        trainer.train()
        assert trainer.state.global_step == 2
        return trainer

    grpo = script("grpo", GRPOTrainer, GRPOConfig)
    tlt = script("tlt", TLTGRPOTrainer, TLTConfig, speculative_selector="fixed", num_speculative_tokens=3)
    assert seen["tlt"] == seen["grpo"] and seen["tlt"]
    assert tlt.tlt_last_stats.num_draft_tokens > 0
    for (name, p_base), (_, p_tlt) in zip(grpo.model.named_parameters(), tlt.model.named_parameters(), strict=True):
        torch.testing.assert_close(p_tlt, p_base, msg=name)


def test_policy_as_its_own_drafter_accepts_everything(tiny_model_dirs, tmp_path):
    """drafter_type='model' with the policy itself: every draft is accepted, so acceptance length = k + 1 (here
    exactly: max_completion_length leaves no draft cut short by the length limit)."""
    k = 3
    trainer = train_one_step(
        TLTGRPOTrainer,
        TLTConfig,
        tiny_model_dirs["qwen2"],
        tmp_path,
        drafter_type="model",
        drafter_model_name_or_path=tiny_model_dirs["qwen2"],
        speculative_selector="fixed",
        num_speculative_tokens=k,
        max_completion_length=1 + 4 * (k + 1),  # the prefill's token, then 4 full speculative steps
        generation_kwargs={"do_sample": False},
    )
    stats = trainer.tlt_last_stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0  # every drafted token accepted
    assert stats.mean_acceptance_length == k + 1


def test_vllm_spec_decode_stats_from_per_request_histograms():
    """Acceptance from vLLM's per-request metrics: histogram[j] = verify steps that accepted j draft tokens."""
    from types import SimpleNamespace

    from trl_tlt.vllm.generation import TLTVLLMGeneration

    def request(histogram, drafted):
        metrics = SimpleNamespace(histogram=histogram, num_draft_tokens=drafted)
        return SimpleNamespace(outputs=[SimpleNamespace(spec_decode_metrics=metrics)])

    generation = TLTVLLMGeneration.__new__(TLTVLLMGeneration)  # no engine needed for the arithmetic
    generation.mode = "colocate"
    generation.last_outputs = [request([1, 0, 2, 1], 12), request([0, 0, 0, 4], 12), request([2, 0, 0, 0], 6)]
    stats = generation.spec_decode_stats()
    # 10 verify steps; accepted 2*2 + 3*1 + 3*4 = 19 of 30 drafted
    assert stats == {"verify_steps": 10.0, "mean_acceptance_length": 1 + 19 / 10, "draft_acceptance_rate": 19 / 30}
    generation.last_outputs = [SimpleNamespace(outputs=[SimpleNamespace(spec_decode_metrics=None)])]
    assert generation.spec_decode_stats() is None
    generation.last_outputs = [request([0, 0, 0, 0], 0)]  # speculation turned off: no verify step had a draft
    assert generation.spec_decode_stats() is None


def test_what_was_turned_off_stays_off_after_a_resume(tiny_model_dirs, tmp_path, monkeypatch):
    """#61's fifth defect: a checkpoint forgot that spot training had stopped and that vLLM's speculation was turned off
    (a failed sample check, a collapsed acceptance): after a resume the faulty drafter speculated again and spot
    training restarted. Both are in every rank's rollout state now, and the resumed trainer turns vLLM's speculation
    off again. Mutations caught: not saved (spot training back on), not re-applied (speculation back on)."""
    trainer = train_one_step(
        TLTGRPOTrainer, TLTConfig, tiny_model_dirs["qwen2"], tmp_path, spot_training=None, save_strategy="steps",
        save_steps=1,
    )  # fmt: skip
    assert trainer.tlt.spot is not None
    trainer.tlt._stop_spot_training()  # as the idle barrier's refusal does
    trainer.tlt.speculation_off = True  # as `_save_checkpoint` reads vLLM's state
    trainer.tlt.save(tmp_path / "checkpoint-9", 0, write_drafter=True)
    trainer.tlt.join_writes()

    resumed = train_one_step(TLTGRPOTrainer, TLTConfig, tiny_model_dirs["qwen2"], tmp_path / "r", max_steps=0)
    turned_off = []
    resumed.use_vllm = True
    resumed.vllm_generation = type("Generation", (), {"disable_speculation": lambda self, r: turned_off.append(r)})()
    monkeypatch.setattr(GRPOTrainer, "_load_optimizer_and_scheduler", lambda self, checkpoint: None)
    resumed._load_optimizer_and_scheduler(str(tmp_path / "checkpoint-9"))
    assert resumed.tlt.spot is None and resumed.tlt.spot_stopped
    assert turned_off and resumed.tlt.speculation_off
