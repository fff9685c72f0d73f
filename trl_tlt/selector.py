"""Adaptive speculation: a bucketed epsilon-greedy bandit that picks, per decode step, whether and how far to draft.

TLT's BEG-MAB, made to really explore and to forget. Arms are (drafter name, k) pairs plus "no speculation"
(None, 0). Active batch sizes fall into power-of-two buckets (1, 2, 3-4, 5-8, ...); each bucket keeps, per arm, an
exponentially weighted mean of the reward

    reward = tokens the step emitted / the step's wall time          (tokens per second)

estimated as a ratio of exponentially discounted sums (tokens / seconds, not a mean of per-step ratios, which
would overrate noisy arms), so the policy's and the drafter's drift is forgotten (`decay`). Wall time makes the
choices, and so the random stream and the completions, differ from run to run; with a `cost_model` the step's
cost is modelled instead (deterministic: a seed fixes the completions), at the price of ignoring the hardware. Each step plays an untried arm of the bucket
first, then explores a random arm with probability `epsilon`, else the arm with the best mean. Cheap: pure
Python on numbers the engine already has on the host; no extra device synchronisation.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from .engine import Arm, SpeculationPolicy


def batch_size_bucket(batch_size: int) -> int:
    """Upper bound of the power-of-two bucket: 1 -> 1, 2 -> 2, 3..4 -> 4, 5..8 -> 8, ..."""
    return 1 << max(batch_size - 1, 0).bit_length()


@dataclass
class _ArmStats:
    tokens: float = 0.0  # discounted sum of emitted tokens
    seconds: float = 0.0  # discounted sum of step seconds
    count: int = 0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class BanditSpeculation(SpeculationPolicy):
    """Bucketed epsilon-greedy bandit over speculation arms.

    Args:
        arms: Candidate (drafter name, k) pairs; (None, 0) = no speculation is always added.
        epsilon: Exploration probability once every arm of a bucket was tried.
        decay: Discount applied to an arm's past tokens and seconds at each of its updates (forgetting).
        seed: Seed of the exploration draws.
        cost_model: Modelled cost of a step played with an arm (any unit), used instead of its wall time: the
            choices then depend only on the emitted tokens, so a seeded run repeats exactly.

    Example:
        >>> selector = BanditSpeculation(arms=[("ngram", k) for k in (1, 2, 4, 8)])
        >>> engine = SpeculativeEngine(model, drafter={"ngram": NgramDrafter()}, speculation=selector)
    """

    arms: list[Arm] = field(default_factory=list)
    epsilon: float = 0.1
    decay: float = 0.1
    seed: int = 0
    cost_model: Callable[[Arm], float] | None = None

    def __post_init__(self):
        if not 0 <= self.epsilon <= 1:
            raise ValueError(f"`epsilon` must be in [0, 1], got {self.epsilon}.")
        if not 0 < self.decay <= 1:
            raise ValueError(f"`decay` must be in (0, 1], got {self.decay}.")
        arms = [(None, 0)] + [tuple(a) for a in self.arms if a[1] > 0]
        self.arms = list(dict.fromkeys(arms))
        self._rng = random.Random(self.seed)
        self._stats: dict[int, dict[Arm, _ArmStats]] = defaultdict(lambda: {a: _ArmStats() for a in self.arms})

    def choose(self, batch_size: int) -> Arm:
        stats = self._stats[batch_size_bucket(batch_size)]
        untried = [a for a in self.arms if stats[a].count == 0]
        if untried:
            return untried[0]
        if self._rng.random() < self.epsilon:
            return self._rng.choice(self.arms)
        return max(self.arms, key=lambda a: stats[a].rate)

    def update(self, batch_size: int, arm: Arm, num_emitted_tokens: int, seconds: float) -> None:
        s = self._stats[batch_size_bucket(batch_size)][tuple(arm)]
        s.count += 1
        if self.cost_model is not None:
            seconds = self.cost_model(tuple(arm))
        keep = 1.0 - self.decay
        s.tokens = keep * s.tokens + num_emitted_tokens
        s.seconds = keep * s.seconds + seconds

    def best_arms(self) -> dict[int, Arm]:
        """The current greedy choice of every bucket seen so far (bucket upper bound -> arm)."""
        return {b: max(self.arms, key=lambda a: s[a].rate) for b, s in sorted(self._stats.items())}
