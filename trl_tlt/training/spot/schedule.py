"""How much spot training does: its learning rate and its share of the time budget.

`SpotSchedule` sets the learning rate by drafter step; `SpotBudget` the share of the time budget a phase spends,
from measured acceptance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SpotSchedule:
    """Learning rate as a function of the drafter's step count.

    Args:
        learning_rate: The warm regime's learning rate (a warm-started drafter's, from the first step).
        cold_steps: Length of a new head's cold start in drafter steps (0 = none): the rate starts at
            `cold_learning_rate` and follows a cosine down to `learning_rate`.
        cold_learning_rate: Learning rate at the start of the cold start.
        warmup_steps: Linear warm-up of the learning rate.

    Example:
        >>> SpotSchedule(cold_steps=300).learning_rate_at(0)  # 2e-3 x 1/10 (warm-up)
    """

    learning_rate: float = 3e-5
    cold_steps: int = 0
    cold_learning_rate: float = 2e-3
    warmup_steps: int = 10

    def _cold_weight(self, step: int) -> float:
        """1 at the start of a cold start, 0 at its end and without one (cosine)."""
        if self.cold_steps <= 0:
            return 0.0
        return 0.5 * (1.0 + math.cos(math.pi * min(step / self.cold_steps, 1.0)))

    def learning_rate_at(self, step: int) -> float:
        weight = self._cold_weight(step)
        rate = self.learning_rate + (self.cold_learning_rate - self.learning_rate) * weight
        return rate * min(1.0, (step + 1) / max(self.warmup_steps, 1))


def acceptance_length(agreement: list[float], k: int | None = None) -> float:
    """Expected tokens a decode step emits drafting `k` tokens (default: all) with per-position agreement
    `agreement`: 1 + sum_{j<k} prod_{i<=j} a_i."""
    length, run = 1.0, 1.0
    for a in agreement[:k]:
        run *= a
        length += run
    return length


def expected_speedup(agreement: list[float], step_costs: dict[int, float]) -> float | None:
    """A rollout's expected speed-up when speculating with the drafter at its best k: the most of
    `acceptance_length(agreement, k) / cost(k)` over the k the agreement covers, where cost(k) is the measured cost of
    a step drafting k tokens over a plain step's (`BanditSpeculation.step_costs`), at least 1, and a k not measured yet
    costs 1 + k x the steepest measured cost per draft token. Below 1: speculating with it slows the rollout. None
    where no cost was measured."""
    measured = {k: max(c, 1.0) for k, c in step_costs.items() if k > 0}
    if not measured or not agreement:
        return None
    slope = max((c - 1.0) / k for k, c in measured.items())
    costs = [measured.get(k, 1.0 + k * slope) for k in range(1, len(agreement) + 1)]
    return max(acceptance_length(agreement, k) / cost for k, cost in enumerate(costs, start=1))


def _moving(mean: float | None, value: float, weight: float) -> float:
    return value if mean is None else mean + weight * (value - mean)


@dataclass
class SpotBudget:
    """One process: the seconds of drafter training each phase between rollouts may take, from measured acceptance.

    A phase earns `time_budget x rollout seconds x share` of credit and spends it on held-out evaluation and drafter
    steps (a step starts only while the credit covers its expected time; what a phase leaves, or overdraws, carries
    to the next, at most one phase's worth). The share follows what the drafter is learning: the trend of its held-out
    acceptance length `a` over the last `window` phases (the least-squares line's change across them; a trend counts
    when it exceeds `tolerance` and twice its standard error, so that the measurements' scatter is not taken for
    learning), and what it pays: the rollout's expected speed-up `s` with it (`expected_speedup`: its measured
    agreement over the measured cost of a verify step; a moving average), or, where those costs are not measured,
    its acceptance length's level against `min_acceptance`:

        warm-up (a new head's first `warmup_phases`, or fewer than 3 measurements)  share 1
        trend > +threshold (still learning, however low it still is)                share 1
        trend < -threshold (drift: the policy moved away from it)                   share 1
        flat, s < `min_speedup` (or a < `min_acceptance`): stopped improving, does   share 0: skip 1, 2, 4, ... phases,
        not pay                                                                       then probe again
        flat otherwise (plateau)                                                     share `plateau_share`, at most
                                                                                      (s - 1) / (2 x time_budget): a
                                                                                      plateau spends at most half of
                                                                                      what the drafter saves

    Args:
        time_budget: Drafter-training seconds per second of rollout, at most (`TLTConfig.spot_time_budget`).
        warmup_phases: Phases a new head trains at the full share whatever it measures (0 for a warm start).
        plateau_share: Share of the budget on a plateau.
        min_speedup: Expected speed-up below which a drafter does not pay for its drafting and evaluation.
        min_acceptance: Acceptance length below which a drafter does not pay for its drafting, where the verify
            step's cost is not measured.
        tolerance: Change across the window that counts as a trend (acceptance-length units).
        window: Phases the trend is fitted over.
        fast: Weight of the newest measurement in the level's moving average.
        max_skip: Longest run of skipped phases before a probe.

    Example:
        >>> budget = SpotBudget(time_budget=0.25, warmup_phases=4)
        >>> budget.observe(1.0); budget.seconds(rollout_seconds=4.0)  # 1.0: a new head warms up at full share
    """

    time_budget: float = 0.5
    warmup_phases: int = 0
    plateau_share: float = 0.25
    min_speedup: float = 1.05
    min_acceptance: float = 1.3
    tolerance: float = 0.05
    window: int = 6
    fast: float = 0.5
    max_skip: int = 16
    phases: int = 0  # phases observed
    fast_mean: float | None = None
    speedup: float | None = None  # moving average of the expected speed-up (None: costs not measured)
    recent: list[float] = field(default_factory=list)  # the last `window` measurements
    skip: int = 0  # phases left to skip
    next_skip: int = 1  # length of the next run of skipped phases
    credit: float = 0.0  # seconds

    def observe(self, acceptance: float | None, speedup: float | None = None) -> None:
        """A phase's held-out acceptance length (None: nothing held out yet) and the rollout's expected speed-up with
        the drafter (None: not measured)."""
        self.phases += 1
        if acceptance is None:
            return
        self.fast_mean = _moving(self.fast_mean, acceptance, self.fast)
        self.speedup = None if speedup is None else _moving(self.speedup, speedup, self.fast)
        self.recent = [*self.recent, acceptance][-self.window :]

    def _line(self) -> tuple[float, float] | None:
        """The change in acceptance length across the recent measurements on their least-squares line, and its
        standard error (None: fewer than 3)."""
        n = len(self.recent)
        if n < 3:
            return None
        mean_x, mean_y = (n - 1) / 2, sum(self.recent) / n
        variance = sum((x - mean_x) ** 2 for x in range(n))
        slope = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(self.recent)) / variance
        residuals = sum((y - mean_y - slope * (x - mean_x)) ** 2 for x, y in enumerate(self.recent))
        return slope * (n - 1), math.sqrt(residuals / (n - 2) / variance) * (n - 1)

    @property
    def trend(self) -> float | None:
        """The change in acceptance length across the recent measurements, on their least-squares line (None: fewer
        than 3)."""
        line = self._line()
        return None if line is None else line[0]

    @property
    def share(self) -> float:
        """Share of the time budget the current phase gets (after `observe`)."""
        line = self._line()
        if self.phases <= self.warmup_phases or line is None:
            return 1.0
        trend, error = line
        if abs(trend) > max(self.tolerance, 2 * error):  # a trend the measurements' scatter does not explain
            return 1.0
        if self.speedup is None:
            return 0.0 if self.fast_mean < self.min_acceptance else self.plateau_share
        if self.speedup < self.min_speedup:
            return 0.0
        return min(self.plateau_share, (self.speedup - 1.0) / (2 * max(self.time_budget, 1e-9)))

    def skips_phase(self) -> bool:
        """Whether this phase is skipped whole (no evaluation, no step): a drafter that did not pay is left idle,
        probed again after 1, 2, 4, ... skipped phases."""
        if self.skip > 0:
            self.skip -= 1
            return True
        return False

    def seconds(self, rollout_seconds: float) -> float:
        """Credit (seconds) the current phase may spend; a share of 0 starts a run of skipped phases."""
        share = self.share
        if share == 0.0:
            self.skip, self.next_skip = self.next_skip, min(2 * self.next_skip, self.max_skip)
            self.credit = min(self.credit, 0.0)
            return self.credit
        if self.phases > self.warmup_phases:
            self.next_skip = 1
        earned = self.time_budget * rollout_seconds * share
        self.credit = min(self.credit, earned) + earned
        return self.credit

    def spend(self, seconds: float) -> None:
        self.credit -= seconds

    def state_dict(self) -> dict:
        names = ("phases", "fast_mean", "speedup", "recent", "skip", "next_skip", "credit")
        return {name: getattr(self, name) for name in names}

    def load_state_dict(self, state: dict) -> None:
        for name, value in state.items():
            if name != "slow_mean":  # saved before the trend was fitted over `recent`
                setattr(self, name, list(value) if name == "recent" else value)
