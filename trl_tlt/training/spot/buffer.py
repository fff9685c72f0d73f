"""The drafter's data buffer: the last rollouts' token sequences and the policy's features of them, bounded in tokens
and in memory, every eighth held out."""

from __future__ import annotations

import random
from collections import deque

from transformers.utils import logging

from ..distillation import DrafterSample


logger = logging.get_logger(__name__)


HELD_OUT_EVERY = 8  # every 8th buffered sequence is held out for `evaluate`


def take_tokens(samples: list[DrafterSample], max_tokens: int) -> list[DrafterSample]:
    """The leading sequences that fit in `max_tokens` (at least one, if any)."""
    taken, total = [], 0
    for s in samples:
        if taken and total + len(s.token_ids) > max_tokens:
            break
        taken.append(s)
        total += len(s.token_ids)
    return taken


class DataBuffer:
    """Prompt + completion token ids of the last `window` rollouts (with the policy's features of them, where the
    rollout recorded them), at most `max_tokens` tokens and `max_feature_bytes` of features in all, the held-out
    sequences' included.

    Features are the policy's as it was at its rollout (or its training step). A sequence stays while its features are
    at most `window - 1` rollouts old (TLT's one-step offset: with `window=2`, the previous rollout's beside the current
    one's), and leaves after: `add` with a newer `version` drops the older ones.

    Args:
        window: Rollouts kept (TLT's one-step offset: 2 = the current and the previous rollout).
        max_tokens: Memory budget in tokens (8 bytes each); the oldest sequences go first when it is exceeded.
        max_feature_bytes: Memory budget of the features; likewise.
        updates_per_rollout: Policy updates (versions) between two rollouts (GRPOTrainer's optimizer steps per
            generation batch, `num_iterations` included): the window's age limit in versions is
            `(window - 1) x updates_per_rollout`.
    """

    def __init__(
        self,
        window: int = 2,
        max_tokens: int = 262_144,
        max_feature_bytes: int = 4 << 30,
        updates_per_rollout: int = 1,
    ):
        if window < 1:
            raise ValueError(f"`window` must be >= 1, got {window}.")
        if max_tokens < 1:
            raise ValueError(f"`max_tokens` must be >= 1, got {max_tokens}.")
        if max_feature_bytes < 0:
            raise ValueError(f"`max_feature_bytes` must be >= 0, got {max_feature_bytes}.")
        self.window, self.max_tokens, self.max_feature_bytes = window, max_tokens, max_feature_bytes
        self.updates_per_rollout = max(updates_per_rollout, 1)
        self.max_age = (window - 1) * self.updates_per_rollout  # in versions
        self.rollouts: deque[list[DrafterSample]] = deque()
        self.held_out: list[DrafterSample] = []  # of the latest rollout only: "recent"
        self.num_added = 0
        self._drawn = True  # whether a step drew from the buffer since its latest rollout

    def add(
        self,
        prompts: list[list[int]],
        completions: list[list[int]],
        features: list | None = None,
        version: int | None = None,
    ) -> None:
        """One rollout; empty completions are skipped (nothing to learn). `features` (aligned with the rows, each a
        `DrafterSample.features` or None) were computed by the policy at `version`: samples whose features are of an
        older version leave the buffer."""
        train, held_out = [], []
        features = features or [None] * len(prompts)
        for prompt, completion, states in zip(prompts, completions, features, strict=True):
            if not completion:
                continue
            if states is not None and len(states) != len(prompt) + len(completion) - 1:
                logger.warning(  # never trained on: a forward of the policy over the sequence instead
                    f"Features of {len(states)} positions for a sequence of {len(prompt) + len(completion)} tokens "
                    "(they cover every position but the last): the sequence changed after its rollout. Drafter "
                    "training runs the policy over it instead."
                )
                states = None
            sample = DrafterSample(
                list(prompt) + list(completion), len(prompt), states, None if states is None else version
            )
            self.num_added += 1
            (held_out if self.num_added % HELD_OUT_EVERY == 0 else train).append(sample)
        self.drop_stale(version)
        self.rollouts.append(train)
        self.held_out, self._drawn = held_out, False
        while len(self.rollouts) > self.window:
            self.rollouts.popleft()
        while self.num_tokens > self.max_tokens and any(self.rollouts):  # tokens: the training sequences'
            next(r for r in self.rollouts if r).pop(0)
        while self.feature_bytes > self.max_feature_bytes:
            self._drop_features()

    def _drop_features(self) -> None:
        """Over the memory cap (held-out sequences included): a held-out sequence with features if they hold more than
        their share (1 / HELD_OUT_EVERY) of the features or no training sequence has any, else the oldest training
        sequence with features."""
        held_out = [s for s in self.held_out if s.features is not None]
        held_out_bytes = sum(s.features.nbytes for s in held_out)
        training = next((r for r in self.rollouts if any(s.features is not None for s in r)), None)
        if held_out and (held_out_bytes * HELD_OUT_EVERY > self.feature_bytes or training is None):
            rows, gone = self.held_out, held_out[-1]
        else:
            rows, gone = training, next(s for s in training if s.features is not None)
        del rows[next(i for i, s in enumerate(rows) if s is gone)]  # by identity (samples hold tensors)

    def drop_featureless(self) -> int:
        """Drop the sequences without features (held out or not); returns how many went."""
        dropped = 0
        for rollout in (*self.rollouts, self.held_out):
            kept = [s for s in rollout if s.features is not None]
            dropped += len(rollout) - len(kept)
            rollout[:] = kept
        return dropped

    def drop_stale(self, version: int | None) -> None:
        """Drop the sequences whose features the policy computed more than `max_age` updates before `version` (None:
        nothing to compare): the window's older rollouts stay, their features one rollout's updates old each."""
        if version is None:
            return
        oldest = version - self.max_age
        for rollout in (*self.rollouts, self.held_out):
            rollout[:] = [s for s in rollout if s.version is None or s.version >= oldest]

    @property
    def unseen(self) -> list[DrafterSample]:
        """The latest rollout's training sequences while no step has drawn from the buffer since it came: held out from
        the drafter as much as `held_out`, until then."""
        return [] if self._drawn or not self.rollouts else list(self.rollouts[-1])

    @property
    def samples(self) -> list[DrafterSample]:
        return [s for rollout in self.rollouts for s in rollout]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)

    @property
    def feature_bytes(self) -> int:
        """Bytes of features held, the held-out sequences' included."""
        return sum(s.features.nbytes for s in [*self.samples, *self.held_out] if s.features is not None)

    def sample(self, max_tokens: int, rng: random.Random) -> list[DrafterSample]:
        """Sequences drawn uniformly without replacement until `max_tokens` (at least one, if any)."""
        self._drawn = True
        pool = self.samples
        rng.shuffle(pool)
        return take_tokens(pool, max_tokens)

    def state_dict(self) -> dict:
        """The buffered sequences (a resumed run trains on what the uninterrupted one would) and the count that decides
        which are held out. Features are saved for the sequences the next rollout keeps (with `window=2`, the latest
        rollout's), which the uninterrupted run trains on again; the others', dropped at the next rollout either way,
        are not."""
        versions = [s.version for s in [*self.samples, *self.held_out] if s.version is not None]
        # the next rollout comes `updates_per_rollout` versions after the newest held
        kept_from = max(versions) + self.updates_per_rollout - self.max_age if versions else None

        def rows(samples):
            return [
                (s.token_ids, s.prompt_length, s.version, s.features if kept_from is not None
                 and s.version is not None and s.version >= kept_from else None)
                for s in samples
            ]  # fmt: skip

        return {
            "num_added": self.num_added,
            "rollouts": [rows(rollout) for rollout in self.rollouts],
            "held_out": rows(self.held_out),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a saved buffer (one saved without its sequences, before they were checkpointed, restores the count
        alone: the next rollouts refill it)."""
        self.num_added, self._drawn = int(state["num_added"]), True

        def samples(rows):  # rows saved before features were recorded have no version, before #61 no features
            return [
                DrafterSample(
                    list(row[0]), int(row[1]), row[3] if len(row) > 3 else None, row[2] if len(row) > 2 else None
                )
                for row in rows
            ]

        self.rollouts = deque(samples(r) for r in state.get("rollouts", []))
        self.held_out = samples(state.get("held_out", []))
