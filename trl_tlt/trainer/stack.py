"""`RolloutStack`: what `TLTGRPOTrainer` adds to GRPOTrainer's rollouts, in one object the trainer holds.

It owns the drafter, the hybrid drafter around it, the speculation policies, spot training, the prompt history (the
hybrid's), vLLM's drafter watchdog and the engine's sampling generator; it rolls out (one generation turn at a time),
trains the drafter once per rollout, and saves and resumes every rank's part of it. `build_rollout_stack`
(`build.py`) makes one from the config; the trainer's hooks (`trainer.py`) delegate to it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import PreTrainedModel
from transformers.utils import logging

from ..drafters import HybridDrafter, PromptHistory
from ..drafters.eagle3 import Eagle3Model
from ..engine import Drafter, FixedSpeculation, GenerationOutput, SamplingParams, SpeculationPolicy, SpeculativeEngine
from ..engine.features import SequenceFeatures
from ..engine.kv_cache import LayerTap
from ..engine.sharding import PolicyWeights, is_fsdp1, needs_lockstep, whole_policy_weights
from ..engine.speculation import BanditSpeculation, dominant_bucket
from ..engine.stats import GenerationStats
from ..training.distillation import PolicyView
from ..training.spot import SpotStats, SpotTrainer
from ..vllm.watchdog import DrafterWatchdog
from .drafter_writer import DrafterWriter
from .metrics import spot_metrics
from .rollout import RolloutTurn, drafter_model  # noqa: F401 (RolloutTurn: the stack's API)
from .step_features import StepFeatures


logger = logging.get_logger(__name__)

DRAFTER_DIR = "drafter"  # inside every checkpoint folder
# Each rank's rollout state, in every checkpoint: what a resumed run needs to sample and train as the uninterrupted one
# would (the sampling generator, the speculation policies' statistics, the hybrid drafter's running means and prompt
# history, spot training's optimizer, schedule, buffer and sampling stream).
ROLLOUT_STATE_NAME = "tlt_state/rank{rank}.pt"
HISTORY_NAME = "tlt_history/rank{rank}.json"  # read from checkpoints written before ROLLOUT_STATE_NAME
SPOT_STATE_NAME = "spot_state.pt"  # likewise, in drafter/ (the first rank's spot training state)


@dataclass
class RolloutStack:
    """What `TLTGRPOTrainer` adds to a rollout (see the module docstring). Built by `build_rollout_stack`.

    Attributes:
        drafter: The drafter of `drafter_type` (None: no drafter, or rollouts through GRPOTrainer's generation).
        hybrid: `hybrid_drafting`'s `HybridDrafter` around it (None: the drafter alone).
        speculation: The speculation policy of the engine's rollouts.
        lookup_speculation: The one of the rollouts in which the hybrid's lookups draft alone (the learned drafter
            left idle by spot training): its chain arms, with statistics of their own.
        spot: Spot training (None: off).
        generator: The engine's sampling stream (one per rank: `seed + process index`).
        watchdog: vLLM colocate with a drafter: the watch over vLLM's draft weights (None elsewhere).
        fallback_reason: Why rollouts go through GRPOTrainer's own generation (None: they do not).
        spot_requested: `spot_training=True` was asked for by name (an error where it cannot run; chosen by default,
            it is turned off instead).

    Example:
        >>> trainer.tlt.speculation.best_arms()   # what the bandit plays per batch-size bucket
        >>> trainer.tlt.last_stats.mean_acceptance_length
    """

    drafter: Drafter | None
    hybrid: HybridDrafter | None
    speculation: SpeculationPolicy
    lookup_speculation: SpeculationPolicy
    spot: SpotTrainer | None
    generator: torch.Generator
    watchdog: DrafterWatchdog | None = None
    fallback_reason: str | None = None
    spot_requested: bool = False
    engine_checked: bool = False  # the engine's cache was checked on the real policy (at the first rollout)
    spot_refused: bool = False  # several processes: a turn of this rollout went through GRPOTrainer's generation
    policy_weights: PolicyWeights | None = None  # a sharded policy's embedding and LM head, copied by the last turn
    turns: list[RolloutTurn] | None = None  # the current rollout's generation turns (None: none open)
    rollout_speculated: bool = False  # whether vLLM may have speculated in the latest rollout (the check's cue)
    defer_spot_training: bool = False  # vLLM: the rollout's drafter training waits for the check's forward
    deferred_turns: list[RolloutTurn] | None = None  # the turns it waits with
    last_stats: GenerationStats | None = None  # of the engine's latest turn
    last_speculation: SpeculationPolicy | None = None  # the policy that chose the latest turn's arms
    last_spot: SpotStats | None = None  # of the latest spot phase
    last_vllm_stats: dict[str, float] | None = None  # vLLM's acceptance over its latest turn
    vllm_spec_faults: int = 0  # rollouts regenerated without speculation (vLLM's samples failed the check)
    drafter_repushes: int = 0  # drafter pushes into vLLM the watchdog made
    feature_source: str = "rollout"  # `spot_feature_source`, as configured
    spot_stopped: bool = False  # spot training was turned off mid-run (kept across a resume)
    speculation_off: bool = False  # vLLM's speculation was turned off mid-run (kept across a resume)
    step_features: StepFeatures | None = None  # what the training step's loss forwards recorded for the drafter
    rollout_costs: tuple[float, dict[int, float]] = (0.0, {})  # the last rollout's seconds and verify costs
    trains_while_waiting: bool = False  # vLLM server mode: the step's phase runs while the next rollout waits ...
    waiting_policy: PolicyView | None = None  # ... reading this LM head (None: no phase pending)
    waiting_spot: SpotStats | None = None  # that phase's statistics, until logged
    writer: DrafterWriter = field(
        default_factory=DrafterWriter, repr=False
    )  # checkpoints' drafter/, in the background

    @property
    def history(self) -> PromptHistory | None:
        """The hybrid drafter's prompt history (None without `hybrid_drafting`, or with `history_max_tokens=0`)."""
        return self.hybrid.history if self.hybrid is not None else None

    @property
    def trainable_drafter(self) -> Eagle3Model | PreTrainedModel | None:
        """The drafter's own model (an `Eagle3Model` or a causal LM), or None for model-free drafters."""
        return drafter_model(self.drafter)

    def refuse_spot_training_without_engine(self) -> None:
        """A turn went through GRPOTrainer's generation: spot training asked for by name is an error; chosen by
        default, off. With several processes, decided at the rollout's end by every rank alike (`train_drafter`): one
        rank alone leaving spot training would leave the others waiting for it at the idle barrier."""
        if self.spot is None:
            return
        if self.spot.group is not None:
            self.spot_refused = True
            return
        self._stop_spot_training()

    def _stop_spot_training(self) -> None:
        self.spot_stopped = True
        if self.spot_requested:
            reason = self.fallback_reason or "a turn went through GRPOTrainer's generation"
            raise ValueError(
                "spot_training=True trains the drafter of trl-tlt's engine, which did not generate this rollout (on "
                f"this or another rank): {reason}. Set spot_training=False (such rollouts then use GRPOTrainer's "
                "generation)."
            )
        self.spot = None

    # ------------------------------------------------------------------------------------------ a rollout
    def open_rollout(self) -> bool:
        """Start a rollout if none is open; True if this call opened it."""
        if self.turns is not None:
            return False
        self.turns = []
        return True

    def close_rollout(self) -> list[RolloutTurn] | None:
        """The rollout's turns (None if none was open); `rollout_speculated` says whether vLLM may have speculated."""
        turns, self.turns = self.turns, None
        if turns is not None:
            self.rollout_speculated = any(turn.spec_stats is not None for turn in turns)
        return turns

    def rollout_drafter(self) -> tuple[Drafter | None, SpeculationPolicy]:
        """This rollout's drafter and speculation policy: a learned drafter that does not pay (spot training's
        verdict) is left idle, the hybrid's lookups still draft."""
        if self.spot is None or self.spot.drafter_pays:
            return self.hybrid or self.drafter, self.speculation
        if self.hybrid is not None:
            return self.hybrid.lookups_only(), self.lookup_speculation
        return None, FixedSpeculation(0)

    def generate(
        self, policy: PreTrainedModel, prompt_ids: list[list[int]], params: SamplingParams, pad_token_id: int,
        padded_width: int, training: bool = True, version: int | None = None, sharded: bool = False,
        record: bool = True,
    ) -> GenerationOutput:  # fmt: skip
        """One generation turn through trl-tlt's engine, recorded for the end of the rollout (in `training` and where
        `record`, with the hidden states spot training will read, which the engine keeps as it goes: drafter training
        never runs the policy again), within what the buffer's memory cap leaves once the features older than policy
        `version` are dropped. `sharded`: the trainer's policy is sharded across processes: what reads its embedding
        (an EAGLE-3 head drafting) and its LM head (spot training on the recorded states) gets a whole copy, taken
        during the turn (`policy_weights`), the previous turn's let go first."""
        drafter, speculation = self.rollout_drafter()
        self.last_speculation = speculation
        engine = SpeculativeEngine(policy, drafter=drafter, speculation=speculation, pad_token_id=pad_token_id)
        record = record and training and self.spot is not None and self.turns is not None and self.spot.wants_features
        copied = ()
        if sharded:
            self.release_policy_weights()  # never two copies alive at once
            # an EAGLE-3 head embeds with the policy's embedding, drafting or training on the states recorded here
            reads_embedding = isinstance(self.trainable_drafter, Eagle3Model) and (drafter is not None or record)
            copied = ("input_embedding",) * reads_embedding + ("output_embedding",) * record
        layers, budget = None, None
        if record:
            layers = self.spot.feature_layers(policy)
            self.spot.buffer.drop_stale(version)
            recorded = sum(f.nbytes for turn in self.turns for f in turn.features or () if f is not None)
            budget = max(self.spot.buffer.max_feature_bytes - self.spot.buffer.feature_bytes - recorded, 0)
        out = engine.generate(
            prompt_ids, params, generator=self.generator, padded_width=padded_width, record_layers=layers,
            record_max_bytes=budget, copy_policy_weights=copied,
        )  # fmt: skip
        if out.policy_weights is not None and out.policy_weights.output_embedding is not None:
            self.policy_weights = out.policy_weights  # for the spot phase at the rollout's end
        # Copies: GRPOTrainer's tool loop replaces the returned completions in place with completion + tool result +
        # the next turn, tokens the policy did not sample.
        prompts, completions = [list(p) for p in prompt_ids], [list(c) for c in out.completion_ids]
        sizes = out.stats.active_batch_sizes
        self.record(RolloutTurn(prompts, completions, out.stats.total_s, features=out.features, batch_sizes=sizes))
        self.last_stats = out.stats
        return out

    def record(self, turn: RolloutTurn) -> None:
        if self.turns is not None:
            self.turns.append(turn)

    def spot_waits_for_check(self, training: bool, vllm_speculating: bool) -> bool:
        """Whether this vLLM rollout's spot training waits for the check of its samples (`TLTGRPOTrainer`): in training,
        while vLLM speculates, where the phase does not train in the ranks' idle time (one process, or
        `spot_steps_per_rollout`)."""
        spot = self.spot
        return (
            training
            and vllm_speculating
            and spot is not None
            and (spot.group is None or spot.steps_per_phase is not None)
        )

    def feature_sink(self, policy: PreTrainedModel, version: int | None) -> SequenceFeatures | None:
        """Where a forward of the policy over this rollout's samples records the hidden states drafter training reads
        (vLLM's rollouts, which the engine did not record), within what the buffer's memory cap leaves once the
        features older than policy `version` are dropped; None where nothing would read them (a phase the time budget
        skips) or the cap leaves no room."""
        if not self.spot.wants_features:
            return None
        self.spot.buffer.drop_stale(version)
        budget = self.spot.buffer.max_feature_bytes - self.spot.buffer.feature_bytes
        return SequenceFeatures(self.spot.feature_layers(policy), max_bytes=budget) if budget > 0 else None

    @staticmethod
    def with_features(turns: list[RolloutTurn], sink: SequenceFeatures) -> list[RolloutTurn]:
        """The turns, each row with the states `sink` recorded of its prompt + completion (None where it has none)."""
        return [
            turn._replace(features=[sink.claim([*p, *c]) for p, c in zip(turn.prompt_ids, turn.completion_ids)])
            for turn in turns
        ]

    def remember(self, turns: list[RolloutTurn]) -> None:
        """The rollout's turns into the prompt history (the hybrid drafter's lookups), once per rollout, training only."""
        if self.history is not None:
            prompts = [p for turn in turns for p in turn.prompt_ids]
            self.history.add(prompts, [list(c) for turn in turns for c in turn.completion_ids])

    def release_policy_weights(self) -> None:
        """Let go of the whole copies of a sharded policy's embedding and LM head (they are taken again where read)."""
        self.policy_weights = None
        if isinstance(self.trainable_drafter, Eagle3Model):
            self.trainable_drafter.use_policy_weights(None)

    def sharded_policy_view(self, config) -> PolicyView | None:
        """What drafter training reads of a policy sharded across processes: the LM head the rollouts copied (never the
        policy, whose forward is a collective); None where none was copied yet (with one warning)."""
        if self.policy_weights is None:
            if not self.spot.wants_features:  # a phase the time budget skips: nothing was to be recorded
                return None
            logger.warning_once(
                "Spot training with a policy sharded across processes trains the drafter on the hidden states "
                "trl-tlt's engine records in a rollout; this rank's rollouts recorded none yet (vLLM or a "
                "rollout_func generated them): the drafter does not train on them."
            )
            return None
        if isinstance(self.trainable_drafter, Eagle3Model):  # its training embeds with the copy, never the shard
            self.trainable_drafter.use_policy_weights(self.policy_weights)
        return PolicyView(self.policy_weights.output_embedding, config)

    def verify_costs(self, turns: list[RolloutTurn]) -> dict[int, float]:
        """The measured cost of a decode step drafting k tokens (k the learned drafter drafts) over a plain step's
        (`BanditSpeculation.step_costs`), at the bucket most of the rollout's engine steps ran in: what the time budget
        weighs the drafter's agreement against. Empty where none was measured: a fixed k, modelled costs
        (`selector_deterministic`), a rollout without engine turns (vLLM's)."""
        speculation, sizes = self.speculation, [b for turn in turns for b in turn.batch_sizes or ()]
        if not isinstance(speculation, BanditSpeculation) or speculation.cost_model is not None or not sizes:
            return {}
        costs = speculation.step_costs(dominant_bucket(sizes))
        k_max = self.hybrid.learned_tokens if self.hybrid is not None else None  # lookups alone draft past it
        return {k: cost for k, cost in costs.items() if k_max is None or k <= k_max}

    def train_drafter(
        self, policy: PreTrainedModel | PolicyView | None, turns: list[RolloutTurn], version: int | None = None,
        lockstep: bool = False,
    ) -> SpotStats | None:  # fmt: skip
        """Spot training on the rollout's turns, once per rollout, training only, on every rank. `policy`: the policy
        unwrapped for generation, after `version` optimizer steps, or the view of a sharded one (its LM head copied by
        the rollout; never run), None where this rank has none yet. `lockstep`: the ranks generated in lockstep, so
        none is idle: each trains within the time budget, then the merge. Returns None if spot training stopped."""
        spot = self.spot
        prompts = [p for turn in turns for p in turn.prompt_ids]
        if prompts:  # a rollout with no turn of ours (a rollout_func's own generation) still joins the others
            completions = [list(c) for turn in turns for c in turn.completion_ids]
            features = [f for turn in turns for f in (turn.features or [None] * len(turn.prompt_ids))]
            spot.observe_rollout(prompts, completions, features, version)
            for turn in turns:  # the buffer holds them now, within its memory cap
                if turn.features:
                    turn.features.clear()
        else:  # nothing new: what the buffer holds of an older policy goes all the same
            spot.buffer.drop_stale(version)
        refused, self.spot_refused = self.spot_refused, False
        if spot.group is None or lockstep:
            # one process (or no idle time): within the time budget, which the rollout's seconds set; a rank without
            # an LM head (a sharded policy none of whose rollouts copied one) trains nothing, and joins the merge
            seconds, costs = sum(t.seconds for t in turns), self.verify_costs(turns)
            self.last_spot = spot.run_between_rollouts(policy, seconds, costs, refuse=refused)
        else:  # several: while the other ranks still generate, then the merge
            self.last_spot = spot.run_while_idle(policy, refuse=refused)
        if self.last_spot.refused:  # every rank learned it at the idle barrier: every rank stops alike
            self._stop_spot_training()
            return None
        return self.last_spot

    # ------------------------------------------------------------------------ the training step's features
    def step_recorder(self, policy: PreTrainedModel, version: int, generation_context) -> StepFeatures | None:
        """Where the loss forwards of the current generation batch record the drafter's data (`StepFeatures`), made at
        its first micro-batch, within what the buffer's memory cap leaves once the features older than `version` are
        dropped; None where spot training reads none now (off, or a phase the time budget skips).

        The layer tap's one-time check (two short forwards) runs first, in `generation_context` (GRPOTrainer's, which
        gathers a ZeRO-3 policy), as generation's forwards do: inside the loss computation, over a partitioned ZeRO-3
        policy, those forwards broke the first backward on DeepSpeed's CPU accelerator."""
        if self.spot is None or not self.spot.wants_features:
            return None
        if self.step_features is None:
            self.spot.buffer.drop_stale(version)
            budget = self.spot.buffer.max_feature_bytes - self.spot.buffer.feature_bytes
            layers = self.spot.feature_layers(policy)
            if not LayerTap.checked(policy):
                with generation_context():
                    LayerTap(policy, layers)
            self.step_features = StepFeatures(layers, max(budget, 0), version)
        return self.step_features

    def reads_step_features(self, use_vllm: bool, vllm_speculating: bool, model: torch.nn.Module) -> bool:
        """Whether spot training reads the training step's features (`spot_feature_source`; "auto": where the engine
        records nothing, vLLM, or lockstep leaves no idle time, but not under FSDP1, whose flat parameters the phase
        cannot gather whole: the rollout's there, within the time budget), alike on every rank."""
        if self.spot is None or not vllm_speculating:
            return False
        if self.feature_source == "auto":  # `model`: the trainer's, wrapped for its launch
            lockstep = needs_lockstep(model)
            return (use_vllm or lockstep) and not (lockstep and is_fsdp1(model))
        return self.feature_source == "training_step"

    def train_drafter_on_step(self, policy: PreTrainedModel, version: int, sharded: bool) -> SpotStats | None:
        """Spot training on what the generation batch's loss forwards recorded, once per generation batch, on every
        rank alike (a phase the budget skips included: it counts the skip, and with several processes every rank
        reaches the merge): within the time budget the last rollout's seconds set (`rollout_costs`), then the ranks'
        drafters merged. Reads the policy's LM head, never runs the policy (rows without states are dropped, never
        rerun); a `sharded` policy's embedding and LM head are gathered whole for it (a collective every rank joins
        here), then let go. With a vLLM server the phase waits for the next rollout (`train_while_waiting`; None)."""
        recorded, self.step_features = self.step_features, None
        self.spot_refused = False  # a turn through GRPOTrainer's generation: its training step records all the same
        if recorded is not None:
            self.spot.observe_rollout(recorded.prompts, recorded.completions, recorded.features, recorded.version)
        else:
            self.spot.buffer.drop_stale(version)
        head_weight = policy.get_output_embeddings().weight
        # deferred to the next rollout's wait, unless the last deferral found none (a `rollout_func`'s own requests)
        deferred, self.waiting_policy = self.waiting_policy, None
        if self.trains_while_waiting and deferred is None and not sharded and self.spot.steps_per_phase is None:
            self.waiting_policy = PolicyView(head_weight, policy.config)  # the head updates in place: read then
            return None
        if sharded:
            eagle = isinstance(self.trainable_drafter, Eagle3Model)  # it embeds with the policy's embedding
            weights = whole_policy_weights(policy, ("input_embedding",) * eagle + ("output_embedding",))
            if eagle:
                self.trainable_drafter.use_policy_weights(weights)
            head_weight = weights.output_embedding
        seconds, costs = self.rollout_costs
        try:
            self.last_spot = self.spot.run_between_rollouts(PolicyView(head_weight, policy.config), seconds, costs)
        finally:
            if sharded:
                self.release_policy_weights()
        return self.last_spot

    def train_while_waiting(self, done):
        """vLLM server mode, every rank alike: the phase the last training step left, while the trainer waits for the
        server's completions (`done()`: they are back). Returns what ends it once every rank has them (the merge; its
        statistics wait in `waiting_spot` for the rollout's metrics), None with nothing pending (the first rollout)."""
        policy, self.waiting_policy = self.waiting_policy, None
        if policy is None or self.spot is None:
            return None
        stats = self.spot.run_while_waiting(policy, done)

        def end_phase():
            self.last_spot = self.waiting_spot = self.spot.end_phase(stats)
            self.spot.revise_vocab(policy, stats)

        return end_phase

    def pop_waiting_metrics(self) -> dict[str, float]:
        stats, self.waiting_spot = self.waiting_spot, None  # the phase run while the last rollout waited, if any
        return {} if stats is None else spot_metrics(stats, self.spot, in_idle_time=True)

    # --------------------------------------------------------------------------------- save and resume
    def state_dict(self) -> dict:
        """This rank's rollout state (`ROLLOUT_STATE_NAME`)."""
        state = {"generator": self.generator.get_state(), "speculation": self.speculation.state_dict()}
        if self.lookup_speculation is not self.speculation:
            state["lookup_speculation"] = self.lookup_speculation.state_dict()
        if self.hybrid is not None:
            state["hybrid"] = self.hybrid.state_dict()
        if self.history is not None:
            state["history"] = self.history.state_dict()
        if self.spot is not None:
            state["spot"] = self.spot.state_dict()
        state["spot_stopped"], state["speculation_off"] = self.spot_stopped, self.speculation_off
        return state

    def load_state_dict(self, state: dict, streams: bool = True) -> None:
        """`streams=False`: keep this rank's own random streams (its sampling generator, its draws from the drafter's
        buffer) as they are. What was turned off before the checkpoint (spot training, vLLM's speculation: the trainer
        turns it off again) stays off."""
        self.speculation_off |= bool(state.get("speculation_off", False))
        if state.get("spot_stopped", False):
            self.spot, self.spot_stopped = None, True
        if "generator" in state:
            self.generator.set_state(state["generator"])
        if "speculation" in state:
            self.speculation.load_state_dict(state["speculation"])
        if "lookup_speculation" in state:
            self.lookup_speculation.load_state_dict(state["lookup_speculation"])
        if self.hybrid is not None and "hybrid" in state:
            self.hybrid.load_state_dict(state["hybrid"])
        if self.history is not None and "history" in state:
            self.history.load_state_dict(state["history"])
        if self.spot is not None and "spot" in state:
            self.spot.load_state_dict(state["spot"], stream=streams)

    def save(self, folder: Path, rank: int, write_drafter: bool, world_size: int = 1) -> None:
        """Into a checkpoint folder: this rank's rollout state (written, then renamed) and, where `write_drafter`
        (the process that saves), the drafter, snapshotted now and written by a background thread into drafter.tmp,
        then renamed: a run killed while writing leaves no half-written drafter/ behind."""
        path = folder / ROLLOUT_STATE_NAME.format(rank=rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({**self.state_dict(), "world_size": world_size}, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)
        drafter = self.trainable_drafter
        if drafter is None or not write_drafter:
            return
        self.writer.write(drafter, folder / DRAFTER_DIR)

    def join_writes(self) -> None:
        """Wait for the background drafter write, if any; raise its error, if it failed (`DrafterWriter.join`)."""
        self.writer.join()

    def load(self, folder: Path, rank: int, policy: PreTrainedModel, world_size: int = 1) -> None:
        """From a checkpoint folder: the drafter's weights, in place (the engine's drafter and spot training's
        optimizer keep referring to the same parameters), then this rank's rollout state.

        A checkpoint written by another number of processes: every rank takes the first rank's state (the drafter is
        the same file for all; spot training's optimizer, schedule, buffer and draft vocabulary, the speculation
        statistics and the prompt history are rank 0's), each keeping its own sampling streams, seeded afresh. Every
        rank then holds the same drafter and spot state, as the merge needs; the run continues, not as the
        uninterrupted one would have (it ran with another number of processes)."""
        self._load_drafter(folder, policy)
        first = folder / ROLLOUT_STATE_NAME.format(rank=0)
        state = torch.load(first, weights_only=True) if first.is_file() else None
        # the number of processes that wrote it (checkpoints before it was recorded: the ranks' files)
        written = None if state is None else state.get("world_size", len(list(first.parent.glob("rank*.pt"))))
        if written is not None and written != world_size:
            logger.warning(
                f"{folder} was written by {written} process(es); this run has {world_size}. Every rank resumes from "
                "the first rank's drafter training, speculation and history state, with sampling streams of its own: "
                "training goes on, not as an uninterrupted run would have."
            )
            self.load_state_dict({key: value for key, value in state.items() if key != "generator"}, streams=False)
            return
        path = folder / ROLLOUT_STATE_NAME.format(rank=rank)
        if path.is_file():
            self.load_state_dict(torch.load(path, weights_only=True))
            return
        legacy = {}  # a checkpoint written before the per-rank state: what it kept
        if (folder / HISTORY_NAME.format(rank=rank)).is_file():
            legacy["history"] = json.loads((folder / HISTORY_NAME.format(rank=rank)).read_text())
        if (folder / DRAFTER_DIR / SPOT_STATE_NAME).is_file():
            legacy["spot"] = torch.load(folder / DRAFTER_DIR / SPOT_STATE_NAME, weights_only=True)
        self.load_state_dict(legacy)

    def _load_drafter(self, folder: Path, policy: PreTrainedModel) -> None:
        drafter = self.trainable_drafter
        if drafter is None:
            return
        path = folder / DRAFTER_DIR
        if not path.is_dir():
            raise FileNotFoundError(
                f"{folder} has no {DRAFTER_DIR}/ (the run stopped before its drafter was written); delete that "
                "checkpoint to resume from the previous one, or resume with drafter_type='none'."
            )
        if isinstance(drafter, Eagle3Model):
            saved = Eagle3Model.from_pretrained(path, policy)
            if saved.config.draft_vocab_size != drafter.config.draft_vocab_size:  # fitted to the policy's tokens
                drafter.resize_draft_vocab(saved.draft_ids, None)  # its weights are loaded next
                if self.spot is not None:
                    self.spot.drafter_resized()
            drafter.load_state_dict(saved.state_dict(), strict=False)
        elif (path / "adapter_model.safetensors").is_file():
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(drafter, load_file(str(path / "adapter_model.safetensors")))
        else:
            drafter.load_state_dict(load_file(str(path / "model.safetensors")), strict=False)
