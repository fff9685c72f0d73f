"""The vLLM path of `TLTGRPOTrainer`: vLLM built with the drafter, the samples checked, the drafter watched."""

from __future__ import annotations

import statistics
import tempfile
import time
from collections import defaultdict

import torch
from transformers.utils import logging
from trl.extras.profiling import profiling_context

from ..config import as_tlt_config
from ..drafters.eagle3 import Eagle3Model
from ..sampling import SamplingParams
from ..vllm_check import SampleMoments, sample_moments, seen_before
from ..vllm_generation import TLTVLLMGeneration, speculative_config
from .rollout import RolloutTurn


logger = logging.get_logger(__name__)


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
        """The parent's vLLM turn (policy synced, then generated), recorded for the end of the rollout (spot training,
        the drafter's watch and push: `_end_rollout`)."""
        start = time.perf_counter()
        completion_ids, logprobs = super()._generate_single_turn(
            prompt_ids, None, None, num_generations, has_tool_images
        )
        seconds = time.perf_counter() - start
        if self.args.vllm_mode == "colocate":  # the generate call alone, as on the engine path
            seconds = self.vllm_generation.last_generate_seconds
        stats = self.vllm_generation.spec_decode_stats() if self.args.vllm_mode == "colocate" else None
        self._tlt_turns.append(RolloutTurn(prompt_ids, [list(ids) for ids in completion_ids], seconds, stats))
        self._log_vllm_rollout_stats(seconds, completion_ids, stats)
        return completion_ids, logprobs

    def _log_vllm_rollout_stats(self, seconds: float, completion_ids, stats: dict[str, float] | None) -> None:
        mode = "train" if self.model.training else "eval"
        tokens = sum(len(ids) for ids in completion_ids)
        metrics = {"tlt/rollout_seconds": seconds, "tlt/rollout_tokens_per_second": tokens / max(seconds, 1e-9)}
        self.tlt_last_vllm_stats = stats
        if stats is not None:
            metrics["tlt/mean_acceptance_length"] = stats["mean_acceptance_length"]
            metrics["tlt/draft_acceptance_rate"] = stats["draft_acceptance_rate"]
        if self.args.vllm_mode == "colocate" and self.vllm_generation.speculative_config is not None:
            metrics["tlt/vllm_spec_faults"] = self.tlt_vllm_spec_faults
            metrics["tlt/drafter_repushes"] = self.tlt_drafter_repushes
        for key, value in metrics.items():
            self._metrics[mode][key].append(value)

    def _end_vllm_rollout(self, turns: list[RolloutTurn]) -> None:
        """Once per rollout (`_end_rollout`): the drafter in vLLM watched on the acceptance of every rank's turns, so that
        every rank repushes, or turns speculation off, at the same rollout."""
        if self.args.vllm_mode != "colocate" or self.vllm_generation.speculative_config is None:
            return
        steps = sum(t.spec_stats["verify_steps"] for t in turns if t.spec_stats is not None)
        accepted = sum(
            t.spec_stats["verify_steps"] * (t.spec_stats["mean_acceptance_length"] - 1.0)
            for t in turns
            if t.spec_stats is not None
        )
        totals = self.accelerator.reduce(torch.tensor([steps, accepted], device=self.accelerator.device), "sum")
        steps, accepted = totals.tolist()
        if steps > 0:
            self._watch_drafter(1.0 + accepted / steps)

    def _watch_drafter(self, acceptance: float) -> None:
        """A drafter that died silently in vLLM (acceptance collapsed against its recent level) is pushed again; if
        it stays collapsed, speculation is turned off."""
        if not self.vllm_generation.speculating:
            return
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
        check = self._check_vllm_samples(output)
        if check is not None and check.faulty and self.args.vllm_mode == "server":
            raise RuntimeError(
                f"The vLLM server's samples failed the check of the policy's ({check.describe()}): they may not be "
                "the policy's, and a server's speculation cannot be turned off from here. Serve the policy without "
                "--speculative_config (or fix the server's drafter) and resume from the last checkpoint."
            )
        if check is not None and check.faulty:
            # Never train on samples that may not be the policy's: this batch is generated again, without speculation
            # (the first attempt's logged metrics are discarded with it).
            self.tlt_vllm_spec_faults += 1
            self._turn_speculation_off(
                f"vLLM's speculative samples failed the check ({check.describe()}); the batch is generated again "
                "without it"
            )
            self._metrics[mode] = defaultdict(list, logged)
            self.state.num_input_tokens_seen = tokens_seen
            output = super()._generate_and_score_completions(inputs)
        elif check is not None:
            self._metrics[mode]["tlt/vllm_sample_z"].append(check.z)
        if not self.vllm_importance_sampling_correction:  # the loss uses the trainer's logprobs: never train on vLLM's
            output.pop("sampling_per_token_logps", None)
        return output

    def _check_vllm_samples(self, output: dict) -> SampleMoments | None:
        """The check of trl_tlt/vllm_check.py over every rank's batch, where any rank's vLLM speculated in this rollout
        (None where none did: vLLM sampled without a drafter, as GRPOTrainer's vLLM does). Every rank runs it: a gather,
        then a forward over its batch and a sum over ranks."""
        device = self.accelerator.device
        speculated = torch.tensor([float(self._tlt_rollout_speculated)], device=device)
        if not bool(self.accelerator.gather(speculated).any()):
            return None
        local = self._sample_moments(output).as_tensor(device)
        return SampleMoments.from_tensor(self.accelerator.reduce(local, "sum").cpu())

    def _vllm_sampling_params(self) -> SamplingParams:
        """What vLLM samples with (TRL's `VLLMGeneration` settings, its `generation_kwargs` over them)."""
        vllm = self.vllm_generation
        settings = {
            "temperature": vllm.temperature, "top_p": vllm.top_p, "top_k": vllm.top_k, "min_p": vllm.min_p,
            "repetition_penalty": vllm.repetition_penalty,
        }  # fmt: skip
        settings |= {key: value for key, value in vllm.generation_kwargs.items() if key in settings}
        return SamplingParams(
            temperature=settings["temperature"],
            top_p=settings["top_p"],
            top_k=settings["top_k"] if settings["top_k"] and settings["top_k"] > 0 else None,
            min_p=settings["min_p"] or None,
            repetition_penalty=settings["repetition_penalty"],
        )

    @torch.no_grad()
    def _sample_moments(self, output: dict) -> SampleMoments:
        """This rank's sums for the check: the policy's processed distribution at every completion position (one
        forward over the batch, `per_device_train_batch_size` rows at a time), against the tokens vLLM sampled and the
        logprobs it reported."""
        params = self._vllm_sampling_params()
        prompt_ids, prompt_mask = output["prompt_ids"], output["prompt_mask"]
        completion_ids = output["completion_ids"]
        mask = output["completion_mask"].bool()
        if output.get("tool_mask") is not None:  # tool results are not the policy's samples
            mask &= output["tool_mask"].bool()
        reported = output.get("sampling_per_token_logps")
        length = completion_ids.size(1)
        moments = SampleMoments()
        step = self.args.per_device_train_batch_size
        for start in range(0, completion_ids.size(0), step):
            rows = slice(start, start + step)
            logits = self.model(
                input_ids=torch.cat([prompt_ids[rows], completion_ids[rows]], dim=1),
                attention_mask=torch.cat([prompt_mask[rows], output["completion_mask"][rows]], dim=1),
                logits_to_keep=length + 1,
            ).logits[:, :-1]
            seen = None
            if params.uses_repetition_penalty:
                seen = seen_before(prompt_ids[rows], prompt_mask[rows], completion_ids[rows], logits.size(-1))
            moments = moments + sample_moments(
                logits, completion_ids[rows], mask[rows], params, seen, None if reported is None else reported[rows]
            )
        return moments
