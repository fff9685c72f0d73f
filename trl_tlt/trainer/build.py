"""`build_rollout_stack`: a `RolloutStack` from `TLTConfig`, in one place (and the vLLM engine built with its drafter).

The drafter (`drafter_type`), the hybrid drafter around it (`hybrid_drafting`), the speculation policies
(`speculative_selector`), spot training (`spot_training`, resolved here and kept on the stack: the config is never
written) and the engine's generator. With vLLM colocate the drafter is built earlier, inside GRPOTrainer's
`__init__`, where vLLM is started with it (`build_vllm_generation`); the stack takes that one.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import tempfile
import time

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.utils import logging

from ..config import TLTConfig
from ..drafters import HybridDrafter, ModelDrafter, NgramDrafter, PromptHistory
from ..drafters.draft_vocab import DEFAULT_DRAFT_VOCAB_SIZE, DraftVocabulary
from ..drafters.eagle3 import Eagle3Drafter, Eagle3Model
from ..engine import Arm, BanditSpeculation, Drafter, FixedSpeculation, SpeculationPolicy, tree_arm
from ..engine.sharding import whole_parameters
from ..engine.speculation import BANDIT_DRAFT_LENGTHS, LOOKUP_DRAFT_LENGTHS
from ..training.distillation import DistillConfig
from ..training.spot import DataBuffer, SpotBudget, SpotSchedule, SpotTrainer
from ..vllm.generation import TLTVLLMGeneration, speculative_config
from ..vllm.watchdog import DrafterWatchdog
from .stack import RolloutStack, drafter_model


logger = logging.get_logger(__name__)

# A new EAGLE-3 head's cold start (spot training): drafter steps from the offline warm start's learning rate down to
# `spot_learning_rate`.
COLD_START_STEPS = 600
# Phases between rollouts a new head trains at the full time budget before its acceptance decides (one process).
NEW_HEAD_WARMUP_PHASES = 3


def build_rollout_stack(
    args: TLTConfig, trainer, fallback_reason: str | None, vllm_drafter: Drafter | None = None
) -> RolloutStack:
    """The stack of `trainer` (a `TLTGRPOTrainer` whose `GRPOTrainer.__init__` ran). `fallback_reason`: why its rollouts
    go through GRPOTrainer's generation (None: trl-tlt's engine, or vLLM); `vllm_drafter`: the drafter vLLM was started
    with (`build_vllm_generation`)."""
    accelerator = trainer.accelerator
    policy = accelerator.unwrap_model(trainer.model)
    if trainer.use_vllm:
        drafter = vllm_drafter
    elif fallback_reason is None:
        drafter = build_drafter(args, policy, accelerator.device, trainer.processing_class)
    else:
        drafter = None
    hybrid = None
    if args.hybrid_drafting and drafter is not None and not trainer.use_vllm:
        learned = None if isinstance(drafter, NgramDrafter) else drafter
        history = PromptHistory(args.history_max_tokens) if args.history_max_tokens else None
        hybrid = HybridDrafter(learned, history, learned_tokens=args.num_speculative_tokens)
    speculation = build_speculation(args, drafter, hybrid, policy)
    model = drafter_model(drafter)
    spot_on = args.spot_training
    if spot_on is None:  # on whenever the trainer holds a drafter with weights (the engine's, vLLM's, a server's)
        spot_on = model is not None
    if fallback_reason is not None and spot_on:
        if args.spot_training:
            raise ValueError(
                f"spot_training=True trains the drafter of trl-tlt's engine, which cannot run this policy: "
                f"{fallback_reason}. Set spot_training=False (rollouts then use GRPOTrainer's generation)."
            )
        spot_on = False
    colocated = trainer.use_vllm and args.vllm_mode == "colocate" and args.drafter_type != "none"
    # One stream per rank: ranks sample different prompts, but their noise must not be correlated either.
    generator = torch.Generator(device=accelerator.device).manual_seed(args.seed + accelerator.process_index)
    stack = RolloutStack(
        drafter=drafter,
        hybrid=hybrid,
        speculation=speculation,
        lookup_speculation=lookup_speculation(speculation, hybrid),
        spot=build_spot_trainer(args, model, accelerator, trainer.use_vllm) if spot_on else None,
        generator=generator,
        watchdog=DrafterWatchdog() if colocated else None,
        fallback_reason=fallback_reason,
        spot_requested=args.spot_training is True,
        feature_source=args.spot_feature_source,
        engine_checked=trainer.use_vllm,  # else the engine's cache is checked on the real policy at the first rollout
    )
    if stack.spot is not None and trainer.use_vllm and args.vllm_mode == "server":  # the wait for the server
        stack.trains_while_waiting = True
        trainer.vllm_generation.while_waiting = stack.train_while_waiting
        if accelerator.device.type == "cpu":  # a server on this host shares the cores: the time budget's share
            trainer.vllm_generation.while_waiting = functools.partial(within_budget, stack, args.spot_time_budget)
    return stack


def within_budget(stack: RolloutStack, time_budget: float, done):
    """`stack.train_while_waiting(done)`, its drafter steps stopped after `time_budget` x the last rollout's seconds:
    a trainer on CPU cores shares them with a server on the same host, whose wait is then not idle time."""
    deadline = time.perf_counter() + time_budget * stack.rollout_costs[0]
    return stack.train_while_waiting(lambda: done() or time.perf_counter() > deadline)


# ------------------------------------------------------------------------------------------------- drafters
def build_drafter(args: TLTConfig, policy: PreTrainedModel, device: torch.device, processing_class) -> Drafter | None:
    """The drafter of `drafter_type` for `policy` (a new head's weights drawn from a stream of their own, seeded: TRL's
    global stream, its shuffles of the generation batch, stays the one GRPOTrainer would have)."""
    kind = args.drafter_type
    if kind == "none":
        return None
    if kind == "ngram":
        return NgramDrafter()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(args.seed)
        if kind == "eagle3":
            return Eagle3Drafter(build_eagle3(args, policy))
        drafter_lm = load_drafter_lm(args.drafter_model_name_or_path, processing_class)
    drafter_lm.to(device)
    return ModelDrafter(drafter_lm, policy.config.get_text_config().vocab_size)


def build_eagle3(args: TLTConfig, policy: PreTrainedModel) -> Eagle3Model:
    path = args.drafter_model_name_or_path
    if path is not None:
        return Eagle3Model.from_pretrained(path, policy)
    if args.spot_training is False:
        logger.warning(
            "drafter_type='eagle3' without drafter_model_name_or_path or spot_training: a new EAGLE-3 head that "
            "never trains accepts almost nothing. Set spot_training=True, or warm-start one with "
            "trl-tlt train-drafter and pass its directory."
        )
    vocab_size = policy.config.get_text_config().vocab_size
    draft_vocab_size = min(args.draft_vocab_size or DEFAULT_DRAFT_VOCAB_SIZE, vocab_size)
    # what the head starts from (the policy's LM head and final norm), whole: a policy loaded under an active ZeRO-3
    # config is partitioned already
    norm = getattr(policy.get_decoder(), "norm", None)
    read = [policy.get_output_embeddings().weight, *([] if norm is None else [norm.weight])]
    with whole_parameters(*read):
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


def load_drafter_lm(path: str, processing_class) -> PreTrainedModel:
    """The drafter LM (safetensors weights only, no remote code), refused by name unless it reads the policy's
    tokens: its vocabulary covers the policy tokenizer's, and a tokenizer saved with it is the policy's. A peft
    adapter folder (LoRA and the like) trains its adapters alone."""
    try:
        with without_zero3_init():  # replicated on every rank, whole: never partitioned with the policy
            drafter_lm = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"Cannot load the drafter LM `drafter_model_name_or_path={path!r}` (a causal LM saved with "
            f"save_pretrained, safetensors weights): {error}"
        ) from error
    if getattr(drafter_lm, "_hf_peft_config_loaded", False):
        _train_adapters_only(drafter_lm)
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
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


@contextlib.contextmanager
def without_zero3_init():
    """Within it, transformers loads models whole even where a ZeRO-3 config is active (`zero3_init_flag`: it would load
    them inside `deepspeed.zero.Init`, partitioned across ranks, and nothing gathers a drafter's shards before it
    drafts). The config is restored after."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def _train_adapters_only(model: torch.nn.Module) -> None:
    """A drafter LM loaded with peft adapters (LoRA and the like): the adapters' parameters train, the base model's
    stay frozen (transformers loads adapters for inference, every parameter frozen)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    model.requires_grad_(False)
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            for name in module.adapter_layer_names:
                getattr(module, name).requires_grad_(True)


# --------------------------------------------------------------------------------------------- speculation
def build_speculation(
    args: TLTConfig, drafter: Drafter | None, hybrid: HybridDrafter | None, policy: PreTrainedModel
) -> SpeculationPolicy:
    if drafter is None:
        return FixedSpeculation(0)
    k_max = args.num_speculative_tokens
    if args.speculative_selector == "fixed":
        return FixedSpeculation(k_max, "default")
    arms = [Arm("default", k) for k in BANDIT_DRAFT_LENGTHS if k <= k_max] + [Arm("default", k_max)]
    if hybrid is not None:  # lookups draft past the learned drafter's k_max
        arms += [Arm("default", k) for k in LOOKUP_DRAFT_LENGTHS if k > k_max]
    if args.speculative_trees and hasattr(drafter, "propose_tree"):
        arms += [tree_arm("default", k_max, topk, topk * k_max) for topk in (2, 4)]
    cost_model = modelled_step_cost(drafter, policy, k_max) if args.selector_deterministic else None
    return BanditSpeculation(arms=arms, epsilon=args.selector_epsilon, seed=args.seed, cost_model=cost_model)


def lookup_speculation(speculation: SpeculationPolicy, hybrid: HybridDrafter | None) -> SpeculationPolicy:
    """The speculation policy of the rollouts in which the hybrid's lookups draft alone (spot training left the
    learned drafter idle): the chain arms (lookups draft no trees), with their own statistics."""
    if hybrid is None or not isinstance(speculation, BanditSpeculation):
        return speculation
    chains = [arm for arm in speculation.arms if not arm.is_tree]
    return BanditSpeculation(
        arms=chains, epsilon=speculation.epsilon, seed=speculation.seed, cost_model=speculation.cost_model
    )


def modelled_step_cost(drafter: Drafter, policy: PreTrainedModel, k_max: int):
    """Cost of a decode step in policy forwards: 1 (the verification, which scores all k+1 positions, or all of a
    tree's nodes, at once, as a memory-bound forward does) + k drafter forwards (a tree's depth), each weighted by
    the drafter's share of the parameters."""
    model = drafter_model(drafter)
    ratio = 0.0 if model is None else _num_parameters(model) / _num_parameters(policy)

    def cost(arm: Arm) -> float:
        return 1.0 + min(arm.k, k_max) * ratio  # lookups past k_max cost no drafter forward

    return cost


def _num_parameters(module: torch.nn.Module) -> int:
    """Its parameters' elements, whole (a ZeRO-3 partitioned parameter's `numel()` is its shard's: `ds_numel`)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())


# ------------------------------------------------------------------------------------------- spot training
def build_spot_trainer(args: TLTConfig, drafter, accelerator, use_vllm: bool) -> SpotTrainer:
    # A dedicated gloo group: the idle barrier and the merge never touch the policy's process group.
    # Its timeout (`ddp_timeout`, as the policy's collectives) turns a dead or hung rank into an error.
    timeout = datetime.timedelta(seconds=args.ddp_timeout)
    group = dist.new_group(backend="gloo", timeout=timeout) if accelerator.num_processes > 1 else None
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
    bf16 = args.spot_precision == "bf16" or (args.spot_precision == "auto" and has_bf16_matrix_units(drafter.device))
    return SpotTrainer(
        drafter,
        DataBuffer(
            args.spot_buffer_steps,
            args.spot_buffer_max_tokens,
            args.spot_buffer_max_memory_mb << 20,
            updates_per_rollout=-(
                -args.steps_per_generation * args.num_iterations // args.gradient_accumulation_steps
            ),
        ),  # fmt: skip
        schedule=SpotSchedule(learning_rate=args.spot_learning_rate, cold_steps=cold_steps),
        tokens_per_step=args.spot_tokens_per_step,
        config=DistillConfig(ttt_length=args.drafter_ttt_length),
        group=group,
        seed=args.seed + accelerator.process_index,
        budget=SpotBudget(args.spot_time_budget, warmup_phases=NEW_HEAD_WARMUP_PHASES if new_head else 0),
        steps_per_phase=args.spot_steps_per_rollout,
        vocab=DraftVocabulary(drafter.config.vocab_size, drafter.config.draft_vocab_size) if reduced_vocab else None,
        # vLLM loads the head once, at its size: only trl-tlt's engine takes a head resized to the policy's tokens
        fit_vocab=args.draft_vocab_size is None and not use_vllm,
        autocast_dtype=torch.bfloat16 if bf16 else None,
    )


def has_bf16_matrix_units(device: torch.device) -> bool:
    """Whether `device` multiplies bf16 matrices natively: a CUDA GPU that supports bf16, a CPU with AMX or AVX512-BF16
    (where `spot_precision="auto"` trains the drafter in bf16)."""
    if device.type == "cuda":  # tensor cores with bf16 from Ampere (compute capability 8) on; earlier ones emulate it
        return torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] >= 8
    if device.type == "cpu":  # private probes of torch.cpu (torch >= 2.3); absent: no
        probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
        return any(getattr(torch.cpu, name, lambda: False)() for name in probes)
    return False


# ---------------------------------------------------------------------------------------------------- vLLM
def build_vllm_generation(
    args: TLTConfig, policy: PreTrainedModel, device: torch.device, policy_tokenizer, **vllm_kwargs
) -> tuple[TLTVLLMGeneration, Drafter | None]:
    """What GRPOTrainer's `__init__` builds as `VLLMGeneration(**vllm_kwargs)`: the same engine, speculating with the
    trainer's drafter (built here: vLLM loads it from a directory at start; `policy_tokenizer`: the trainer's
    processing class, which a drafter LM must share). Returns the engine and the drafter."""
    drafter = build_drafter(args, policy, device, policy_tokenizer)
    model = drafter_model(drafter)
    if args.vllm_mode == "server":  # the server speculates with its own copy, into which the drafter is pushed
        generation = TLTVLLMGeneration(**vllm_kwargs, drafter=model)
        if model is not None and not generation.pushes_drafter:
            if args.spot_training:
                raise ValueError(
                    "spot_training=True trains the drafter the vLLM server speculates with, and this server has no "
                    "draft model to push it into. Start it with `trl-tlt vllm-serve` (docs/server.md), or set "
                    "spot_training=False."
                )
            generation.drafter = drafter = None  # nothing to train: the server's speculation (if any) is its own
        return generation, drafter
    if isinstance(model, Eagle3Model) and not model.exportable:
        raise ValueError(
            f"vLLM cannot load an EAGLE-3 head with repeated layer ids {model.aux_layer_ids} (a policy with fewer "
            "than 3 decoder layers). Set drafter_type='ngram' or 'none', or use_vllm=False."
        )
    if model is not None and any("lora_" in name for name, _ in model.named_parameters()):
        raise ValueError(
            "A LoRA (peft) drafter cannot be pushed into vLLM's draft model; merge the adapter into the drafter "
            "LM first (`merge_and_unload()`), use drafter_type='eagle3', or set use_vllm=False."
        )
    path, folder = args.drafter_model_name_or_path, None
    if isinstance(model, Eagle3Model) and path is None:  # a new head: vLLM loads it from a directory
        folder = tempfile.TemporaryDirectory(prefix="trl-tlt-drafter-")
        model.save_pretrained(folder.name)
        path = folder.name
    config = speculative_config(
        args.drafter_type,
        path,
        args.num_speculative_tokens,
        args.vllm_speculative_max_batch_size,
        args.vllm_draft_sample_method,
    )
    generation = TLTVLLMGeneration(**vllm_kwargs, speculative_config=config, drafter=model, drafter_folder=folder)
    return generation, drafter
