"""Speculation policies: before each decode step, which drafter drafts how far (an `Arm`) for the active batch size.

`FixedSpeculation` plays one arm at every batch size. `BanditSpeculation` is adaptive: TLT's BEG-MAB, a bucketed
epsilon-greedy bandit made to really explore and to forget. Its arms are chains and trees of each drafter plus "no
speculation" (`NO_SPECULATION`). Active batch sizes fall into power-of-two buckets (1, 2, 3-4, 5-8, ...); each
bucket keeps, per arm, an exponentially weighted mean of the reward

    reward = tokens the step emitted / the step's wall time          (tokens per second)

estimated as a ratio of exponentially discounted sums (tokens / seconds, not a mean of per-step ratios, which
would overrate noisy arms), so the policy's and the drafter's drift is forgotten (`decay`). Wall time makes the
choices, and so the random stream and the completions, differ from run to run; with a `cost_model` the step's
cost is modelled instead (deterministic: a seed fixes the completions), at the price of ignoring the hardware.

Exploration is local: each drafter's arms form a ladder (chains by k, then trees by depth and top-k), whose first
rung neighbours "no speculation". A step plays an untried neighbour of the bucket's best arm first, then, with
probability `epsilon`, a random neighbour, else the best arm. A drafter that does not pay is thus only ever tried at
its cheapest rung (k = 1: one draft, a two-position verification), never at k = 8: exploring costs little where
speculation loses, and the bandit still climbs to a long draft, one rung at a time, where it wins. Cheap: pure Python
on numbers the engine already has on the host; no extra device synchronisation.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple


class Arm(NamedTuple):
    """What a decode step drafts: `drafter` drafts a chain of `k` tokens, or, with `topk` and `verify`, a tree `k`
    deep whose expanded nodes have `topk` children and of which the policy verifies the `verify` best nodes (build
    trees with `tree_arm`, which checks them). k = 0: no speculation."""

    drafter: str | None
    k: int
    topk: int | None = None
    verify: int | None = None

    @property
    def is_tree(self) -> bool:
        return self.topk is not None


NO_SPECULATION = Arm(None, 0)


def tree_arm(drafter: str | None, depth: int, topk: int, verify: int) -> Arm:
    """A tree arm, checked: `verify` nodes of a tree `depth` deep whose expanded nodes have `topk` children."""
    if depth < 1 or topk < 1 or verify < 1:
        raise ValueError(f"A tree needs depth, topk and verify >= 1, got ({depth}, {topk}, {verify}).")
    most = topk + (depth - 1) * topk * topk
    if verify > most:
        raise ValueError(f"A tree {depth} deep with topk={topk} drafts {most} nodes at most; got verify={verify}.")
    return Arm(drafter, depth, topk, verify)


class SpeculationPolicy:
    """Decides, before each decode step, which drafter drafts how many tokens for the active batch size."""

    def choose(self, batch_size: int) -> Arm:
        raise NotImplementedError

    def update(self, batch_size: int, arm: Arm, num_emitted_tokens: int, seconds: float) -> None:
        """Feedback after the step (for adaptive policies)."""

    def state_dict(self) -> dict:
        """What a resumed run needs to choose as this one would (adaptive policies: their statistics)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class FixedSpeculation(SpeculationPolicy):
    """The same drafter and k at every batch size (k = 0: no speculation).

    With `topk` and `verify` the drafter drafts a tree of depth k instead of a chain (`trl_tlt.tree`): it expands
    the `topk` best children of its `topk` best nodes at every depth and the policy verifies the `verify` best nodes.
    """

    def __init__(self, k: int, drafter: str | None = None, topk: int | None = None, verify: int | None = None):
        if k < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {k}.")
        if (topk is None) != (verify is None):
            raise ValueError("A tree needs both `topk` and `verify` (or neither, for a chain).")
        self.arm = (
            NO_SPECULATION if k == 0 else Arm(drafter, k) if topk is None else tree_arm(drafter, k, topk, verify)
        )

    def choose(self, batch_size: int) -> Arm:
        return self.arm


# Draft lengths the trainer's bandit plays (up to `num_speculative_tokens`, which is always played): short ones pay at
# large batch sizes, long ones in the tail.
BANDIT_DRAFT_LENGTHS = (1, 2, 3, 4, 6, 8)
# With hybrid drafting the bandit also plays these, past `num_speculative_tokens`: the learned drafter drafts that
# many, lookups the rest (a wider verification, which pays where lookups match: in the tail, on a later epoch).
LOOKUP_DRAFT_LENGTHS = (8, 12, 16)


def batch_size_bucket(batch_size: int) -> int:
    """Upper bound of the power-of-two bucket: 1 -> 1, 2 -> 2, 3..4 -> 4, 5..8 -> 8, ..."""
    return 1 << max(batch_size - 1, 0).bit_length()


def dominant_bucket(batch_sizes: list[int]) -> int:
    """The bucket most of a rollout's decode steps ran in (their active batch sizes; the larger one on a tie)."""
    counts = Counter(batch_size_bucket(size) for size in batch_sizes)
    return max(counts, key=lambda bucket: (counts[bucket], bucket))


def ladder_neighbours(arms: list[Arm]) -> dict[Arm, list[Arm]]:
    """Each arm's neighbours: the rungs next to it on its drafter's ladder (chains by k, then trees by depth, top-k
    and verified nodes); the first rung of every ladder and `NO_SPECULATION` neighbour each other."""
    ladders: dict[str | None, list[Arm]] = defaultdict(list)
    for arm in arms:
        if arm.k > 0:
            ladders[arm.drafter].append(arm)
    neighbours: dict[Arm, list[Arm]] = {NO_SPECULATION: []}
    for ladder in ladders.values():
        ladder.sort(key=lambda a: (a.is_tree, a.k, a.topk or 0, a.verify or 0))
        neighbours[NO_SPECULATION].append(ladder[0])
        for i, arm in enumerate(ladder):
            below = ladder[i - 1] if i else NO_SPECULATION
            neighbours[arm] = [below, *ladder[i + 1 : i + 2]]
    return neighbours


@dataclass
class _ArmStats:
    tokens: float = 0.0  # discounted sum of emitted tokens
    seconds: float = 0.0  # discounted sum of step seconds
    count: int = 0
    steps: float = 0.0  # discounted count of steps

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def step_seconds(self) -> float:
        """The arm's recent mean step time (discounted as its rate)."""
        return self.seconds / self.steps if self.steps > 0 else 0.0


@dataclass
class BanditSpeculation(SpeculationPolicy):
    """Bucketed epsilon-greedy bandit over speculation arms.

    Args:
        arms: Candidate arms (`Arm`s, or tuples as `Arm` takes them); `NO_SPECULATION` is always added.
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
        arms = [NO_SPECULATION] + [arm for arm in (Arm(*a) for a in self.arms) if arm.k > 0]
        self.arms = list(dict.fromkeys(arms))
        self._rng = random.Random(self.seed)
        self._stats: dict[int, dict[Arm, _ArmStats]] = defaultdict(lambda: {a: _ArmStats() for a in self.arms})
        self._neighbours = ladder_neighbours(self.arms)

    def choose(self, batch_size: int) -> Arm:
        stats = self._stats[batch_size_bucket(batch_size)]
        tried = [a for a in self.arms if stats[a].count]
        best = max(tried, key=lambda a: stats[a].rate) if tried else self.arms[0]
        near = self._neighbours[best]
        untried = [a for a in (best, *near) if stats[a].count == 0]
        if untried:
            return untried[0]
        if near and self._rng.random() < self.epsilon:
            return self._rng.choice(near)
        return best

    def update(self, batch_size: int, arm: Arm, num_emitted_tokens: int, seconds: float) -> None:
        arm = Arm(*arm)
        s = self._stats[batch_size_bucket(batch_size)][arm]
        s.count += 1
        if self.cost_model is not None:
            seconds = self.cost_model(arm)
        keep = 1.0 - self.decay
        s.tokens = keep * s.tokens + num_emitted_tokens
        s.seconds = keep * s.seconds + seconds
        s.steps = keep * s.steps + 1.0

    def step_costs(self, batch_size: int) -> dict[int, float]:
        """What a decode step drafting k tokens (a chain) costs at `batch_size`'s bucket, as measured: its recent mean
        time over the recent mean time of a step without speculation, for every k played there (empty until no
        speculation was played there too). The bandit's reward, tokens per second, is the acceptance a step gets over
        this cost: a k whose cost its drafter's acceptance does not cover loses to a shorter one, or to none."""
        stats = self._stats.get(batch_size_bucket(batch_size))
        plain = None if stats is None else stats[NO_SPECULATION].step_seconds
        if not plain:
            return {}
        return {a.k: s.step_seconds / plain for a, s in stats.items() if a.k > 0 and not a.is_tree and s.steps > 0}

    def state_dict(self) -> dict:
        stats = {
            bucket: [(tuple(arm), s.tokens, s.seconds, s.count, s.steps) for arm, s in arms.items()]
            for bucket, arms in self._stats.items()
        }
        return {"stats": stats, "rng": self._rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self._stats.clear()
        for bucket, rows in state["stats"].items():
            for arm, tokens, seconds, count, *steps in rows:
                if not steps:  # a checkpoint before `steps`: count updates' weight, discounted as `seconds` is
                    steps = [(1.0 - (1.0 - self.decay) ** count) / self.decay]
                self._stats[bucket][Arm(*arm)] = _ArmStats(tokens, seconds, count, steps[0])
        self._rng.setstate(state["rng"])

    def best_arms(self) -> dict[int, Arm]:
        """The current greedy choice of every bucket seen so far (bucket upper bound -> arm)."""
        return {b: max(self.arms, key=lambda a: s[a].rate) for b, s in sorted(self._stats.items())}
