"""`TLTGRPOTrainer`: TRL's `GRPOTrainer` with rollouts from trl-tlt's lossless speculative engine.

Wiring only (each concern in its own module of this package, mixed in): the transformers generation branch of `GRPOTrainer._generate_single_turn` is replaced by
`SpeculativeEngine.generate` inside the same unwrap / no_grad / summon_full_params context (so DeepSpeed ZeRO-3
and FSDP keep working). With `use_vllm=True` the parent's vLLM engine is built as `TLTVLLMGeneration` (vLLM's own
speculative decoding with the trainer's drafter, pushed live). The completions are distributed exactly as the
parent's, so training is unchanged; only rollout time drops.
"""

from __future__ import annotations

import inspect
import tempfile
import threading
from collections.abc import Sized
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch
from transformers.utils import logging
from trl import GRPOTrainer
from trl.extras.profiling import profiling_context
from trl.models import unwrap_model_for_generation
from trl.trainer import grpo_trainer

from ..config import TLTConfig, as_tlt_config
from ..drafters import Drafter
from ..engine import SpeculativeEngine
from ..kv_cache import ragged_cache_mismatch
from ..micro_batching import REGROUPABLE_LOSS_TYPES, group_by_length, trimmed_logps_and_entropies
from ..sampling import SamplingParams
from ..speculation import FixedSpeculation, SpeculationPolicy, batch_size_bucket
from ..spot import SpotStats
from ..stats import GenerationStats
from ..vllm_generation import DrafterWatchdog
from .callbacks import GracefulStop, JoinDrafterWrites
from .drafter_checkpoints import DrafterCheckpoints
from .drafter_setup import DrafterSetup
from .generation_settings import GenerationSettings
from .rollout import RolloutTurn
from .vllm_rollouts import VLLMRollouts


logger = logging.get_logger(__name__)


class TLTGRPOTrainer(GenerationSettings, DrafterSetup, VLLMRollouts, DrafterCheckpoints, GRPOTrainer):
    """Drop-in `GRPOTrainer` whose transformers rollouts use lossless speculative decoding.

    Same constructor as [`~trl.GRPOTrainer`]; `args` may be a [`TLTConfig`] or a plain `GRPOConfig` (TLT defaults).

    Example:
        >>> from trl_tlt import TLTConfig, TLTGRPOTrainer
        >>> trainer = TLTGRPOTrainer(model=model, reward_funcs=reward, args=TLTConfig(output_dir="out"), train_dataset=ds)
        >>> trainer.train()
    """

    _tag_names = ["trl", "grpo", "trl-tlt"]

    def __init__(self, *args, **kwargs):  # GRPOTrainer's arguments, as they are (its signature: `__signature__` below)
        self.tlt_drafter: Drafter | None = None
        self._tlt_tmp: tempfile.TemporaryDirectory | None = None
        # The parent builds its vLLM engine in __init__: ours instead, with the drafter (built first) as speculator.
        with mock.patch.object(grpo_trainer, "VLLMGeneration", self._build_vllm_generation):
            super().__init__(*args, **kwargs)
        self.args: TLTConfig = as_tlt_config(self.args)
        if isinstance(self.train_dataset, Sized) and len(self.train_dataset) == 0:
            raise ValueError("`train_dataset` is empty: pass a dataset with at least one prompt to train on.")
        self._check_prompt_lengths()
        self._tlt_spot_requested = self.args.spot_training is True  # asked for by name, not chosen by default
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
        self.tlt_hybrid = self._build_hybrid()  # what drafts in the engine, around `tlt_drafter` (None: it alone)
        self.tlt_speculation = self._build_speculation()
        self._tlt_lookup_speculation = self._build_lookup_speculation()
        self.tlt_last_stats: GenerationStats | None = None
        self.tlt_last_vllm_stats: dict[str, float] | None = None
        self.tlt_vllm_spec_faults = 0  # rollouts regenerated without speculation (vLLM's samples failed the check)
        self.tlt_drafter_repushes = 0  # drafter pushes into vLLM the watchdog made
        self._tlt_watchdog = DrafterWatchdog()
        self.args.spot_training = self._resolve_spot_training()
        self.tlt_spot = self._build_spot_trainer() if self.args.spot_training else None
        if self.use_vllm and self.tlt_spot is not None:
            self.vllm_generation.sync_drafter()  # the ranks' drafters were just made equal (rank 0's)
        self.tlt_last_spot: SpotStats | None = None
        self._drafter_writer: threading.Thread | None = None
        self._drafter_write_error: tuple[Path, BaseException] | None = None
        self.add_callback(JoinDrafterWrites(self))
        self.add_callback(GracefulStop(self))
        # One stream per rank: ranks sample different prompts, but their noise must not be correlated either.
        seed = self.args.seed + self.accelerator.process_index
        self._tlt_generator = torch.Generator(device=self.accelerator.device).manual_seed(seed)
        self._tlt_turns: list[RolloutTurn] | None = None  # the current rollout's generation turns (None: none open)
        self._tlt_rollout_speculated = False  # whether vLLM speculated in the latest rollout

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

    # One rollout = one `_generate` call (GRPOTrainer makes one per generation batch, on every rank); with tools it has
    # one generation turn per tool turn, a number that differs from rank to rank. What involves the other ranks (spot
    # training's barrier and merge, the vLLM drafter's watch) or learns from the whole rollout (the prompt history)
    # runs once per rollout, at its end (`_end_rollout`), so that every rank runs the same collectives in the same order.
    def _generate(self, prompts):
        self._tlt_turns = []
        output = super()._generate(prompts)
        self._end_rollout()  # where `_generate_single_turn` or `_tool_call_loop` did not end it already
        return output

    def _tool_call_loop(self, *args, **kwargs):
        output = super()._tool_call_loop(*args, **kwargs)
        self._end_rollout()  # the rollout's last turn is done: before `_generate` waits for the other ranks
        return output

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        own_rollout = self._tlt_turns is None  # called outside `_generate`: a rollout of its own
        if own_rollout:
            self._tlt_turns = []
        output = self._generate_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        # Without tools or a rollout_func, `_generate` makes this one call: the rollout ends here, before `_generate`
        # gathers from the other ranks (the time spot training uses is this rank's wait for them).
        if own_rollout or (not self.tools and self.rollout_func is None):
            self._end_rollout()
        return output

    def _generate_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images):
        """One generation turn: trl-tlt's engine, vLLM (`_generate_with_vllm`), or GRPOTrainer's own generation."""
        reason = self._stock_generation_reason(images, multimodal_fields)
        if reason is None and self.use_vllm:
            return self._generate_with_vllm(prompt_ids, num_generations, has_tool_images)
        if reason is None:
            with profiling_context(self, "tlt.generate"), self._unwrapped_for_generation() as unwrapped_model:
                if not self._tlt_engine_checked:  # once, on the real policy (gathered, in eval mode)
                    self._tlt_engine_checked = True
                    self.tlt_fallback_reason = ragged_cache_mismatch(unwrapped_model, self._tokenizer.pad_token_id)
                reason = self.tlt_fallback_reason
                if reason is None:
                    drafter, speculation = self._rollout_drafter()
                    engine = SpeculativeEngine(
                        unwrapped_model,
                        drafter=drafter,
                        speculation=speculation,
                        pad_token_id=self._tokenizer.pad_token_id,
                    )
                    params = self._sampling_params(unwrapped_model)
                    out = engine.generate(
                        prompt_ids, params, generator=self._tlt_generator, padded_width=self._padded_width(prompt_ids)
                    )
            if reason is None:
                self._tlt_turns.append(RolloutTurn(prompt_ids, out.completion_ids, out.stats.total_s))
                self._log_rollout_stats(out.stats)
                # Like the parent's transformers path, no sampling logprobs: the trainer's own forward provides them.
                return out.completion_ids, None
            self._refuse_spot_training_without_engine()
        self._note_stock_generation(reason)
        return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)

    def _end_rollout(self) -> None:
        """Once per rollout, on every rank (see `_generate`), training only: its turns into the prompt history, the
        vLLM drafter watched, the drafter trained (spot training) and pushed into vLLM."""
        turns, self._tlt_turns = self._tlt_turns, None
        if turns is None:
            return
        # Whether vLLM may have speculated (the check of its samples): a server's speculation is not reported.
        server = self.use_vllm and self.args.vllm_mode == "server"
        self._tlt_rollout_speculated = server or any(turn.spec_stats is not None for turn in turns)
        if not self.model.training:
            return
        prompts = [p for turn in turns for p in turn.prompt_ids]
        completions = [list(c) for turn in turns for c in turn.completion_ids]
        if self.tlt_history is not None:
            self.tlt_history.add(prompts, completions)
        if self.use_vllm:
            self._end_vllm_rollout(turns)
        if self.tlt_spot is not None and (not self.use_vllm or self.vllm_generation.speculating):
            seconds = sum(turn.seconds for turn in turns)
            with self._unwrapped_for_generation() as unwrapped_model:
                self._spot_phase(unwrapped_model, prompts, completions, seconds)
            if self.use_vllm:
                with profiling_context(self, "tlt.sync_drafter"):
                    self.vllm_generation.sync_drafter()

    def _padded_width(self, prompt_ids: list[list[int]]) -> int:
        """The width GRPOTrainer's `generate` left-pads this batch of prompts to (`pad_to_multiple_of` included)."""
        width = max(map(len, prompt_ids))
        multiple = self.pad_to_multiple_of
        return width if not multiple else -(-width // multiple) * multiple

    def _rollout_drafter(self) -> tuple[Drafter | None, SpeculationPolicy]:
        """This rollout's drafter and speculation policy: a learned drafter that does not pay (spot training's
        verdict) is left idle, the hybrid's lookups still draft."""
        if self.tlt_spot is None or self.tlt_spot.drafter_pays:
            return self.tlt_hybrid or self.tlt_drafter, self.tlt_speculation
        if self.tlt_hybrid is not None:
            return self.tlt_hybrid.lookups_only(), self._tlt_lookup_speculation
        return None, FixedSpeculation(0)

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
        if stats.num_accepted_tokens:  # which source each accepted draft token came from (shares)
            for source, count in stats.num_accepted_tokens_by_source.items():
                metrics[f"tlt/accepted_from_{source}"] = count / stats.num_accepted_tokens
        if self.tlt_history is not None:
            metrics["tlt/history_tokens"] = float(self.tlt_history.num_tokens)
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
        if prompt_ids:  # a rollout with no turn of ours (a rollout_func's own generation) still joins the others
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


# What `inspect.signature`, IDEs and argument checks read: exactly GRPOTrainer's constructor (`reward_funcs` optional
# in TRL 1.16, where an environment may own the reward).
TLTGRPOTrainer.__init__.__signature__ = inspect.signature(GRPOTrainer.__init__)
