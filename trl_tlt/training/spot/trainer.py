"""`SpotTrainer`: drafter optimizer steps in a rank's idle time (or within the time budget), the ranks' drafters merged."""

from __future__ import annotations

import random
import time

import torch
from transformers import PreTrainedModel
from transformers.utils import logging

from ...drafters.draft_vocab import DraftVocabulary, fitted_size
from ...drafters.eagle3 import Eagle3Model
from ..distillation import (
    DistillConfig,
    DrafterSample,
    PolicyView,
    eagle3_loss,
    lm_distill_loss,
    pack,
    recorded_features,
    sample_features,
)
from .buffer import DataBuffer, take_tokens
from .peers import Peers
from .precision import autocast, flushing_denormals
from .schedule import SpotBudget, SpotSchedule, acceptance_length, expected_speedup
from .stats import SpotStats


logger = logging.get_logger(__name__)

AUTOCAST_ROW_MULTIPLE = 64  # a drafter step's packed row, padded to a multiple of it under autocast
EVAL_STEPS = 4  # an evaluation reads up to this many steps' worth of tokens (256 tokens scattered it by about +-0.2)


class SpotTrainer:
    """Online drafter training (EAGLE-3 head or small LM) on a `DataBuffer` of the policy's rollouts.

    Args:
        drafter: The drafter's model, trained in place (the generation engine sees every update).
        buffer: The recent rollouts it trains on (`DataBuffer`).
        schedule: The learning rate (AdamW) over the drafter's steps (`SpotSchedule`).
        tokens_per_step: Packed tokens per drafter optimizer step (smaller = finer preemption).
        config: TTT / loss settings.
        group: Process group for the idle barrier and the merge (a dedicated gloo group), or None for one process.
            Its timeout bounds every wait for the other ranks: a rank that died or hangs becomes an error.
        seed: Seed of the stream that samples the buffer (one per rank).
        budget: One process: how much of the time budget each phase spends (`SpotBudget`).
        steps_per_phase: Exactly this many drafter steps per phase instead of the budget (one process) or the idle
            time (several), None: those decide.
        vocab: A new EAGLE-3 head's draft vocabulary, revised from the rollouts' token counts (None: kept as it is).
        fit_vocab: Size `vocab` to the tokens the policy uses at the first rollout.
        autocast_dtype: Run the drafter's training forward and backward under `torch.autocast` in this dtype
            (`torch.bfloat16`: matrix products on bf16 units; the loss's log-softmax, the weights, their gradients and
            the optimizer stay float32), None: float32 throughout. `evaluate` always runs in the weights' dtype.

    Example: `spot.observe_rollout(prompt_ids, completion_ids)`, then `spot.run_between_rollouts(policy, 4.0)`."""

    def __init__(
        self,
        drafter: Eagle3Model | PreTrainedModel,
        buffer: DataBuffer,
        schedule: SpotSchedule | None = None,
        tokens_per_step: int = 256,
        config: DistillConfig | None = None,
        group=None,
        seed: int = 0,
        budget: SpotBudget | None = None,
        steps_per_phase: int | None = None,
        vocab: DraftVocabulary | None = None,
        fit_vocab: bool = False,
        autocast_dtype: torch.dtype | None = None,
    ):
        self.drafter, self.buffer, self.group = drafter, buffer, group
        self.peers = Peers(group) if group is not None else None
        self.autocast_dtype = autocast_dtype
        self.schedule = schedule or SpotSchedule()
        self.budget = budget or SpotBudget()
        self.steps_per_phase = steps_per_phase
        self.vocab = vocab
        self.tokens_per_step = tokens_per_step
        self.config = config or DistillConfig()
        if vocab is not None and not isinstance(drafter, Eagle3Model):
            raise ValueError("Only an EAGLE-3 head has a draft vocabulary to revise (`vocab`).")
        self.fit_vocab = fit_vocab and vocab is not None
        self._new_optimizer()
        self.rng = random.Random(seed)
        self.total_steps = 0
        self.total_resets = 0
        self.rerun_samples = 0  # samples whose features needed a policy forward (none recorded by their rollout)
        self.dropped_samples = 0  # samples without features a sharded policy could not be run over (never trained on)
        self._phase_resets = 0
        self._step_seconds: float | None = None  # moving average of a drafter step's time
        self.agreement: list[float] = []  # the latest evaluation's top-1 agreement per draft position
        self._rollout_counts: torch.Tensor | None = None  # token counts of the rollouts since the last revision
        if group is not None:
            self.peers.broadcast_from_first(self.params)
        self._good = [p.detach().clone() for p in self.params]  # the last weights known to be finite

    @property
    def drafter_pays(self) -> bool:
        """False while the time budget leaves the drafter idle (one process: it does not pay): rollouts run without it."""
        return self.group is not None or self.steps_per_phase is not None or self.budget.share > 0

    def drafter_resized(self) -> None:
        """The drafter's parameters were replaced (a draft vocabulary of another size, on resume): a new optimizer for
        them (its state is loaded next), no fitting."""
        self._new_optimizer()
        self._good = [p.detach().clone() for p in self.params]
        self.fit_vocab = False
        if self.vocab is not None:
            self.vocab.draft_vocab_size = self.drafter.config.draft_vocab_size

    def _new_optimizer(self) -> None:
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("The drafter has no trainable parameters: nothing for spot training to train.")
        # The schedule gives the absolute rate: the optimizer's base rate is 1.
        # Not fused: the fused kernel leaves `_version` alone, and the lean drafting path caches weights by it (stale).
        self.optimizer = torch.optim.AdamW(self.params, lr=1.0, betas=(0.9, 0.95), weight_decay=0.0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.schedule.learning_rate_at)

    @property
    def is_eagle(self) -> bool:
        return isinstance(self.drafter, Eagle3Model)

    # ------------------------------------------------------------------------------------------ one step
    def _loss(self, policy: PolicyView, features, agreement: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
        head_weight = policy.head_weight
        if self.is_eagle:  # one packed row: the sample is already at most tokens_per_step long
            multiple = AUTOCAST_ROW_MULTIPLE if self.autocast_dtype is not None else 1  # few shapes for oneDNN's bf16
            row = pack(features, 1 << 62, pad_to_multiple_of=multiple)[0]
            return eagle3_loss(self.drafter, head_weight, row, self.config, agreement, loss=not agreement)
        return lm_distill_loss(self.drafter, head_weight, features, self.config.chunk_size)

    @property
    def wants_features(self) -> bool:
        """Whether the next phase trains on the coming rollout (one process: not a phase the budget skips)."""
        return self.group is not None or self.steps_per_phase is not None or self.budget.skip == 0

    def feature_layers(self, policy: PreTrainedModel | PolicyView) -> list[int]:
        """The policy's layers a rollout records for this drafter (`SpeculativeEngine.generate(record_layers=)`): an
        EAGLE-3 head's auxiliary layers, then the last (the policy's distribution, through its LM head)."""
        aux = list(self.drafter.aux_layer_ids) if self.is_eagle else []
        return [*aux, policy.config.get_text_config().num_hidden_layers]

    def _features(self, policy: PolicyView, samples: list[DrafterSample]):
        """The policy's view of `samples`: what their rollout recorded, or (samples without, e.g. vLLM's rollouts) a
        forward of the policy over them, counted in `rerun_samples`."""
        if policy.model is None:  # `_drop_featureless` left only samples with features
            return [recorded_features(s, self.is_eagle, policy.head_weight.device) for s in samples]
        self.rerun_samples += sum(s.features is None for s in samples)
        return sample_features(policy.model, self.drafter, samples, batch_size=len(samples))

    def _drop_featureless(self, policy: PolicyView) -> None:
        """A policy that cannot be run here (sharded across processes: its forward is a collective the other ranks
        would not join) gives no features to samples whose rollout recorded none: they leave the buffer, counted in
        `dropped_samples`."""
        if policy.model is None:
            self.dropped_samples += self.buffer.drop_featureless()

    def step(self, policy: PreTrainedModel | PolicyView, preempt=None) -> float | None:
        """One drafter optimizer step on a sample of the buffer; returns its loss, or None if there was nothing to
        train on or `preempt()` became true at a phase boundary (after the policy forward, after the drafter's
        forward): the step is then dropped whole, the drafter and optimizer untouched."""
        preempt = preempt or (lambda: False)
        policy = PolicyView.of(policy)
        self._drop_featureless(policy)
        samples = self.buffer.sample(self.tokens_per_step, self.rng)
        features = self._features(policy, samples) if samples else []
        if not features or preempt():
            return None
        self.drafter.train()
        with flushing_denormals(self.drafter.device):
            try:
                with torch.enable_grad(), autocast(self.drafter.device, self.autocast_dtype):
                    loss, _ = self._loss(policy, features)
                    if preempt():
                        return None
                    self.optimizer.zero_grad(set_to_none=True)
                    loss.backward()
            finally:
                self.drafter.eval()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            if not (torch.isfinite(loss) and torch.isfinite(grad_norm)):  # a fault: the step is dropped
                self.optimizer.zero_grad(set_to_none=True)
                self._count_reset()
                return None
            self.optimizer.step()
        self.scheduler.step()
        self.total_steps += 1
        # A finite loss and gradient make a finite update: `_keep_good` checks the weights once a phase, at its end.
        return float(loss.detach())

    @torch.no_grad()
    def _keep_good(self) -> bool:
        """At a phase's end: the weights checked (rolled back if not finite, `check_weights`), then kept as the last
        good ones. Returns whether they were finite."""
        if not self.check_weights():
            return False
        for good, p in zip(self._good, self.params, strict=True):
            good.copy_(p)
        return True

    # ---------------------------------------------------------------------------------------- faults
    def _count_reset(self) -> None:
        self.total_resets += 1
        self._phase_resets += 1

    @torch.no_grad()
    def check_weights(self) -> bool:
        """True if every trainable weight is finite; else restore the last good weights, clear the optimizer's
        moments (they may hold the fault) and count a reset."""
        if all(bool(torch.isfinite(p).all()) for p in self.params):
            return True
        for good, p in zip(self._good, self.params, strict=True):
            p.copy_(good)
        self.optimizer.state.clear()
        self._count_reset()
        return False

    @torch.no_grad()
    def evaluate(self, policy: PreTrainedModel | PolicyView, preempt=None) -> float | None:
        """Estimated acceptance length on the latest rollout's sequences the drafter never trained on (held out, then
        `DataBuffer.unseen`), `EVAL_STEPS` steps' worth of tokens at most: 1 + sum_j prod_{i<=j} a_i, a_i
        (`self.agreement`) the drafter's top-1 agreement with the policy at draft position i (teacher forced). None
        if there is nothing to read or `preempt()` became true after the policy forward."""
        policy = PolicyView.of(policy)
        self._drop_featureless(policy)
        samples = take_tokens(self.buffer.held_out + self.buffer.unseen, EVAL_STEPS * self.tokens_per_step)
        features = self._features(policy, samples) if samples else []
        if not features or (preempt is not None and preempt()):
            return None
        _, metrics = self._loss(policy, features, agreement=True)
        self.agreement = [metrics.get(f"acc_{j}", 0.0) for j in range(self.config.ttt_length if self.is_eagle else 1)]
        return acceptance_length(self.agreement)

    # ------------------------------------------------------------------------------------------ phases
    def observe_rollout(
        self, prompts: list[list[int]], completions: list[list[int]], features: list | None = None, version=None
    ) -> None:
        """This rank's latest rollout: into the buffer (with the policy's `features` of each row, computed at policy
        `version`, where its rollout recorded them: `DataBuffer.add`), its tokens into the draft vocabulary's counts.
        A rollout whose phase the time budget skips is only counted (no step will read it; by then it is stale)."""
        if self.wants_features:
            self.buffer.add(prompts, completions, features, version)
        else:
            self.buffer.drop_stale(version)
        if self.vocab is not None:
            counts = self.vocab.token_counts(completions)
            self._rollout_counts = counts if self._rollout_counts is None else self._rollout_counts + counts

    @torch.no_grad()
    def revise_vocab(self, policy: PolicyView, stats: SpotStats, wait: bool = False) -> None:
        """Count the rollouts seen since the last call (summed over ranks) and re-choose the draft vocabulary if it
        covers too little of them: kept rows keep their weights and optimizer moments, new rows start afresh. `wait`
        (agreed by every rank): a rank has no LM head to size new rows from; the counts wait for the next phase."""
        if self.vocab is None:
            return
        local, self._rollout_counts = self._rollout_counts, None
        counts = local
        if self.group is not None:  # every rank sums, with zeros where it saw no rollout: the same collectives
            counts = torch.zeros(self.vocab.vocab_size, dtype=torch.float64) if local is None else local.clone()
            self.peers.all_reduce(counts, "the sum of the ranks' token counts")
        if counts is None or not counts.any():  # nothing seen (on any rank): nothing to fit or revise
            return
        if wait:
            self._rollout_counts = local
            return
        self.vocab.observe(counts)
        if self.fit_vocab:  # once, at the first rollout: size the vocabulary to what the policy uses
            # Every rank decides alike (the counts are summed over ranks; no per-rank count such as the steps this rank
            # took while waiting): the next merge all-reduces heads of the size chosen here.
            self.fit_vocab = False
            self.vocab.draft_vocab_size = fitted_size(self.vocab.counts, self.vocab.draft_vocab_size)
        new_ids = self.vocab.revised(self.drafter.draft_ids)
        if new_ids is not None and new_ids.numel() != self.drafter.config.draft_vocab_size:
            self.drafter.resize_draft_vocab(new_ids, policy.head_weight)
            self._new_optimizer()
            self._good = [p.detach().clone() for p in self.params]
            stats.draft_vocab_revised = True
            logger.info(
                f"Draft vocabulary fitted to the policy's tokens: {new_ids.numel()} of {self.vocab.vocab_size}."
            )
        elif new_ids is not None:
            self._remap_vocab(new_ids, policy)
            stats.draft_vocab_revised = True
        stats.draft_vocab_coverage = self.vocab.coverage(self.drafter.draft_ids)

    @torch.no_grad()
    def _remap_vocab(self, new_ids: torch.Tensor, policy: PolicyView) -> None:
        weight = self.drafter.lm_head.weight
        source = self.drafter.remap_vocab(new_ids, policy.head_weight).to(weight.device)
        kept = source >= 0
        for moment in self.optimizer.state.get(weight, {}).values():
            if torch.is_tensor(moment) and moment.shape == weight.shape:
                fresh = torch.zeros_like(moment)
                fresh[kept] = moment[source[kept]]
                moment.copy_(fresh)
        for good, p in zip(self._good, self.params, strict=True):
            good.copy_(p)

    def _may_step(self, steps_taken: int) -> bool:
        """One process: exactly `steps_per_phase` steps, or steps while the credit covers a step's expected time."""
        if self.steps_per_phase is not None:
            return steps_taken < self.steps_per_phase
        return self.budget.credit > 0 and self.budget.credit >= (self._step_seconds or 0.0)

    def run_between_rollouts(
        self, policy: PreTrainedModel | PolicyView | None, rollout_seconds: float = 0.0,
        step_costs: dict | None = None, refuse: bool = False,
    ) -> SpotStats:  # fmt: skip
        """Drafter steps within the budget `SpotBudget` gives this phase (`time_budget x rollout_seconds x share`), or
        exactly `steps_per_phase` of them; timed (this time is added to the RL step). `step_costs`: the rollout's
        measured cost of a verify step drafting k tokens over a plain step's (`BanditSpeculation.step_costs`), by which
        the budget judges what the drafter pays. `policy` None: no LM head to train with here (a sharded policy whose
        rollout copied none): the phase trains nothing, and still counts a phase the budget skips.

        One process; or several with no idle time to train in (a sharded policy's lockstep, the phase beside the
        training step): every rank first agrees on `refuse` and on whether any rank lacks an LM head (one all-reduce,
        as `run_while_idle`'s barrier), then steps within its own budget; the ranks' drafters are then merged (`_merge`,
        which every rank reaches once per phase, whatever its budget decided). A refusal on any rank ends the phase
        on every rank with `stats.refused`, each drafter back to the last merged one."""
        view = None if policy is None else PolicyView.of(policy)
        stats = SpotStats()
        start = time.perf_counter()
        self._phase_resets = 0
        self.check_weights()
        without_head = view is None
        if self.group is not None:
            flags = torch.tensor([float(refuse), float(view is None)], dtype=torch.float64)
            self.peers.all_reduce(flags, "the agreement before a phase (a refusal, a rank without an LM head)")
            refused, without = flags.tolist()
            if refused:
                self._back_to_good()
                stats.refused = True
                return stats
            without_head = without > 0
        self.revise_vocab(view, stats, wait=without_head)
        if self.steps_per_phase is None and self.budget.skips_phase():
            stats.skipped = True
            return self.end_phase(stats)
        if view is not None:
            self._budgeted_steps(view, stats, rollout_seconds, step_costs)
        stats.seconds_used = time.perf_counter() - start
        return self.end_phase(stats)

    def _budgeted_steps(self, policy: PolicyView, stats: SpotStats, rollout_seconds: float, step_costs) -> None:
        """The phase's evaluation, then its drafter steps, within the budget (or exactly `steps_per_phase`)."""
        evaluation_start = time.perf_counter()
        stats.eval_acceptance_length = self.evaluate(policy)
        if stats.eval_acceptance_length is not None:
            stats.expected_speedup = expected_speedup(self.agreement, step_costs or {})
        self.budget.observe(stats.eval_acceptance_length, stats.expected_speedup)
        if self.steps_per_phase is None:
            stats.budget_seconds = self.budget.seconds(rollout_seconds)
            self.budget.spend(time.perf_counter() - evaluation_start)
        while self._may_step(stats.steps):
            step_start = time.perf_counter()
            loss = self.step(policy)
            seconds = time.perf_counter() - step_start
            self.budget.spend(seconds)
            self._step_seconds = seconds if self._step_seconds is None else 0.5 * (self._step_seconds + seconds)
            if loss is None:
                break
            stats.steps += 1
            stats.losses.append(loss)

    def end_phase(self, stats: SpotStats) -> SpotStats:
        """A phase's end (any but `run_while_idle`'s): the weights checked and kept; several processes: merged."""
        finite = self._keep_good()
        stats.resets = self._phase_resets
        if self.group is None:
            stats.summarize(stats._local_totals())
            return stats
        if not finite:  # never average a non-finite drafter into the others
            stats.steps = 0
        self._merge(stats)
        return stats

    @torch.no_grad()
    def _back_to_good(self) -> None:
        """Every drafter back to the weights the ranks last agreed on."""
        for good, p in zip(self._good, self.params, strict=True):
            p.copy_(good)

    def run_while_idle(
        self, policy: PreTrainedModel | PolicyView | None, refuse: bool = False
    ) -> SpotStats:  # fmt: skip
        """Several processes: train until every rank's rollout is done, then merge the ranks' drafters. With
        `steps_per_phase`, every rank takes exactly that many steps first, whatever the timing (runs repeat exactly).

        The idle barrier is a sum over ranks that carries what they must agree on before the next collective: `refuse`
        (this rank could not train on this rollout: it went through GRPOTrainer's generation) ends the phase on every
        rank with `stats.refused`, each drafter back to the last merged one, for the caller to stop spot training
        everywhere alike; `policy` None (this rank has no whole LM head: a sharded policy none of its rollouts copied
        yet) leaves the draft vocabulary as it is this phase, on every rank.
        """
        stats = SpotStats()
        start = time.perf_counter()
        self._phase_resets = 0
        self.check_weights()
        view = None if policy is None or refuse else PolicyView.of(policy)
        if self.steps_per_phase is not None and view is not None and self.buffer.samples:
            stats.eval_acceptance_length = self.evaluate(view)
            while stats.steps < self.steps_per_phase and (loss := self.step(view)) is not None:
                stats.steps += 1
                stats.losses.append(loss)
            stats.seconds_used = time.perf_counter() - start
        flags = torch.tensor([float(refuse), float(view is None)], dtype=torch.float64)
        barrier = self.peers.all_reduce(flags, "the idle barrier", async_op=True)
        done = barrier.is_completed
        if self.steps_per_phase is None and view is not None and not done() and self.buffer.samples:
            self._train_until(view, done, stats, start)
        with self.peers.answering("the idle barrier (waiting for the other ranks' rollouts)"):
            barrier.wait()
        stats.idle_seconds = time.perf_counter() - start
        refused, without_head = flags.tolist()
        if refused:  # no merge: every rank back to the drafter they last agreed on
            self._back_to_good()
            stats.refused = True
            return stats
        if not self.check_weights():  # never average a non-finite drafter into the others
            stats.steps = 0
        stats.resets = self._phase_resets
        self._merge(stats)
        self.revise_vocab(view, stats, wait=without_head > 0)
        return stats

    def run_while_waiting(self, policy: PreTrainedModel | PolicyView, done) -> SpotStats:
        """Drafter steps until `done()` (the trainer waits for a vLLM server's completions: idle time, outside the
        time budget); the caller ends the phase (`end_phase`, the merge) once every rank has its completions."""
        stats, start = SpotStats(), time.perf_counter()
        self._phase_resets = 0
        self.check_weights()
        if not done() and self.buffer.samples:
            self._train_until(PolicyView.of(policy), done, stats, start)
        stats.idle_seconds = time.perf_counter() - start
        return stats

    def _train_until(self, view: PolicyView, done, stats: SpotStats, start: float) -> None:
        """The held-out evaluation, then drafter steps until `done()` (a step in progress then is dropped whole)."""
        stats.eval_acceptance_length = self.evaluate(view, preempt=done)
        while not done() and self.buffer.samples:
            loss = self.step(view, preempt=done)
            if loss is None:
                stats.preempted += 1
            else:
                stats.steps += 1
                stats.losses.append(loss)
        stats.seconds_used = time.perf_counter() - start

    @torch.no_grad()
    def _merge(self, stats: SpotStats) -> None:
        """Sum the ranks' statistics; if any rank trained, average the drafters weighted by the steps each took."""
        totals = torch.tensor(stats._local_totals(), dtype=torch.float64)
        self.peers.all_reduce(totals, "the merge of the ranks' drafters")
        stats.summarize(totals.tolist())
        if stats.summary["steps"] == 0:
            return
        self.peers.average(self.params, stats.steps / stats.summary["steps"])
        for good, p in zip(self._good, self.params, strict=True):
            good.copy_(p)

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        state = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "total_steps": self.total_steps,
            "total_resets": self.total_resets,
            "buffer": self.buffer.state_dict(),
            "budget": self.budget.state_dict(),
            "rng": self.rng.getstate(),
            "step_seconds": self._step_seconds,
        }
        if self.vocab is not None:
            state["vocab"] = self.vocab.state_dict()
        return state

    def load_state_dict(self, state: dict, stream: bool = True) -> None:
        """`stream=False`: keep this rank's sampling stream over the buffer (another rank's state)."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.total_steps = int(state["total_steps"])
        self.total_resets = int(state.get("total_resets", 0))
        self.buffer.load_state_dict(state["buffer"])
        if "budget" in state:  # checkpoints written before the time budget have none
            self.budget.load_state_dict(state["budget"])
        if "rng" in state:  # nor, before the per-rank state, the sampling stream
            if stream:
                self.rng.setstate(state["rng"])
            self._step_seconds = state["step_seconds"]
        if self.vocab is not None and "vocab" in state:
            self.vocab.load_state_dict(state["vocab"])
        self.fit_vocab = False  # a resumed head was fitted (or chosen) before it was saved
        with torch.no_grad():  # the resumed weights are the good ones
            for good, p in zip(self._good, self.params, strict=True):
                good.copy_(p)
