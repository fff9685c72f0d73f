"""`TLTGRPOTrainer`'s drafter, speculation policy and spot trainer, built from `TLTConfig`."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.utils import logging

from ..drafter_training import DistillConfig
from ..drafters import Drafter, ModelDrafter, NgramDrafter
from ..drafters.draft_vocab import DEFAULT_DRAFT_VOCAB_SIZE, DraftVocabulary
from ..drafters.eagle3 import Eagle3Drafter, Eagle3Model
from ..drafters.history import PromptHistory
from ..drafters.hybrid import HybridDrafter
from ..speculation import (
    BANDIT_DRAFT_LENGTHS,
    LOOKUP_DRAFT_LENGTHS,
    Arm,
    BanditSpeculation,
    FixedSpeculation,
    SpeculationPolicy,
    tree_arm,
)
from ..spot import DataBuffer, SpotBudget, SpotSchedule, SpotTrainer


logger = logging.get_logger(__name__)

# A new EAGLE-3 head's cold start (spot training): drafter steps from the offline warm start's learning rate down to
# `spot_learning_rate`.
COLD_START_STEPS = 600
# Phases between rollouts a new head trains at the full time budget before its acceptance decides (one process).
NEW_HEAD_WARMUP_PHASES = 3


def _train_adapters_only(model: torch.nn.Module) -> None:
    """A drafter LM loaded with peft adapters (LoRA and the like): the adapters' parameters train, the base model's
    stay frozen (transformers loads adapters for inference, every parameter frozen)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    model.requires_grad_(False)
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            for name in module.adapter_layer_names:
                getattr(module, name).requires_grad_(True)


def _num_parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class DrafterSetup:
    """Mixed into `TLTGRPOTrainer`. The drafter (`drafter_type`), the speculation policy (`speculative_selector`) and
    the spot trainer (`spot_training`), built from `TLTConfig` at construction."""

    def _resolve_spot_training(self) -> bool:
        """`spot_training=None`: on whenever the trainer holds a drafter with weights (the engine's, or vLLM colocate's)."""
        if self.args.spot_training is not None:
            return self.args.spot_training
        return self._trainable_drafter() is not None and not (self.use_vllm and self.args.vllm_mode == "server")

    def _refuse_spot_training_without_engine(self) -> None:
        """The engine cannot run this policy: spot training asked for by name is an error; chosen by default, off."""
        if not self._tlt_spot_requested:
            self.tlt_spot, self.args.spot_training = None, False
            return
        if self.args.spot_training:
            raise ValueError(
                f"spot_training=True trains the drafter of trl-tlt's engine, which cannot run this policy: "
                f"{self.tlt_fallback_reason}. Set spot_training=False (rollouts then use GRPOTrainer's generation)."
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

    def _build_hybrid(self) -> HybridDrafter | None:
        """With `hybrid_drafting`: the drafter, the sibling lookup and the prompt history, chosen per row (the lookups
        alone with `drafter_type="ngram"`); None without a drafter."""
        if not self.args.hybrid_drafting or self.tlt_drafter is None or self.use_vllm:
            return None
        learned = None if isinstance(self.tlt_drafter, NgramDrafter) else self.tlt_drafter
        history = PromptHistory(self.args.history_max_tokens) if self.args.history_max_tokens else None
        return HybridDrafter(learned, history, learned_tokens=self.args.num_speculative_tokens)

    @property
    def tlt_history(self) -> PromptHistory | None:
        """The hybrid drafter's prompt history (None without `hybrid_drafting`, or with `history_max_tokens=0`)."""
        return self.tlt_hybrid.history if self.tlt_hybrid is not None else None

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
        if getattr(drafter_lm, "_hf_peft_config_loaded", False):  # a peft adapter folder: its adapters train alone
            _train_adapters_only(drafter_lm)
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
        arms = [Arm("default", k) for k in BANDIT_DRAFT_LENGTHS if k <= k_max] + [Arm("default", k_max)]
        if self.tlt_hybrid is not None:  # lookups draft past the learned drafter's k_max
            arms += [Arm("default", k) for k in LOOKUP_DRAFT_LENGTHS if k > k_max]
        if self.args.speculative_trees and hasattr(self.tlt_drafter, "propose_tree"):
            arms += [tree_arm("default", k_max, topk, topk * k_max) for topk in (2, 4)]
        cost_model = self._modelled_step_cost() if self.args.selector_deterministic else None
        return BanditSpeculation(
            arms=arms, epsilon=self.args.selector_epsilon, seed=self.args.seed, cost_model=cost_model
        )

    def _build_lookup_speculation(self) -> SpeculationPolicy | None:
        """The speculation policy of the rollouts in which the hybrid's lookups draft alone (spot training left the
        learned drafter idle): the chain arms (lookups draft no trees), with their own statistics."""
        if self.tlt_hybrid is None or not isinstance(self.tlt_speculation, BanditSpeculation):
            return self.tlt_speculation
        bandit = self.tlt_speculation
        chains = [arm for arm in bandit.arms if not arm.is_tree]
        return BanditSpeculation(arms=chains, epsilon=bandit.epsilon, seed=bandit.seed, cost_model=bandit.cost_model)

    def _modelled_step_cost(self):
        """Cost of a decode step in policy forwards: 1 (the verification, which scores all k+1 positions, or all of a
        tree's nodes, at once, as a memory-bound forward does) + k drafter forwards (a tree's depth), each weighted by
        the drafter's share of the parameters."""
        drafter = self._trainable_drafter()
        policy = self.accelerator.unwrap_model(self.model)
        ratio = 0.0 if drafter is None else _num_parameters(drafter) / _num_parameters(policy)

        k_max = self.args.num_speculative_tokens

        def cost(arm: Arm) -> float:
            return 1.0 + min(arm.k, k_max) * ratio  # lookups past k_max cost no drafter forward

        return cost

    def _trainable_drafter(self):
        """The drafter's own model (an `Eagle3Model` or a causal LM), or None for model-free drafters."""
        if isinstance(self.tlt_drafter, Eagle3Drafter | ModelDrafter):
            return self.tlt_drafter.model
        return None
