"""Drop-in fidelity beyond greedy equality: whatever a GRPOTrainer user can set either behaves as in GRPOTrainer or
is refused at construction (docs/trainer.md, "Drop-in matrix"). Regression tests of issue #25's defects."""

import json
import re
import subprocess
import sys
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
from datasets import Dataset
from testing_utils import PROMPTS, config_kwargs, make_trainer, multiply_tool, recorder, tool_calling_policy
from transformers import AutoConfig, AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

from trl_tlt import TLTConfig, TLTGRPOTrainer
from trl_tlt.drafters.eagle3 import Eagle3Model
from trl_tlt.tooling.tiny import build_tiny_model
from trl_tlt.trainer.generation_settings import sampling_params


HERE = Path(__file__).parent


# ------------------------------------------------------------------------------ rollouts through a user's generate
EOS_COMPLETIONS = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 2], [15, 16, 17, 18, 19, 20, 21, 2]]  # 2 = <|im_end|>


def fake_generate(input_ids, **kwargs):
    """TRL's own test recipe: fixed completions, two of them ending in EOS (right-padded with the pad id 0)."""
    rows = [c + [0] * (8 - len(c)) for c in EOS_COMPLETIONS]
    completions = torch.tensor([rows[i % 3] for i in range(input_ids.size(0))], device=input_ids.device)
    return torch.cat([input_ids, completions], dim=1)


@pytest.mark.parametrize("where", ["class", "instance"])
def test_patched_generate_is_used(tiny_model_dirs, tmp_path, tokenizer, where):
    """TRL's tests patch `GenerationMixin.generate` (mask_truncated_completions) or `trainer.model.generate` (tools):
    a model whose generate is not transformers' generates with it, whatever ran before in the process."""
    assert tokenizer.eos_token_id == 2 and tokenizer.pad_token_id == 0
    seen = []
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen2"])
    kwargs = dict(rewards=recorder(seen), mask_truncated_completions=True, max_completion_length=8, max_steps=2)
    if where == "class":
        with patch("transformers.generation.utils.GenerationMixin.generate", side_effect=fake_generate):
            trainer = make_trainer(TLTGRPOTrainer, TLTConfig, model, tmp_path, **kwargs)
            trainer.train()
    else:
        trainer = make_trainer(TLTGRPOTrainer, TLTConfig, model, tmp_path, **kwargs)
        with patch.object(trainer.model, "generate", side_effect=fake_generate):
            trainer.train()
    expected = [c for c in EOS_COMPLETIONS]  # the parent cuts each completion after its EOS
    assert seen[:3] == expected and len(seen) == 16
    assert trainer.tlt_last_stats is None  # the engine never ran
    # after the patch, the same trainer generates with the engine again
    trainer.args.max_steps = 3
    trainer.train()
    assert trainer.tlt_last_stats is not None


# -------------------------------------------------------------------------------------------- architectures
ARCHITECTURES = {
    # sliding-window layers, attention soft-capping, final-logit soft-capping
    "gemma2": {"sliding_window": 8, "head_dim": 32},
    # sliding window with attention sinks and mixture of experts
    "gpt_oss": {"sliding_window": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 32},
    "cohere2": {"sliding_window": 8},
    # hybrid state-space (Mamba) / attention / MoE layers
    "nemotron_h": {
        "head_dim": 32,
        "ssm_state_size": 16,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "n_groups": 1,
        "chunk_size": 16,
        "n_routed_experts": 4,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 32,
    },  # fmt: skip
    # full attention and mixture of experts: the engine runs it
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 32},
}


def build_architecture(name, tokenizer, path):
    config = AutoConfig.for_model(
        name,
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **ARCHITECTURES[name],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_architectures_train_like_grpo_trainer(tokenizer, tmp_path, caplog, name):
    """Every architecture trains with the same greedy completions and weights as GRPOTrainer: on the engine where its
    cache allows rejected drafts to become holes, else through GRPOTrainer's generation, said once, at construction."""
    path = build_architecture(name, tokenizer, tmp_path / name)
    results = {}
    for tag, trainer_cls, config_cls, extra in (
        ("grpo", GRPOTrainer, GRPOConfig, {}),
        ("tlt", TLTGRPOTrainer, TLTConfig, {"speculative_selector": "fixed", "num_speculative_tokens": 2}),
    ):
        seen = []
        with caplog.at_level("WARNING"):
            trainer = make_trainer(
                trainer_cls,
                config_cls,
                AutoModelForCausalLM.from_pretrained(path),
                tmp_path / tag,
                rewards=recorder(seen),
                generation_kwargs={"do_sample": False},
                **extra,
            )
            trainer.train()
        results[tag] = (trainer, seen)
    (grpo, grpo_seen), (tlt, tlt_seen) = results["grpo"], results["tlt"]
    assert tlt_seen == grpo_seen
    for (n, p_base), (_, p_tlt) in zip(grpo.model.named_parameters(), tlt.model.named_parameters(), strict=True):
        torch.testing.assert_close(p_tlt, p_base, msg=n)
    fallback = [r.message for r in caplog.records if "GRPOTrainer's own generation" in r.message]
    if name == "qwen3_moe":
        assert tlt.tlt_fallback_reason is None and tlt.tlt_last_stats.num_draft_tokens > 0 and not fallback
    else:
        assert tlt.tlt_fallback_reason is not None and tlt.tlt_drafter is None and len(fallback) == 1


def test_spot_training_refused_where_the_engine_cannot_run(tokenizer, tmp_path):
    path = build_architecture("gemma2", tokenizer, tmp_path / "gemma2")
    with pytest.raises(ValueError, match="spot_training=False"):
        make_trainer(
            TLTGRPOTrainer, TLTConfig, AutoModelForCausalLM.from_pretrained(path), tmp_path, spot_training=True
        )


# ------------------------------------------------------------------------------ a policy of fewer than 3 layers
def test_two_layer_policy_keeps_its_drafter_in_checkpoints(tokenizer, tmp_path):
    """TRL's test models have 2 layers: the EAGLE-3 head repeats a layer id, which vLLM/SGLang cannot load. It is
    checkpointed in trl-tlt's layout and resumed; exporting it raises a clear error."""
    model = build_tiny_model(tokenizer, hidden_size=64, num_hidden_layers=2)
    trainer = make_trainer(
        TLTGRPOTrainer, TLTConfig, model, tmp_path, processing_class=tokenizer, save_strategy="steps", save_steps=1
    )
    assert trainer.tlt_drafter.model.aux_layer_ids == [0, 1, 1] and not trainer.tlt_drafter.model.exportable
    trainer.train()
    saved = Eagle3Model.from_pretrained(tmp_path / "checkpoint-1" / "drafter", trainer.model)
    assert saved.aux_layer_ids == [0, 1, 1]
    torch.testing.assert_close(saved.fc.weight, trainer.tlt_drafter.model.fc.weight)
    with pytest.raises(ValueError, match="vLLM and SGLang cannot load it"):
        trainer.save_drafter(tmp_path / "export")
    with pytest.raises(ValueError, match="repeat a layer"):
        trainer.tlt_drafter.model.save_pretrained(tmp_path / "export")


def test_failed_background_drafter_write_is_raised(tiny_model_dirs, tmp_path, monkeypatch):
    """A drafter checkpoint written in the background that fails is an error in the training thread, not a warning;
    the checkpoint before it keeps its drafter."""
    trainer = make_trainer(
        TLTGRPOTrainer,
        TLTConfig,
        AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen2"]),
        tmp_path,
        save_strategy="steps",
        save_steps=1,
        max_steps=2,
    )
    original = Eagle3Model.save_pretrained

    def fail_second(self, path, **kwargs):
        if "checkpoint-2" in str(path):
            raise OSError(28, "No space left on device")
        return original(self, path, **kwargs)

    monkeypatch.setattr(Eagle3Model, "save_pretrained", fail_second)
    with pytest.raises(RuntimeError, match="checkpoint-2.*No space left on device"):
        trainer.train()
    assert (tmp_path / "checkpoint-1" / "drafter" / "model.safetensors").is_file()
    assert not (tmp_path / "checkpoint-2" / "drafter").exists()
    assert not (tmp_path / "checkpoint-2" / "drafter.tmp").exists()


# ------------------------------------------------------------------------------------------ reproducibility
REPRO_SCRIPT = HERE / "_repro_run.py"


@pytest.mark.slow
@pytest.mark.parametrize("selector", ["fixed", "deterministic_bandit"])
def test_same_seed_same_completions(tiny_model_dirs, tmp_path, selector):
    """Sampled completions are fixed by `seed`: twice in this process (after other trainers ran) and in a fresh one.
    The bandit needs `selector_deterministic=True` (wall-time rewards change its choices, hence the random stream)."""
    extra = {"speculative_selector": "fixed"} if selector == "fixed" else {"selector_deterministic": True}
    extra["spot_steps_per_rollout"] = 4  # the time budget depends on timing: a fixed count of drafter steps
    runs = []
    for i in range(2):
        seen = []
        trainer = make_trainer(
            TLTGRPOTrainer,
            TLTConfig,
            AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen2"]),
            tmp_path / str(i),
            rewards=recorder(seen),
            max_steps=3,
            **extra,
        )
        trainer.train()
        runs.append(seen)
    assert runs[0] == runs[1] and len(runs[0]) == 24
    out = tmp_path / "fresh.json"
    subprocess.run(
        [
            sys.executable,
            str(REPRO_SCRIPT),
            tiny_model_dirs["qwen2"],
            str(tmp_path / "fresh"),
            json.dumps(extra),
            str(out),
        ],
        check=True,
        timeout=300,
    )
    assert json.loads(out.read_text()) == runs[0]


# ------------------------------------------------------------------------------------ generation settings
def test_generation_settings_merge_as_in_generate(tiny_model_dirs, tmp_path):
    """Sampling settings are what `generate` would use: the trainer's, unset ones from the model's
    generation_config, then transformers' defaults (top_k=50 when unset); with others, rollouts fall back to
    GRPOTrainer's generation, the reason naming them and where they came from."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen2"])
    model.generation_config.min_p = 0.05  # GRPOConfig leaves min_p unset: the model's value applies
    trainer = make_trainer(TLTGRPOTrainer, TLTConfig, model, tmp_path, generation_kwargs={"top_k": None})
    params = sampling_params(trainer.model, trainer.generation_config)
    assert params.min_p == 0.05 and params.top_k == 50 and params.temperature == 1.0 and params.do_sample
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen2"])
    model.generation_config.no_repeat_ngram_size = 3
    trainer = make_trainer(TLTGRPOTrainer, TLTConfig, model, tmp_path)
    assert re.search("no_repeat_ngram_size.*generation_config.json", trainer.tlt_fallback_reason)
    for unreproducible in ({"num_beams": 2}, {"num_return_sequences": 2}, {"typical_p": 0.9}):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen2"])
        trainer = make_trainer(TLTGRPOTrainer, TLTConfig, model, tmp_path, generation_kwargs=unreproducible)
        assert next(iter(unreproducible)) in trainer.tlt_fallback_reason and trainer.tlt_drafter is None


def test_tool_calling_multi_turn_through_the_engine(tokenizer, tmp_path):
    """Tool calls and the turns after them (prompt + completion + tool result, one sequence per sample) are generated
    by the engine, with GRPOTrainer's completions, tool statistics and weights (greedy)."""
    policy, tool_tokenizer = tool_calling_policy(tokenizer)
    policy.save_pretrained(tmp_path / "policy")
    results = {}
    for tag, trainer_cls, config_cls, extra in (
        ("grpo", GRPOTrainer, GRPOConfig, {}),
        ("tlt", TLTGRPOTrainer, TLTConfig, {"speculative_selector": "fixed", "num_speculative_tokens": 3}),
    ):
        seen = []
        args = config_cls(
            **config_kwargs(
                tmp_path / tag,
                max_completion_length=160,
                max_tool_calling_iterations=2,
                generation_kwargs={"do_sample": False},
            ),
            **extra,
        )
        trainer = trainer_cls(
            model=AutoModelForCausalLM.from_pretrained(tmp_path / "policy"),
            reward_funcs=recorder(seen),
            args=args,
            train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS * 2]}),
            processing_class=tool_tokenizer,
            tools=[multiply_tool],
        )
        trainer.train()
        results[tag] = (trainer, seen)
    (grpo, grpo_seen), (tlt, tlt_seen) = results["grpo"], results["tlt"]
    assert tlt_seen == grpo_seen
    logged = tlt.state.log_history[0]
    assert logged["tools/call_frequency"] == grpo.state.log_history[0]["tools/call_frequency"] == 1.0
    # the engine's last call was the turn after the tool results: one sequence per sample, speculated
    assert tlt.tlt_last_stats.num_prompts == 8 and tlt.tlt_last_stats.num_draft_tokens > 0
    # the drafter trained on what the policy sampled, each turn with its own features: no tool result in a completion
    # (GRPOTrainer's tool loop replaces the returned completions in place), no policy forward of its own
    spot = tlt.tlt_spot
    assert spot.rerun_samples == 0 and spot.total_steps > 0
    for sample in [*spot.buffer.samples, *spot.buffer.held_out]:
        assert sample.features is not None and len(sample.features) == len(sample.token_ids) - 1
    for (n, p_base), (_, p_tlt) in zip(grpo.model.named_parameters(), tlt.model.named_parameters(), strict=True):
        torch.testing.assert_close(p_tlt, p_base, msg=n)


@pytest.fixture
def restore_qwen2_module():
    """`use_liger_kernel=True` replaces classes and functions of transformers' modeling module for the whole process
    (Liger's monkey patch, in GRPOTrainer as here): put them back for the tests that follow."""
    from transformers.models.qwen2 import modeling_qwen2

    saved = dict(vars(modeling_qwen2))
    yield
    for name, value in saved.items():
        setattr(modeling_qwen2, name, value)


def test_liger_kernel_behaves_as_in_grpo_trainer(tiny_model_dirs, tmp_path, restore_qwen2_module):
    """`use_liger_kernel=True` is GRPOTrainer's own loss path (Liger's fused GRPO loss, Triton): where it cannot run,
    as on this CPU, both trainers fail the same way at the first step; on a GPU TLT leaves it untouched."""
    errors = {}
    for tag, trainer_cls, config_cls in (("grpo", GRPOTrainer, GRPOConfig), ("tlt", TLTGRPOTrainer, TLTConfig)):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen2"])
        trainer = make_trainer(trainer_cls, config_cls, model, tmp_path / tag, use_liger_kernel=True)
        with pytest.raises(Exception) as info:
            trainer.train()
        errors[tag] = (type(info.value), str(info.value))
    assert errors["tlt"] == errors["grpo"]


def test_training_leaves_no_global_state(tiny_model_dirs, tmp_path):
    """Nothing a TLTGRPOTrainer does outlives it in the process: no patched transformers / TRL attribute, grad mode,
    default dtype or thread count (what a later trainer in a notebook or test suite would inherit)."""
    from transformers.generation import utils as generation_utils
    from transformers.models.qwen2 import modeling_qwen2
    from trl.trainer import grpo_trainer

    modules = (generation_utils, modeling_qwen2, grpo_trainer)
    before = [dict(vars(m)) for m in modules], dict(vars(generation_utils.GenerationMixin))
    settings = torch.is_grad_enabled(), torch.get_default_dtype(), torch.get_num_threads()
    trainer = make_trainer(
        TLTGRPOTrainer, TLTConfig, AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen2"]), tmp_path
    )
    trainer.train()
    after = [dict(vars(m)) for m in modules], dict(vars(generation_utils.GenerationMixin))
    assert after == before
    assert (torch.is_grad_enabled(), torch.get_default_dtype(), torch.get_num_threads()) == settings


# ------------------------------------------------------------------------------------------ vision-language
VLM_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_llava(tokenizer, path):
    """A tiny LLaVA (CLIP vision tower of 1 layer on 28x28 images: 4 image tokens; Llama text model) and processor."""
    import copy

    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}),
        tokenizer=tokenizer,
        chat_template=VLM_TEMPLATE,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token="<image>",
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    config = LlavaConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlavaForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)


def test_vision_language_model_trains_like_grpo_trainer(tokenizer, tmp_path):
    """Images go through GRPOTrainer's generation (said once, at construction; no drafter is built): same completions
    and weights."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = build_tiny_llava(tokenizer, tmp_path / "llava")
    images = [Image.new("RGB", (28, 28), color=(40 * i, 255 - 30 * i, 100)) for i in range(4)]
    dataset = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": p}] for p in PROMPTS * 2], "image": images * 2}
    )
    results = {}
    for tag, trainer_cls, config_cls, extra in (
        ("grpo", GRPOTrainer, GRPOConfig, {}),
        ("tlt", TLTGRPOTrainer, TLTConfig, {"speculative_selector": "fixed"}),
    ):
        seen = []
        args = config_cls(**config_kwargs(tmp_path / tag, generation_kwargs={"do_sample": False}), **extra)
        trainer = trainer_cls(
            model=AutoModelForImageTextToText.from_pretrained(path),
            reward_funcs=recorder(seen),
            args=args,
            train_dataset=dataset,
            processing_class=AutoProcessor.from_pretrained(path),
        )
        trainer.train()
        results[tag] = (trainer, seen)
    (grpo, grpo_seen), (tlt, tlt_seen) = results["grpo"], results["tlt"]
    assert tlt_seen == grpo_seen and tlt.tlt_drafter is None and "vision-language" in tlt.tlt_fallback_reason
    for (n, p_base), (_, p_tlt) in zip(grpo.model.named_parameters(), tlt.model.named_parameters(), strict=True):
        torch.testing.assert_close(p_tlt, p_base, msg=n)
