"""`TLTGRPOTrainer`: TRL's `GRPOTrainer` with rollouts from trl-tlt's lossless speculative engine.

Every GRPOTrainer (and Trainer) hook it overrides is in this file, each wrapping the parent with `super()` and
delegating to the trainer's `RolloutStack` (`stack.py`, built from the config by `build.py`): the drafter, the
speculation policies, spot training, the prompt history, vLLM's drafter watch and the engine's generator live there.
The transformers generation branch of `GRPOTrainer._generate_single_turn` is replaced by `SpeculativeEngine.generate`
inside the same unwrap / no_grad / summon_full_params context (so DeepSpeed ZeRO-3 and FSDP keep working). With
`use_vllm=True` the parent's vLLM engine is built as `TLTVLLMGeneration` (vLLM's own speculative decoding with the
trainer's drafter, pushed live). The completions are distributed exactly as the parent's, so training is unchanged.
"""

from __future__ import annotations

import functools
import inspect
import os
import time
from collections import defaultdict
from collections.abc import Sized
from contextlib import nullcontext
from pathlib import Path

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging
from trl import GRPOTrainer
from trl.extras.profiling import profiling_context
from trl.trainer import grpo_trainer

from .._swap import swapped
from ..config import TLTConfig, as_tlt_config
from ..engine.features import SequenceFeatures
from ..engine.kv_cache import ragged_cache_mismatch
from ..engine.sharding import agreed_count, needs_lockstep, policy_is_sharded
from ..training.micro_batching import (
    group_by_length,
    regroups_micro_batches,
    split_tokens_for,
    trimmed_logps_and_entropies,
)
from ..vllm.check import SampleMoments
from ..vllm.watchdog import DrafterWatchdog
from . import export
from . import generation_settings as settings
from .build import build_rollout_stack, build_vllm_generation
from .callbacks import GracefulStop, JoinDrafterWrites
from .metrics import rollout_metrics, spot_metrics, vllm_rollout_metrics
from .stack import RolloutStack, RolloutTurn


logger = logging.get_logger(__name__)


def _parent_without_stack(hook):
    """A GRPOTrainer hook that runs the parent's where the trainer has no `RolloutStack`: one built without `__init__`
    (TRL's own dispatch tests make one with `object.__new__` and set a few attributes) is a GRPOTrainer."""

    @functools.wraps(hook)
    def dispatch(self, *args, **kwargs):
        if "tlt" not in vars(self):
            return getattr(super(TLTGRPOTrainer, self), hook.__name__)(*args, **kwargs)
        return hook(self, *args, **kwargs)

    return dispatch


class TLTGRPOTrainer(GRPOTrainer):
    """Drop-in `GRPOTrainer` whose rollouts use lossless speculative decoding.

    Same constructor as [`~trl.GRPOTrainer`]; `args` may be a [`TLTConfig`] or a plain `GRPOConfig` (TLT defaults).
    `trainer.tlt` is its `RolloutStack` (the drafter, speculation, spot training, ...).

    Example:
        >>> from trl_tlt import TLTConfig, TLTGRPOTrainer
        >>> trainer = TLTGRPOTrainer(model=model, reward_funcs=reward, args=TLTConfig(output_dir="out"), train_dataset=ds)
        >>> trainer.train()
    """

    _tag_names = ["trl", "grpo", "trl-tlt"]

    def __init__(self, *args, **kwargs):  # GRPOTrainer's arguments, as they are (its signature: `__signature__` below)
        vllm_drafter = []

        def vllm_generation(**vllm_kwargs):  # where GRPOTrainer builds its VLLMGeneration: ours, with the drafter
            generation, drafter = build_vllm_generation(
                as_tlt_config(self.args), self.accelerator.unwrap_model(self.model), self.accelerator.device,
                self.processing_class, **vllm_kwargs,
            )  # fmt: skip
            vllm_drafter.append(drafter)
            return generation

        with swapped(grpo_trainer, "VLLMGeneration", vllm_generation):
            super().__init__(*args, **kwargs)
        self.args: TLTConfig = as_tlt_config(self.args)
        if isinstance(self.train_dataset, Sized) and len(self.train_dataset) == 0:
            raise ValueError("`train_dataset` is empty: pass a dataset with at least one prompt to train on.")
        settings.check_prompt_lengths(self)
        self._tlt_notes: set[str] = set()  # the reasons for GRPOTrainer's generation already said
        fallback = None
        if not self.use_vllm:
            policy = self.accelerator.unwrap_model(self.model)
            fallback = settings.stock_generation_at_init(self.args, self._is_vlm, policy, self.generation_config)
            if fallback is not None:
                self._note_stock_generation(fallback)
        self.tlt: RolloutStack = build_rollout_stack(self.args, self, fallback, next(iter(vllm_drafter), None))
        if self.use_vllm and self.tlt.spot is not None:
            self.vllm_generation.sync_drafter()  # the ranks' drafters were just made equal (rank 0's)
        self.add_callback(JoinDrafterWrites(self.tlt))
        self.add_callback(GracefulStop(self.accelerator))

    # What the stack holds, by the names the API has had (docs/trainer.md).
    tlt_drafter = property(lambda self: self.tlt.drafter)
    tlt_hybrid = property(lambda self: self.tlt.hybrid)
    tlt_history = property(lambda self: self.tlt.history)
    tlt_speculation = property(lambda self: self.tlt.speculation)
    tlt_spot = property(lambda self: self.tlt.spot)
    tlt_fallback_reason = property(lambda self: self.tlt.fallback_reason)
    tlt_last_stats = property(lambda self: self.tlt.last_stats)
    tlt_last_spot = property(lambda self: self.tlt.last_spot)
    tlt_last_vllm_stats = property(lambda self: self.tlt.last_vllm_stats)
    tlt_vllm_spec_faults = property(lambda self: self.tlt.vllm_spec_faults)
    tlt_drafter_repushes = property(lambda self: self.tlt.drafter_repushes)

    # --------------------------------------------------------------------------------------------- rollouts
    # One rollout = one `_generate` call (GRPOTrainer makes one per generation batch, on every rank); with tools it has
    # one generation turn per tool turn, a number that differs from rank to rank. What involves the other ranks (spot
    # training's barrier and merge, the vLLM drafter's watch) or learns from the whole rollout (the prompt history)
    # runs once per rollout, at its end (`_end_rollout`), so that every rank runs the same collectives in the same order.
    @_parent_without_stack
    def _generate(self, prompts):
        self.tlt.open_rollout()
        try:
            output = super()._generate(prompts)
        except BaseException:
            self.tlt.close_rollout()  # a failed rollout's turns never reach the next one's history or drafter
            raise
        self._end_rollout()  # where `_generate_single_turn` or `_tool_call_loop` did not end it already
        return output

    @_parent_without_stack
    def _tool_call_loop(self, *args, **kwargs):
        output = super()._tool_call_loop(*args, **kwargs)
        self._end_rollout()  # the rollout's last turn is done: before `_generate` waits for the other ranks
        return output

    @_parent_without_stack
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        own_rollout = self.tlt.open_rollout()  # called outside `_generate`: a rollout of its own
        if self.use_vllm and images is None and not multimodal_fields:
            output = self._generate_with_vllm(prompt_ids, num_generations, has_tool_images)
        else:
            output = self._generate_with_engine(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        # Without tools or a rollout_func, `_generate` makes this one call: the rollout ends here, before `_generate`
        # gathers from the other ranks (the time spot training uses is this rank's wait for them).
        if own_rollout or (not self.tools and self.rollout_func is None):
            self._end_rollout()
        return output

    def _generate_with_engine(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images):
        """One turn through trl-tlt's engine, or GRPOTrainer's own generation where the engine would not reproduce it."""
        stack = self.tlt
        policy = self.accelerator.unwrap_model(self.model)
        reason = settings.stock_generation_reason(images, multimodal_fields, stack.fallback_reason, policy)
        if reason is None:
            training = self.model.training  # read before the context puts the policy in eval mode
            sharded = policy_is_sharded(self.model_wrapped)  # before the context, which may gather it
            with profiling_context(self, "tlt.generate"), self._unwrapped_for_generation() as unwrapped_model:
                if not stack.engine_checked:  # once, on the real policy (gathered, in eval mode)
                    stack.engine_checked = True
                    stack.fallback_reason = ragged_cache_mismatch(unwrapped_model, self._tokenizer.pad_token_id)
                reason = stack.fallback_reason
                if reason is None:
                    params = settings.sampling_params(unwrapped_model, self.generation_config)
                    pad, width = (
                        self._tokenizer.pad_token_id,
                        settings.padded_width(prompt_ids, self.pad_to_multiple_of),
                    )
                    record = not self._drafter_trains_on_step()  # else the training step records the states
                    out = stack.generate(
                        unwrapped_model, prompt_ids, params, pad, width, training, self.state.global_step, sharded,
                        record,
                    )  # fmt: skip
            if reason is None:
                self._log(rollout_metrics(out.stats, stack.history, stack.last_speculation))
                # Like the parent's transformers path, no sampling logprobs: the trainer's own forward provides them.
                return out.completion_ids, None
            stack.refuse_spot_training_without_engine()
        self._note_stock_generation(reason)
        return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)

    def _generate_with_vllm(self, prompt_ids, num_generations, has_tool_images):
        """The parent's vLLM turn (policy synced, then generated), recorded for the end of the rollout."""
        colocate = self.args.vllm_mode == "colocate"
        start = time.perf_counter()
        completion_ids, logprobs = super()._generate_single_turn(
            prompt_ids, None, None, num_generations, has_tool_images
        )
        # colocate: the generate call alone, as on the engine path; server: the whole request
        seconds = self.vllm_generation.last_generate_seconds if colocate else time.perf_counter() - start
        self.tlt.last_vllm_stats = stats = self.vllm_generation.spec_decode_stats()
        self.tlt.record(RolloutTurn(prompt_ids, [list(ids) for ids in completion_ids], seconds, stats))
        faults = (self.tlt.vllm_spec_faults, self.tlt.drafter_repushes)
        speculating = colocate and self.vllm_generation.speculative_config is not None
        metrics = vllm_rollout_metrics(seconds, sum(map(len, completion_ids)), stats, faults if speculating else None)
        self._log({**metrics, **self.vllm_generation.push_metrics(), **self.tlt.pop_waiting_metrics()})
        return completion_ids, logprobs

    def _end_rollout(self) -> None:
        """Once per rollout, on every rank (see `_generate`), training only: its turns into the prompt history, the
        drafter trained (spot training: first, while the other ranks may still generate) and pushed into vLLM, then
        vLLM's drafter watched (a sum over ranks, which ends the ranks' idle time: after spot training)."""
        stack, turns = self.tlt, self.tlt.close_rollout()
        if turns is None:
            return
        # Whether the check of vLLM's samples runs: vLLM set to speculate (colocate with a drafter, not turned off; a
        # server's speculation is not reported), whatever the turns recorded (a rollout_func's own calls are not).
        stack.rollout_speculated |= self.use_vllm and (
            self.args.vllm_mode == "server" or self.vllm_generation.speculating
        )
        if not self.model.training:
            return
        stack.remember(turns)
        if self._drafter_trains_on_step():  # beside the training step, whose loss forwards record its data
            stack.rollout_costs = (sum(t.seconds for t in turns), stack.verify_costs(turns))
        elif stack.spot is not None and not (self.use_vllm and not self.vllm_generation.speculating):
            if stack.defer_spot_training:  # trained after the check's forward, on its hidden states
                stack.deferred_turns = [*(stack.deferred_turns or ()), *turns]
            else:
                self._spot_phase(turns)
        if stack.watchdog is not None:
            self._watch_vllm_drafter(turns)

    def _spot_phase(self, turns: list[RolloutTurn] | None = None) -> None:
        """Spot training on the rollout's turns (None: beside the training step, on what its loss forwards recorded),
        its metrics logged, the drafter pushed into vLLM."""
        with profiling_context(self, "tlt.spot_training"):
            spot = self._train_drafter(turns)
        if spot is not None:
            self._log(spot_metrics(spot, self.tlt.spot))
        # Beside the training step vLLM may be asleep (sleep mode): the drafter goes in after the next policy sync.
        if spot is not None and self.use_vllm and turns is not None:
            with profiling_context(self, "tlt.sync_drafter"):
                self.vllm_generation.sync_drafter()

    def _train_drafter(self, turns: list[RolloutTurn] | None):
        """Spot training on this rollout, or (`turns` None) on the training step's features. A sharded policy is never
        gathered at a rollout's end (a collective: this rank would wait for the slowest at it, its idle time lost):
        drafter training reads the whole LM head the rollout copied."""
        stack, version, sharded = self.tlt, self.state.global_step, policy_is_sharded(self.model_wrapped)
        if turns is None:
            return stack.train_drafter_on_step(self.accelerator.unwrap_model(self.model), version, sharded)
        if sharded:
            view = stack.sharded_policy_view(self.accelerator.unwrap_model(self.model).config)
            return stack.train_drafter(view, turns, version, lockstep=needs_lockstep(self.model_wrapped))
        with self._unwrapped_for_generation() as unwrapped_model:
            return stack.train_drafter(unwrapped_model, turns, version)

    def _drafter_trains_on_step(self) -> bool:
        """Whether spot training reads the training step's features (`spot_feature_source`), on every rank alike."""
        speculating = not self.use_vllm or self.vllm_generation.speculating
        return self.tlt.reads_step_features(self.use_vllm, speculating, self.model_wrapped)

    def _watch_vllm_drafter(self, turns: list[RolloutTurn]) -> None:
        """The drafter in vLLM, watched on the acceptance of every rank's turns (summed over ranks, so that every rank
        repushes, or turns speculation off, at the same rollout): a drafter that died silently in vLLM (acceptance
        collapsed against its recent level) is pushed again; if it stays collapsed, speculation is turned off."""
        local = DrafterWatchdog.verify_totals([t.spec_stats for t in turns if t.spec_stats is not None])
        totals = self.accelerator.reduce(torch.tensor(local, device=self.accelerator.device), "sum")
        steps, accepted = totals.tolist()
        if steps == 0 or not self.vllm_generation.speculating:
            return
        acceptance = 1.0 + accepted / steps
        verdict = self.tlt.watchdog.observe(acceptance)
        if verdict == "repush":
            logger.warning(self.tlt.watchdog.repush_message(acceptance))
            with profiling_context(self, "tlt.sync_drafter"):
                self.vllm_generation.sync_drafter()
            self.tlt.drafter_repushes += 1
        elif verdict == "off":
            self.vllm_generation.disable_speculation(
                f"vLLM's acceptance length stayed collapsed ({acceptance:.2f}) after a re-push"
            )

    @_parent_without_stack
    def _generate_and_score_completions(self, inputs):
        if not (self.use_vllm and self.args.drafter_type != "none"):
            return super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        logged = {key: list(values) for key, values in self._metrics[mode].items()}
        tokens_seen = self.state.num_input_tokens_seen
        stack = self.tlt
        # With `spot_feature_source="rollout"`, spot training on vLLM's rollouts waits for the check below, whose forward
        # over the batch records the hidden states it trains on (no forward of its own), and trains only on samples
        # that passed the check. Not where it trains in the ranks' idle time (several processes, no
        # `spot_steps_per_rollout`): that time is before it. Otherwise the training step records them.
        stack.defer_spot_training = not self._drafter_trains_on_step() and stack.spot_waits_for_check(
            self.model.training, self.vllm_generation.speculating
        )
        try:
            output = super()._generate_and_score_completions(inputs)
            turns = stack.deferred_turns
        finally:  # a failed batch's turns are never trained on, by this call or a later one
            stack.defer_spot_training, stack.deferred_turns = False, None
        sink = None
        if turns is not None and not policy_is_sharded(self.model_wrapped):  # sharded: no LM head copy to train with
            sink = stack.feature_sink(self.accelerator.unwrap_model(self.model), self.state.global_step)
        check = self._check_vllm_samples(output, sink)
        if turns is not None and not (check is not None and check.faulty):
            self._spot_phase(turns if sink is None else stack.with_features(turns, sink))
        if check is not None and check.faulty and self.args.vllm_mode == "server":
            raise RuntimeError(
                f"The vLLM server's samples failed the check of the policy's ({check.describe()}): they may not be "
                "the policy's, and a server's speculation cannot be turned off from here. Serve the policy without "
                "--speculative_config (or fix the server's drafter) and resume from the last checkpoint."
            )
        if check is not None and check.faulty:
            # Never train on samples that may not be the policy's: this batch is generated again, without speculation
            # (the first attempt's logged metrics are discarded with it).
            self.tlt.vllm_spec_faults += 1
            self.vllm_generation.disable_speculation(
                f"vLLM's speculative samples failed the check ({check.describe()}); the batch is generated again "
                "without it"
            )
            self._metrics[mode] = defaultdict(list, logged)
            self.state.num_input_tokens_seen = tokens_seen
            output = super()._generate_and_score_completions(inputs)
        elif check is not None:
            self._metrics[mode]["tlt/vllm_sample_z"].append(check.z)
        return output

    def _check_vllm_samples(self, output: dict, sink: SequenceFeatures | None = None) -> SampleMoments | None:
        """The check of trl_tlt/vllm/check.py over every rank's batch, where any rank's vLLM may have speculated in this
        rollout (None where none did: vLLM sampled without a drafter, as GRPOTrainer's vLLM does). Every rank runs it:
        a gather, then a forward over its batch (recording the hidden states drafter training reads into `sink`) and a
        sum over ranks."""
        return self.vllm_generation.check_samples(
            output, self.tlt.rollout_speculated, self._unwrapped_for_generation, self.args.per_device_train_batch_size,
            sink,
        )  # fmt: skip

    # --------------------------------------------------------------------------------------- training phase
    @_parent_without_stack
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
        """Every forward over completions (the loss, old and reference log-probs), its rows sorted by length and cut
        into sub-chunks that each run at their own longest completion instead of the generation batch's
        (`micro_batching`; trl_tlt/training/micro_batching.py)."""

        def forward(ids, mask, keep, chunk_size=None):
            return super(TLTGRPOTrainer, self)._get_per_token_logps_and_entropies(
                model, ids, mask, keep, chunk_size, compute_entropy, compute_aux_loss, **multimodal
            )

        lockstep = self.args.micro_batching != "padded" and needs_lockstep(self.model_wrapped)
        agree = functools.partial(agreed_count, device=input_ids.device) if lockstep else None
        images = any(value is not None for value in multimodal.values())  # TRL's layout (on every rank, if sharded)
        if self.args.micro_batching == "padded" or (agree(int(images), 1) > 0 if agree else images):
            return forward(input_ids, attention_mask, logits_to_keep, batch_size)
        # An aux loss is averaged per chunk: keep TRL's chunks (trim only); otherwise rows are independent.
        split = split_tokens_for(input_ids.device, self.args.micro_batching_split_tokens)
        return trimmed_logps_and_entropies(
            forward, input_ids, attention_mask, logits_to_keep, batch_size, not compute_aux_loss, split, agree
        )

    @_parent_without_stack
    def _compute_loss(self, model, inputs):
        """GRPOTrainer's loss; on the first pass over a generation batch, with the drafter's data recorded by its
        forwards where spot training reads the training step's (`trl_tlt/trainer/step_features.py`)."""
        first_pass = self._step // self.args.steps_per_generation % self.num_iterations == 0
        policy, recorder = self.accelerator.unwrap_model(self.model), None
        if self.model.training and first_pass and self._drafter_trains_on_step():
            recorder = self.tlt.step_recorder(policy, self.state.global_step, self._unwrapped_for_generation)
        with recorder.recording(policy, inputs) if recorder is not None else nullcontext():
            return super()._compute_loss(model, inputs)

    @_parent_without_stack
    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)  # counts `self._step`
        generation = self.args.steps_per_generation
        first_pass = (self._step - 1) // generation % self.num_iterations == 0
        if self._step % generation == 0 and first_pass and self._drafter_trains_on_step():
            self._spot_phase()  # the generation batch's last loss forward is done; before the optimizer step
        return loss

    @_parent_without_stack
    def _prepare_inputs(self, generation_batch):
        buffered = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        fresh = self.model.training and self._buffered_inputs is not buffered
        regroup = regroups_micro_batches(
            self.args, self.loss_type, self.top_entropy_quantile, self._entropy_bonus_enabled, self.aux_loss_enabled
        )
        if fresh and regroup and "pixel_values" not in inputs:
            accumulation = self.args.gradient_accumulation_steps
            if self._step % accumulation == 0:  # the buffer starts at an optimizer-step boundary
                # regrouped in place: the parent's buffer, its micro-batches sorted by length
                self._buffered_inputs[:] = group_by_length(self._buffered_inputs, accumulation)
                inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]
        return inputs

    # ---------------------------------------------------------------------------------- checkpoints, export
    @_parent_without_stack
    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        self.tlt.speculation_off = self.use_vllm and self.vllm_generation.speculation_turned_off
        self.tlt.save(folder, self.accelerator.process_index, self.args.should_save, self.accelerator.num_processes)

    @_parent_without_stack
    def _load_optimizer_and_scheduler(self, checkpoint):
        # The resume step every backend takes, once the policy is loaded and prepared (with DeepSpeed transformers
        # loads the policy through `deepspeed_load_checkpoint`, never `_load_from_checkpoint`).
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            policy = self.accelerator.unwrap_model(self.model)
            self.tlt.load(Path(checkpoint), self.accelerator.process_index, policy, self.accelerator.num_processes)
            if self.tlt.speculation_off and self.use_vllm:  # turned off before the checkpoint: off again
                self.vllm_generation.disable_speculation("It was turned off before the checkpoint")

    def join_drafter_writes(self) -> None:
        """Wait for the background drafter checkpoint write; raise its error, if it failed."""
        self.tlt.join_writes()

    def save_drafter(self, path: str | os.PathLike) -> None:
        """Save the drafter: EAGLE-3 in the layout vLLM and SGLang load, a small LM with `save_pretrained`."""
        model = self.tlt.trainable_drafter
        if self.accelerator.is_main_process or model is None:
            export.save_drafter(model, path, self.args.drafter_type)

    def push_drafter_to_hub(
        self, repo_id: str, private: bool | None = None, token: str | None = None,
        commit_message: str = "Upload TLT drafter",
    ):  # fmt: skip
        """Save the drafter with a model card and upload it to the Hub as `repo_id`. Returns the commit info."""
        if not self.accelerator.is_main_process:
            return None
        policy = self.accelerator.unwrap_model(self.model).config._name_or_path or "the policy"
        card = export.drafter_model_card(repo_id, policy, self.args.drafter_type, self.args.num_speculative_tokens)
        return export.push_to_hub(self.save_drafter, card, repo_id, private, token, commit_message)

    # ------------------------------------------------------------------------------------------------ helpers
    _unwrapped_for_generation = settings.unwrapped_for_generation

    def _note_stock_generation(self, reason: str) -> None:
        """Say once per reason that rollouts use GRPOTrainer's generation (correct, without TLT's speed-up)."""
        if reason not in self._tlt_notes:
            self._tlt_notes.add(reason)
            logger.warning(
                f"TLTGRPOTrainer generates with GRPOTrainer's own generation (no speculative decoding): {reason}."
            )

    def _log(self, metrics: dict[str, float]) -> None:
        mode = "train" if self.model.training else "eval"
        for key, value in metrics.items():
            self._metrics[mode][key].append(value)


# What `inspect.signature`, IDEs and argument checks read: exactly GRPOTrainer's constructor (`reward_funcs` optional
# in TRL 1.16, where an environment may own the reward).
TLTGRPOTrainer.__init__.__signature__ = inspect.signature(GRPOTrainer.__init__)
