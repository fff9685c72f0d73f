"""A drafter fault costs speed, never correctness (docs/reliability.md): broken proposals leave rollouts lossless,
non-finite drafter losses, gradients or weights are dropped or rolled back, and the policy trains as without them."""

import dataclasses
import json
import re

import pytest
import torch
from datasets import Dataset
from testing_utils import (
    EOS,
    PROMPTS,
    chi_square_pvalue,
    config_kwargs,
    exact_sequence_distribution,
    fake_hub,
    hf_greedy,
    peaked_model,
    random_prompts,
    reward_len,
    train_one_step,
)
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

from trl_tlt import TLTConfig, TLTGRPOTrainer
from trl_tlt.drafters import Draft, ModelDrafter
from trl_tlt.drafters.eagle3 import Eagle3Drafter, Eagle3Model
from trl_tlt.engine.generate import SpeculativeEngine
from trl_tlt.engine.sampling import SamplingParams
from trl_tlt.tooling.tiny import build_tiny_model, build_tokenizer
from trl_tlt.training.spot import DataBuffer, SpotSchedule, SpotTrainer


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


# 8,000 samples each: two faults in the default run (a row dropped, a point mass), the others in CI's second stage; all
# five are checked greedily in the default run (below).
SAMPLED_FAULTS = [
    fault if fault in ("nan_q", "point_mass") else pytest.param(fault, marks=pytest.mark.slow) for fault in FAULTS
]


@pytest.mark.parametrize("fault", SAMPLED_FAULTS)
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
    return SpotTrainer(
        Eagle3Model.for_policy(policy), buffer, schedule=schedule, tokens_per_step=128, steps_per_phase=4
    )


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


# ------------------------------------------------------------------------------------------ bad inputs
def construct(model_dir, tmp_path, dataset=None, **extra):
    args = TLTConfig(**config_kwargs(tmp_path, **extra))
    return TLTGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=reward_len,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}) if dataset is None else dataset,
    )


def saved_head(model_dir, path, **change):
    head = Eagle3Model.for_policy(AutoModelForCausalLM.from_pretrained(model_dir))
    head.save_pretrained(path)
    if change:
        config = json.loads((path / "config.json").read_text())
        config.update(change)
        (path / "config.json").write_text(json.dumps(config))
    return path


def drafter_lm(tokenizer, path, vocab_size=None, safe=True):
    model = build_tiny_model(tokenizer, arch="llama", hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    if vocab_size is not None:
        model.resize_token_embeddings(vocab_size)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if not safe:  # pickle weights only (transformers 5 always writes safetensors)
        torch.save(model.state_dict(), path / "pytorch_model.bin")
        (path / "model.safetensors").unlink()
    return path


def bad_drafters(tiny_model_dirs, tokenizer, tmp_path):
    """(TLTConfig fields, what the error must name) per bad drafter."""
    policy = tiny_model_dirs["qwen2"]
    eagle = {"drafter_type": "eagle3"}
    model = {"drafter_type": "model"}
    truncated = saved_head(policy, tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    bad_json = saved_head(policy, tmp_path / "bad-json")
    (bad_json / "config.json").write_text("{not json")
    other = build_tokenizer(["completely different words and digits 9 8 7"] * 20, vocab_size=len(tokenizer))
    return {
        "eagle3 missing": ({**eagle, "drafter_model_name_or_path": str(tmp_path / "nowhere")}, "nowhere"),
        "eagle3 truncated weights": ({**eagle, "drafter_model_name_or_path": str(truncated)}, "model.safetensors"),
        "eagle3 corrupt config": ({**eagle, "drafter_model_name_or_path": str(bad_json)}, "config.json"),
        "eagle3 other hidden size": (
            {**eagle, "drafter_model_name_or_path": str(saved_head(policy, tmp_path / "h", target_hidden_size=128))},
            "hidden size 128",
        ),
        "eagle3 layers beyond the policy": (
            {
                **eagle,
                "drafter_model_name_or_path": str(
                    saved_head(
                        policy,
                        tmp_path / "layers",
                        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 7], "use_aux_hidden_state": True},
                    )
                ),
            },
            "reads policy layers",
        ),
        "model missing": (
            {**model, "drafter_model_name_or_path": str(tmp_path / "nowhere")},
            "drafter_model_name_or_path",
        ),
        "model pickle weights": (
            {**model, "drafter_model_name_or_path": str(drafter_lm(tokenizer, tmp_path / "bin", safe=False))},
            "safetensors",
        ),
        "model smaller vocabulary": (
            {**model, "drafter_model_name_or_path": str(drafter_lm(tokenizer, tmp_path / "small", vocab_size=100))},
            "fewer than the policy tokenizer",
        ),
        "model other tokenizer": (
            {**model, "drafter_model_name_or_path": str(drafter_lm(other, tmp_path / "other", len(tokenizer)))},
            "different tokenizer",
        ),
    }


def test_bad_drafters_are_refused_at_construction(tiny_model_dirs, tokenizer, tmp_path):
    for name, (fields, named) in bad_drafters(tiny_model_dirs, tokenizer, tmp_path).items():
        with pytest.raises((ValueError, FileNotFoundError), match=re.escape(named)):
            construct(tiny_model_dirs["qwen2"], tmp_path / "out", **fields)
            pytest.fail(f"{name}: accepted")


def test_an_empty_dataset_is_refused_at_construction(tiny_model_dirs, tmp_path):
    with pytest.raises(ValueError, match="train_dataset"):
        construct(tiny_model_dirs["qwen2"], tmp_path, dataset=Dataset.from_dict({"prompt": []}))


INVALID_CONFIGS = [
    ({"drafter_type": "medusa"}, "drafter_type"),
    ({"drafter_type": "model"}, "drafter_model_name_or_path"),
    ({"speculative_selector": "greedy"}, "speculative_selector"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"micro_batching": "packed"}, "micro_batching"),
    ({"selector_epsilon": 1.5}, "selector_epsilon"),
    ({"spot_training": True, "drafter_type": "ngram"}, "spot_training"),
    ({"vllm_speculative_max_batch_size": -1}, "vllm_speculative_max_batch_size"),
    ({"vllm_draft_sample_method": "argmax"}, "vllm_draft_sample_method"),
    ({"spot_buffer_steps": 0}, "spot_buffer_steps"),
    ({"spot_buffer_max_tokens": 0}, "spot_buffer_max_tokens"),
    ({"spot_buffer_max_memory_mb": 0}, "spot_buffer_max_memory_mb"),
    ({"spot_tokens_per_step": 0}, "spot_tokens_per_step"),
    ({"spot_cold_start_steps": -1}, "spot_cold_start_steps"),
    ({"spot_steps_per_rollout": -1}, "spot_steps_per_rollout"),
    ({"spot_learning_rate": 0.0}, "spot_learning_rate"),
    ({"spot_time_budget": -0.1}, "spot_time_budget"),
    ({"drafter_ttt_length": 0}, "drafter_ttt_length"),
    ({"draft_vocab_size": 0}, "draft_vocab_size"),
    ({"history_max_tokens": -1}, "history_max_tokens"),
    ({"spot_precision": "half"}, "spot_precision"),
    ({"spot_feature_source": "both"}, "spot_feature_source"),
    ({"micro_batching_split_tokens": -1}, "micro_batching_split_tokens"),
]


@pytest.mark.parametrize(("fields", "named"), INVALID_CONFIGS, ids=[next(iter(f)) for f, _ in INVALID_CONFIGS])
def test_every_invalid_config_value_is_named(fields, named, tmp_path):
    with pytest.raises(ValueError, match=named):
        TLTConfig(**config_kwargs(tmp_path, **fields))


def test_every_tlt_field_is_validated():
    """A new TLTConfig field must join INVALID_CONFIGS (or this list, with the reason it accepts every value)."""
    free = {
        "drafter_model_name_or_path",  # checked when the drafter is loaded (test_bad_drafters_...)
        "spot_training",  # a bool or None
        "selector_deterministic",  # a bool
        "speculative_trees",  # a bool; no tree arms where none can be drafted (n-gram, vLLM), as documented
        "hybrid_drafting",  # a bool; nothing to join without trl-tlt's engine and a drafter, as documented
    }
    tlt_fields = {f.name for f in dataclasses.fields(TLTConfig)} - {f.name for f in dataclasses.fields(GRPOConfig)}
    covered = {name for fields, _ in INVALID_CONFIGS for name in fields}
    assert tlt_fields - free <= covered, sorted(tlt_fields - free - covered)


def test_a_prompt_longer_than_the_context_is_refused_at_construction(tiny_model_dirs, tokenizer, tmp_path, caplog):
    context = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen2"]).config.max_position_embeddings
    too_long = " ".join(["a"] * (context + 5))
    conversational = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in [*PROMPTS, too_long]]})
    with pytest.raises(ValueError, match=rf"train_dataset row {len(PROMPTS)}: .*max_position_embeddings={context}"):
        construct(tiny_model_dirs["qwen2"], tmp_path, dataset=conversational)
    with pytest.raises(ValueError, match="eval_dataset row 1"):
        TLTGRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen2"]),
            reward_funcs=reward_len,
            args=TLTConfig(**config_kwargs(tmp_path)),
            train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
            eval_dataset=Dataset.from_dict({"prompt": [PROMPTS[0], too_long]}),
        )
    # Fits, but a completion of max_completion_length would run past the context: warned once, as it trains on.
    words = context
    while len(tokenizer(" ".join(["a"] * words))["input_ids"]) > context - 3:
        words -= 1
    near = " ".join(["a"] * words)
    with caplog.at_level("WARNING"):
        construct(tiny_model_dirs["qwen2"], tmp_path, dataset=Dataset.from_dict({"prompt": [*PROMPTS, near]}))
    assert [r.getMessage() for r in caplog.records if "max_completion_length" in r.getMessage()] == [
        f"1 of {len(PROMPTS) + 1} prompts in train_dataset leave fewer than max_completion_length=12 tokens of the "
        f"policy's context (max_position_embeddings={context}): a completion that long runs past the positions the "
        "model knows, as with GRPOTrainer. Lower max_completion_length or drop the longest prompts."
    ]


def test_hub_tokens_are_never_logged_or_written(tiny_model_dirs, tmp_path, monkeypatch, caplog, capsys):
    """A token given as `hub_token`, `HF_TOKEN` or to `push_drafter_to_hub` reaches huggingface_hub only: not the
    logs (at debug level), stdout/stderr, the model card, or a text file of a checkpoint."""
    from transformers.utils import logging as hf_logging

    secrets = {"arg": "hf_ArgSecret0123456789", "env": "hf_EnvSecret0123456789", "push": "hf_PushSecret0123456789"}
    monkeypatch.setenv("HF_TOKEN", secrets["env"])
    uploaded = fake_hub(monkeypatch)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_debug()
    try:
        with caplog.at_level("DEBUG"):
            trainer = train_one_step(
                TLTGRPOTrainer,
                TLTConfig,
                tiny_model_dirs["qwen2"],
                tmp_path,
                hub_token=secrets["arg"],
                save_strategy="steps",
                save_steps=1,
            )
            trainer.push_drafter_to_hub("me/drafter", token=secrets["push"])
            print(trainer.args, trainer.state.log_history)
    finally:
        hf_logging.set_verbosity(verbosity)
    assert uploaded["token"] == secrets["push"]
    texts = [r.getMessage() for r in caplog.records] + list(capsys.readouterr()) + list(uploaded["texts"].values())
    # Trainer pickles its arguments (training_args.bin, hub_token included) as in every Trainer checkpoint.
    texts += [p.read_text() for p in tmp_path.rglob("*") if p.is_file() and p.suffix in (".json", ".md", ".txt")]
    assert len(texts) > 10 and any("checkpoint-1" in t or "global_step" in t for t in texts)
    for where, secret in secrets.items():
        assert not [t for t in texts if secret in t], where
