"""The long-tail rollout simulator against cases solved by hand."""

import numpy as np
import pytest

from trl_tlt.tooling.simulator import (
    Backend,
    Cluster,
    CostTable,
    LogNormalLengths,
    TraceLengths,
    rollout_seconds,
    simulate,
    speculative_speedup,
)


class FixedLengths:
    def __init__(self, lengths):
        self.lengths = np.asarray(lengths, dtype=float)

    def sample(self, rng, num_groups):
        return self.lengths.reshape(num_groups, -1)


def test_cost_table_interpolates_in_log_log_and_extends_the_last_slope():
    table = CostTable((1, 4, 16), (1.0, 2.0, 8.0))
    assert table([1, 4, 16]) == pytest.approx([1.0, 2.0, 8.0])
    assert table(2) == pytest.approx(np.sqrt(2.0))  # halfway in log between 1 and 4
    assert table(0.5) == pytest.approx(1.0)  # constant below the first point
    assert table(64) == pytest.approx(32.0)  # slope 1 in log-log from (4, 2) to (16, 8) continues
    assert CostTable((8,), (3.0,))([1, 100]) == pytest.approx([3.0, 3.0])


@pytest.mark.parametrize("batch_sizes, values", [((1, 1), (1.0, 2.0)), ((4, 2), (1.0, 1.0)), ((1,), (0.0,)), ((), ())])
def test_cost_table_rejects_bad_tables(batch_sizes, values):
    with pytest.raises(ValueError):
        CostTable(batch_sizes, values)


def test_rollout_with_constant_step_cost_is_the_longest_sequence():
    backend = Backend("flat", CostTable((1,), (0.5,)))
    assert rollout_seconds(backend, [[3, 10, 7], [1, 1, 2]]) == pytest.approx([5.0, 1.0])


def test_rollout_with_step_cost_proportional_to_batch_is_the_total_tokens():
    backend = Backend("linear", CostTable((1, 2), (0.1, 0.2)))
    assert rollout_seconds(backend, [[3, 10, 7]]) == pytest.approx([2.0])


def test_static_batch_pays_the_full_batch_until_the_longest_sequence_ends():
    backend = Backend("static", CostTable((1, 2), (0.1, 0.2)), static=True)
    assert rollout_seconds(backend, [[3, 10, 7]]) == pytest.approx([10 * 0.3])


def test_speculation_applies_only_at_or_below_the_threshold():
    decode = CostTable((1,), (1.0,))
    fast = Backend("sd", decode, speedup=CostTable((1,), (4.0,)), threshold=2)
    # lengths 4, 8, 8: 4 tokens at batch 3 (no SD: 4 s), then 4 tokens at batch 2 (SD: 1 s)
    assert rollout_seconds(fast, [[8, 4, 8]]) == pytest.approx([5.0])


def test_speculative_speedup_from_costs():
    flat = CostTable((1,), (1.0,))
    free = speculative_speedup(flat, CostTable((1,), (1e-9,)), acceptance_length=3.0, k=4)
    assert free(1) == pytest.approx(3.0) and free(64) == pytest.approx(3.0)
    linear = CostTable((1, 2), (1.0, 2.0))
    # compute-bound: verifying 5 tokens costs 5 decode steps, plus 4 drafts at 0.1 each
    paid = speculative_speedup(linear, CostTable((1, 2), (0.1, 0.2)), acceptance_length=3.0, k=4)
    assert paid(8) == pytest.approx(3.0 * 8 / (40 + 4 * 0.8))
    with pytest.raises(ValueError):
        speculative_speedup(flat, flat, acceptance_length=0.5, k=4)


def test_simulate_idle_time_and_whole_drafter_steps_harvested():
    cluster = Cluster(num_instances=2, groups_per_instance=1, gpus_per_instance=4, other_seconds=1.0,
                      drafter_step_seconds=0.3)  # fmt: skip
    backend = Backend("flat", CostTable((1,), (0.1,)))
    result = simulate(cluster, FixedLengths([[10, 2], [3, 1]]), [backend], num_steps=1)["flat"]
    assert result.rollout == pytest.approx([1.0])  # instance 0: 10 tokens; instance 1 done after 0.3 s
    assert result.step == pytest.approx([2.0])
    assert result.idle_gpu_seconds == pytest.approx([0.7 * 4])
    assert result.drafter_steps == pytest.approx([2])  # two whole 0.3 s steps fit in 0.7 s
    summary = result.summary()
    assert summary["harvested_share_of_idle"] == pytest.approx(0.6 / 0.7)
    assert summary["rollout_share"] == pytest.approx(0.5)


def test_backends_see_the_same_lengths():
    lengths = LogNormalLengths(median=100, sigma=1.0, max_tokens=2000)
    slow = Backend("slow", CostTable((1,), (1.0,)))
    fast = Backend("fast", CostTable((1,), (0.5,)))
    results = simulate(Cluster(num_instances=3, groups_per_instance=2), lengths, [slow, fast], num_steps=5)
    assert results["slow"].rollout == pytest.approx(2 * results["fast"].rollout)


def test_lognormal_lengths_median_clip_and_groups():
    lengths = LogNormalLengths(median=200, sigma=1.0, max_tokens=1000, group_size=8, prompt_share=0.5)
    draw = lengths.sample(np.random.default_rng(0), 20_000)
    assert draw.shape == (20_000, 8)
    assert np.median(draw) == pytest.approx(200, rel=0.03)
    assert draw.max() == 1000 and draw.min() >= 1
    # half the variance of log L is between prompts: responses to one prompt are correlated
    logs = np.log(np.clip(draw, 1, 999))
    assert np.corrcoef(logs[:, 0], logs[:, 1])[0, 1] == pytest.approx(0.5, abs=0.05)


def test_trace_lengths_draw_whole_groups():
    trace = TraceLengths([[1, 2], [30, 40]])
    draw = trace.sample(np.random.default_rng(0), 50)
    assert {tuple(row) for row in draw} <= {(1, 2), (30, 40)}
    with pytest.raises(ValueError):
        TraceLengths([[1, 2], [3]])


def test_step_cost_growing_with_the_cache():
    grow = CostTable((1,), (1e-12,))
    static = Backend("static", grow, context=CostTable((1,), (1.0,)), static=True)
    assert rollout_seconds(static, [[4, 10]]) == pytest.approx([50.0], rel=1e-6)  # sum of positions ~ L^2 / 2
    ragged = Backend("ragged", grow, context=CostTable((1, 2), (1.0, 2.0)))
    # positions 0-4 at batch 2 (cost 2 t), then 4-10 at batch 1 (cost t)
    assert rollout_seconds(ragged, [[4, 10]]) == pytest.approx([2 * 8 + (50 - 8)], rel=1e-6)
