"""A simulated speculative-decoding cost model with known best arms, to test and report on selectors.

Per decode step at active batch size B with arm (drafter, k), acceptance rate alpha per token:

    expected tokens = B * (1 - alpha**(k+1)) / (1 - alpha)          (B for k = 0)
    step time       = c_fixed + c_token * B * (k+1) + c_draft * k   (seconds)

Rewards are observed with multiplicative log-normal noise. `oracle_arm` is the arm with the highest expected
tokens per second, against which `simulate` measures regret.
"""

from __future__ import annotations

import math
import random
import warnings
from dataclasses import dataclass

from trl_tlt.engine.speculation import Arm, SpeculationPolicy, batch_size_bucket


@dataclass
class CostModel:
    c_fixed: float = 10e-3
    c_token: float = 0.2e-3
    c_draft: float = 1e-3
    alpha: float = 0.8
    noise: float = 0.1

    def expected(self, batch_size: int, arm: Arm) -> tuple[float, float]:
        """(expected emitted tokens, step seconds)."""
        k = arm.k
        tokens = batch_size * ((1 - self.alpha ** (k + 1)) / (1 - self.alpha) if k else 1.0)
        return tokens, self.c_fixed + self.c_token * batch_size * (k + 1) + self.c_draft * k

    def rate(self, batch_size: int, arm: Arm) -> float:
        tokens, seconds = self.expected(batch_size, arm)
        return tokens / seconds

    def oracle_arm(self, batch_size: int, arms: list[Arm]) -> Arm:
        return max(arms, key=lambda a: self.rate(batch_size, a))


def simulate_selector(
    selector: SpeculationPolicy, cost: CostModel, arms: list[Arm], batch_sizes: list[int], steps: int, seed: int = 0
) -> dict:
    """Run `steps` decode steps at batch sizes drawn uniformly from `batch_sizes`; returns regret figures."""
    arms = [Arm(*a) for a in arms]
    rng = random.Random(seed)
    achieved = optimal = 0.0
    for _ in range(steps):
        batch_size = rng.choice(batch_sizes)
        arm = selector.choose(batch_size)
        tokens, seconds = cost.expected(batch_size, arm)
        observed = seconds * math.exp(rng.gauss(0, cost.noise))
        selector.update(batch_size, arm, round(tokens), observed)
        # Regret in time: the oracle would emit the same tokens faster.
        achieved += seconds
        optimal += tokens / cost.rate(batch_size, cost.oracle_arm(batch_size, arms))
    buckets = sorted({batch_size_bucket(b) for b in batch_sizes})
    return {"time_regret": achieved / optimal - 1.0, "buckets": buckets}


def simulate(*args, **kwargs) -> dict:
    """Deprecated alias of `simulate_selector` (`trl_tlt.tooling.simulator.simulate` is the cluster simulator); removed in the
    next release."""
    warnings.warn(
        "trl_tlt.tooling.selector_sim.simulate is renamed simulate_selector; the alias goes in the next release.",
        FutureWarning,
        stacklevel=2,
    )
    return simulate_selector(*args, **kwargs)
