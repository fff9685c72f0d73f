"""What `TLTGRPOTrainer` samples with, and when its rollouts go through GRPOTrainer's own generation instead."""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
from datasets import Dataset
from peft import PeftModel
from transformers import GenerationConfig
from transformers.generation.utils import GenerationMixin
from transformers.utils import logging
from trl.models import unwrap_model_for_generation

from ..engine import SamplingParams
from ..engine.kv_cache import unsupported_architecture


logger = logging.get_logger(__name__)

# GenerationConfig attributes the engine reproduces exactly; any other non-default setting is rejected.
_SUPPORTED_GENERATION_KEYS = {
    "max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "suppress_tokens",
    "pad_token_id", "bos_token_id", "eos_token_id", "cache_implementation", "disable_compile",
}  # fmt: skip
# Attributes that change nothing in what one sampled sequence per prompt looks like: beam-search-only settings (the
# trainer samples, num_beams=1), the KV cache switch, and what `generate` would return besides the tokens.
_HARMLESS_GENERATION_KEYS = {
    "length_penalty", "early_stopping", "use_cache", "max_length", "renormalize_logits", "remove_invalid_values",
    "output_scores", "output_logits", "output_attentions", "output_hidden_states", "compile_config",
}  # fmt: skip
# transformers' own `generate`, as imported: a model whose `generate` is anything else (a subclass's override, a
# patch such as TRL's tests apply) generates with it, through GRPOTrainer's path.
_TRANSFORMERS_GENERATE = GenerationMixin.generate


def has_custom_generate(model) -> bool:
    """True if `model.generate` is not transformers' (overridden by its class, or patched on the instance or class).
    The Trainer's own patch under FSDP2 (`register_fsdp_forward_method(model, "generate")`: generate between the root's
    unshard and reshard) is transformers' generate still: the engine keeps a sharded policy's ranks in lockstep."""
    patched = vars(model).get("generate")
    if patched is not None and not _fsdp_forward_method(model, patched):
        return True
    if isinstance(model, PeftModel):  # PEFT's generate wraps the base model's
        return has_custom_generate(model.get_base_model())
    return getattr(type(model), "generate", None) is not _TRANSFORMERS_GENERATE


def _fsdp_forward_method(model, method) -> bool:
    """Whether `method` is FSDP2's wrapper (`register_fsdp_forward_method`) around the class's own method."""
    from torch.distributed.fsdp import FSDPModule

    wrapped = getattr(method, "__wrapped__", None)  # functools.wraps of the bound original
    return isinstance(model, FSDPModule) and getattr(wrapped, "__func__", None) is getattr(
        type(model), "generate", None
    )


def generation_config(model, config: GenerationConfig) -> GenerationConfig:
    """The configuration `generate` would sample with: `config` (the trainer's), its unset fields taken from the model's
    `generation_config`, then transformers' defaults (transformers' own merge, so both trainers agree)."""
    merged, _ = model._prepare_generation_config(copy.deepcopy(config))
    return merged


def sampling_params(model, config: GenerationConfig) -> SamplingParams:
    """The engine's `SamplingParams` for what `generate` would sample with (`generation_config`)."""
    merged = generation_config(model, config)
    eos = merged.eos_token_id
    eos = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
    return SamplingParams(
        do_sample=bool(merged.do_sample),
        temperature=merged.temperature,
        top_k=merged.top_k or None,
        top_p=merged.top_p,
        min_p=merged.min_p or None,
        repetition_penalty=merged.repetition_penalty,
        max_new_tokens=merged.max_new_tokens,
        eos_token_ids=eos,
        suppress_token_ids=tuple(merged.suppress_tokens or ()),
    )


def unsupported_generation_settings(model, config: GenerationConfig) -> list[str]:
    """The settings (from `generation_kwargs` or the model's generation_config.json) the engine would not reproduce;
    settings that cannot change a sampled sequence are accepted."""
    merged = generation_config(model, config).to_dict()
    default = GenerationConfig()
    default.update(**default._get_default_generation_params(), defaults_only=True)
    default = default.to_dict()
    return sorted(
        key
        for key, value in merged.items()
        if key in default
        and not key.startswith("_")  # bookkeeping, e.g. _from_model_config
        and key not in _SUPPORTED_GENERATION_KEYS | _HARMLESS_GENERATION_KEYS
        and value != default[key]
    )


def stock_generation_at_init(args, is_vlm: bool, policy, config: GenerationConfig | None) -> str | None:
    """Why a trainer's rollouts must use GRPOTrainer's own generation (the engine would not reproduce them exactly, or
    cannot run the policy), or None. `config`: the trainer's generation config (None with vLLM)."""
    if args.use_transformers_continuous_batching:
        return "use_transformers_continuous_batching=True asks for transformers' continuous batching"
    if is_vlm:
        return "vision-language models (a processor as processing_class) generate with GRPOTrainer's code"
    unsupported = unsupported_generation_settings(policy, config) if config is not None else []
    if unsupported:
        return (
            f"the engine cannot reproduce the generation settings {unsupported} exactly (from `generation_kwargs` "
            "or the model's generation_config.json); it reproduces do_sample, temperature, top_p, top_k, min_p, "
            "repetition_penalty, suppress_tokens, max_new_tokens and eos_token_id"
        )
    return unsupported_architecture(policy)


def stock_generation_reason(images, multimodal_fields, fallback_reason: str | None, policy) -> str | None:
    """Why this turn must go through GRPOTrainer's own generation, or None (trl-tlt's engine)."""
    if images is not None or multimodal_fields:
        return "multimodal inputs (images or processor fields) are generated by GRPOTrainer's code"
    if fallback_reason is not None:
        return fallback_reason
    if has_custom_generate(policy):
        return "the model's `generate` is not transformers' (overridden by its class, or patched); it is used as is"
    return None


def check_prompt_lengths(trainer) -> None:
    """Refuse, at construction, a dataset prompt that fills the policy's context (GRPOTrainer would generate past the
    positions the model knows, or fail mid-run on learned positions); warn once when a prompt plus
    `max_completion_length` may run past it. Prompts are tokenized as GRPOTrainer does (`_tokenize_prompts`); datasets
    that are not `datasets.Dataset`, vision-language models, environments and `rollout_func` are left to the engine's
    check at generation time."""
    context = getattr(trainer.accelerator.unwrap_model(trainer.model).config, "max_position_embeddings", None)
    if (
        context is None
        or trainer._is_vlm
        or trainer.environment_factories is not None
        or trainer.rollout_func is not None
    ):
        return
    named = {"train_dataset": trainer.train_dataset}
    if isinstance(trainer.eval_dataset, dict):
        named |= {f"eval_dataset[{key!r}]": dataset for key, dataset in trainer.eval_dataset.items()}
    else:
        named["eval_dataset"] = trainer.eval_dataset
    room = context - trainer.args.max_completion_length
    for name, dataset in named.items():
        if not isinstance(dataset, Dataset) or "prompt" not in dataset.column_names:
            continue
        row, num_over = 0, 0
        for batch in dataset.select_columns("prompt").iter(batch_size=1024):
            for length in map(len, trainer._tokenize_prompts(batch["prompt"])[0]):
                if length >= context:
                    raise ValueError(
                        f"{name} row {row}: its prompt is {length} tokens, as long as the policy's context or "
                        f"longer (max_position_embeddings={context}): no completion fits. Drop such prompts "
                        f"(e.g. {name}.filter(...)) or use a policy with a longer context."
                    )
                num_over += length > room
                row += 1
        if num_over:
            logger.warning(
                f"{num_over} of {row} prompts in {name} leave fewer than max_completion_length="
                f"{trainer.args.max_completion_length} tokens of the policy's context (max_position_embeddings="
                f"{context}): a completion that long runs past the positions the model knows, as with GRPOTrainer. "
                "Lower max_completion_length or drop the longest prompts."
            )


def padded_width(prompt_ids: list[list[int]], pad_to_multiple_of: int | None) -> int:
    """The width GRPOTrainer's `generate` left-pads this batch of prompts to (`pad_to_multiple_of` included)."""
    width = max(map(len, prompt_ids))
    return width if not pad_to_multiple_of else -(-width // pad_to_multiple_of) * pad_to_multiple_of


@contextmanager
def unwrapped_for_generation(trainer):
    """GRPOTrainer's generation context (unwrap / no_grad / summon_full_params), the model in eval mode."""
    with (
        unwrap_model_for_generation(
            trainer.model_wrapped,
            trainer.accelerator,
            gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
            generation_kwargs=getattr(trainer, "generation_kwargs", None),  # unset with vLLM
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
        ) as unwrapped_model,
        torch.no_grad(),
        trainer._dist.summon_full_params(trainer.model_wrapped, recurse=False),
    ):
        was_training = unwrapped_model.training
        unwrapped_model.eval()
        try:
            yield unwrapped_model
        finally:
            unwrapped_model.train(was_training)
