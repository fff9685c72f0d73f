"""When `TLTGRPOTrainer` rollouts go through GRPOTrainer's own generation: settings the engine does not reproduce."""

from __future__ import annotations

import copy

from datasets import Dataset
from peft import PeftModel
from transformers import GenerationConfig
from transformers.generation.utils import GenerationMixin
from transformers.utils import logging

from ..kv_cache import unsupported_architecture


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
    """True if `model.generate` is not transformers' (overridden by its class, or patched on the instance or class)."""
    if "generate" in vars(model):
        return True
    if isinstance(model, PeftModel):  # PEFT's generate wraps the base model's
        return has_custom_generate(model.get_base_model())
    return getattr(type(model), "generate", None) is not _TRANSFORMERS_GENERATE


class GenerationSettings:
    """Mixed into `TLTGRPOTrainer`. Which rollouts the engine generates and which go through GRPOTrainer's own
    generation (settings it would not reproduce exactly, custom `generate`, multimodal inputs), said once per reason;
    prompt lengths checked."""

    def _generation_config(self, model) -> GenerationConfig:
        """The configuration `generate` would sample with: the trainer's, its unset fields taken from the model's
        `generation_config`, then transformers' defaults (transformers' own merge, so both trainers agree)."""
        config, _ = model._prepare_generation_config(copy.deepcopy(self.generation_config))
        return config

    def _stock_generation_at_init(self, policy) -> str | None:
        """Why this trainer's rollouts must use GRPOTrainer's own generation (the engine would not reproduce them
        exactly, or cannot run the policy), or None."""
        if self.args.use_transformers_continuous_batching:
            return "use_transformers_continuous_batching=True asks for transformers' continuous batching"
        if self._is_vlm:
            return "vision-language models (a processor as processing_class) generate with GRPOTrainer's code"
        unsupported = self._unsupported_generation_settings(policy)
        if unsupported:
            return (
                f"the engine cannot reproduce the generation settings {unsupported} exactly (from `generation_kwargs` "
                "or the model's generation_config.json); it reproduces do_sample, temperature, top_p, top_k, min_p, "
                "repetition_penalty, suppress_tokens, max_new_tokens and eos_token_id"
            )
        return unsupported_architecture(policy)

    def _unsupported_generation_settings(self, model) -> list[str]:
        """The settings (from `generation_kwargs` or the model's generation_config.json) the engine would not reproduce;
        settings that cannot change a sampled sequence are accepted."""
        config = self._generation_config(model).to_dict()
        default = GenerationConfig()
        default.update(**default._get_default_generation_params(), defaults_only=True)
        default = default.to_dict()
        return sorted(
            key
            for key, value in config.items()
            if key in default
            and not key.startswith("_")  # bookkeeping, e.g. _from_model_config
            and key not in _SUPPORTED_GENERATION_KEYS | _HARMLESS_GENERATION_KEYS
            and value != default[key]
        )

    def _check_prompt_lengths(self) -> None:
        """Refuse, at construction, a dataset prompt that fills the policy's context (GRPOTrainer would generate
        past the positions the model knows, or fail mid-run on learned positions); warn once when a prompt plus
        `max_completion_length` may run past it. Prompts are tokenized as GRPOTrainer does (`_tokenize_prompts`);
        datasets that are not `datasets.Dataset`, vision-language models, environments and `rollout_func` are left
        to the engine's check at generation time."""
        context = getattr(self.accelerator.unwrap_model(self.model).config, "max_position_embeddings", None)
        if context is None or self._is_vlm or self.environment_factories is not None or self.rollout_func is not None:
            return
        named = {"train_dataset": self.train_dataset}
        if isinstance(self.eval_dataset, dict):
            named |= {f"eval_dataset[{key!r}]": dataset for key, dataset in self.eval_dataset.items()}
        else:
            named["eval_dataset"] = self.eval_dataset
        room = context - self.args.max_completion_length
        for name, dataset in named.items():
            if not isinstance(dataset, Dataset) or "prompt" not in dataset.column_names:
                continue
            row, num_over = 0, 0
            for batch in dataset.select_columns("prompt").iter(batch_size=1024):
                for length in map(len, self._tokenize_prompts(batch["prompt"])[0]):
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
                    f"{self.args.max_completion_length} tokens of the policy's context (max_position_embeddings="
                    f"{context}): a completion that long runs past the positions the model knows, as with GRPOTrainer. "
                    "Lower max_completion_length or drop the longest prompts."
                )

    def _note_stock_generation(self, reason: str) -> None:
        """Say once per reason that rollouts use GRPOTrainer's generation (correct, without TLT's speed-up)."""
        if reason not in self._tlt_notes:
            self._tlt_notes.add(reason)
            logger.warning(
                f"TLTGRPOTrainer generates with GRPOTrainer's own generation (no speculative decoding): {reason}."
            )

    def _stock_generation_reason(self, images, multimodal_fields) -> str | None:
        """Why this rollout must go through GRPOTrainer's own generation, or None (trl-tlt's engine, or vLLM)."""
        if images is not None or multimodal_fields:
            return "multimodal inputs (images or processor fields) are generated by GRPOTrainer's code"
        if self.use_vllm:
            return None
        if self.tlt_fallback_reason is not None:
            return self.tlt_fallback_reason
        if has_custom_generate(self.accelerator.unwrap_model(self.model)):
            return (
                "the model's `generate` is not transformers' (overridden by its class, or patched); it is used as is"
            )
        return None
