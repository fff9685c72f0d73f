"""The bandit finds the best arm of every batch-size bucket of a simulated cost model, and forgets."""

from contextlib import nullcontext

import pytest

from trl_tlt.engine.speculation import NO_SPECULATION, Arm, BanditSpeculation, batch_size_bucket, ladder_neighbours
from trl_tlt.tooling.selector_sim import CostModel, simulate_selector


ARMS = [("ngram", k) for k in (1, 2, 3, 4, 6, 8)]
BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64]


def test_buckets():
    assert [batch_size_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 64, 128]


def near_best(cost, bucket, arm, arms, tol=0.05):
    best = cost.rate(bucket, cost.oracle_arm(bucket, arms))
    return cost.rate(bucket, arm) >= (1 - tol) * best


def test_bandit_finds_best_arm_per_bucket():
    cost = CostModel()
    selector = BanditSpeculation(arms=ARMS, epsilon=0.1, seed=0)
    all_arms = selector.arms
    # The oracle's choice differs across buckets (otherwise the test proves little).
    oracle = {b: cost.oracle_arm(b, all_arms) for b in BATCH_SIZES}
    assert len(set(oracle.values())) >= 3
    steps = 200 * len(BATCH_SIZES)  # ~200 decode steps per bucket
    report = simulate_selector(selector, cost, all_arms, BATCH_SIZES, steps=steps, seed=1)
    best = selector.best_arms()
    for b in BATCH_SIZES:
        assert near_best(cost, b, best[b], all_arms), (b, best[b], oracle[b])
    # Regret against the oracle (time spent beyond the oracle's for the same tokens), exploration included.
    assert report["time_regret"] < 0.15, report


def test_bandit_forgets_when_the_drafter_changes():
    cost = CostModel(alpha=0.9)
    selector = BanditSpeculation(arms=ARMS, epsilon=0.1, decay=0.1, seed=0)
    simulate_selector(selector, cost, selector.arms, [2], steps=300, seed=2)
    assert selector.best_arms()[2][1] >= 4  # a good drafter: speculate far
    cost.alpha = 0.05  # the drafter went stale: speculation no longer pays
    simulate_selector(selector, cost, selector.arms, [2], steps=300, seed=3)
    assert selector.best_arms()[2] == NO_SPECULATION


def test_exploring_a_drafter_that_never_pays_is_cheap():
    """Exploration is local (neighbours of the best arm on the drafter's ladder): with a drafter that never pays it
    only tries k = 1. Mutation: explore any arm (`self._rng.choice(self.arms)`) and the regret reads 12%."""
    cost = CostModel(alpha=0.05)
    selector = BanditSpeculation(arms=ARMS, epsilon=0.1, seed=0)
    report = simulate_selector(selector, cost, selector.arms, BATCH_SIZES, steps=200 * len(BATCH_SIZES), seed=1)
    assert report["time_regret"] < 0.06, report
    assert all(arm == NO_SPECULATION for arm in selector.best_arms().values())


def test_ladder_neighbours():
    none, a1, a4, a4_tree, b2 = NO_SPECULATION, Arm("a", 1), Arm("a", 4), Arm("a", 4, 2, 8), Arm("b", 2)
    arms = [none, a1, a4, a4_tree, b2]
    near = ladder_neighbours(arms)
    assert near[none] == [a1, b2]
    assert near[a1] == [none, a4] and near[a4] == [a1, a4_tree]
    assert near[a4_tree] == [a4] and near[b2] == [none]


def test_bandit_validation():
    with pytest.raises(ValueError, match="epsilon"):
        BanditSpeculation(arms=ARMS, epsilon=2.0)
    with pytest.raises(ValueError, match="decay"):
        BanditSpeculation(arms=ARMS, decay=0.0)


def test_deprecated_simulate_alias_warns_and_runs_the_same():
    from trl_tlt.tooling.selector_sim import simulate

    cost = CostModel()
    runs = []
    for run in (simulate_selector, simulate):
        selector = BanditSpeculation(arms=ARMS, epsilon=0.1, seed=0)
        with pytest.warns(FutureWarning, match="simulate_selector") if run is simulate else nullcontext():
            runs.append(run(selector, cost, selector.arms, BATCH_SIZES, steps=50, seed=4))
    assert runs[0] == runs[1]


def test_the_bandit_reports_what_each_k_costs_as_it_measured_it():
    """`step_costs`: a chain of k drafts' recent mean step time over a plain step's, per bucket, from the times the
    bandit was fed (the simulated cost model's, with noise): within the noise of the model's true ratio, and carried
    by a checkpoint (older ones, without the discounted step counts, load too). Mutation: divide the tokens instead of
    the steps and the ratios are off by the acceptance."""
    import math
    import random

    cost = CostModel(noise=0.05)
    selector = BanditSpeculation(arms=ARMS, seed=0)
    rng = random.Random(1)
    for _ in range(200):  # every arm played at batch sizes 1 and 6 (bucket 8), its time as the cost model draws it
        for batch in (1, 6):
            for arm in selector.arms:
                tokens, seconds = cost.expected(batch, arm)
                selector.update(batch, arm, round(tokens), seconds * math.exp(rng.gauss(0, cost.noise)))
    assert selector.step_costs(3) == {}  # a bucket never played
    for batch in (1, 6):
        costs = selector.step_costs(batch)
        assert set(costs) == {1, 2, 3, 4, 6, 8}
        plain = cost.expected(batch, NO_SPECULATION)[1]
        for k, measured in costs.items():
            assert measured == pytest.approx(cost.expected(batch, Arm("ngram", k))[1] / plain, rel=0.05), (batch, k)
    restored = BanditSpeculation(arms=ARMS, epsilon=1.0, seed=0)
    restored.load_state_dict(selector.state_dict())
    assert restored.step_costs(8) == selector.step_costs(8)
    old = selector.state_dict()
    old["stats"] = {b: [row[:4] for row in rows] for b, rows in old["stats"].items()}
    restored.load_state_dict(old)
    for k, cost in restored.step_costs(8).items():  # the discounted weight rebuilt from the count: the same costs
        assert cost == pytest.approx(selector.step_costs(8)[k], rel=1e-6)
