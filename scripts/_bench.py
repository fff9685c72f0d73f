"""Shared by the benchmark scripts: writing a run's result JSON with its provenance, and bootstrap intervals."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

from trl_tlt.tooling.provenance import machine, stamp  # noqa: F401  (machine: for the scripts that qualify it)


def write_json(result: dict, path: str | None) -> None:
    """Write `result`, stamped with its command, commit, machine and seconds (`provenance.stamp`), to `path`
    (indented JSON) and say so; nothing when `path` is None."""
    if path:
        with open(path, "w") as f:
            json.dump(stamp(result), f, indent=2)
        print(f"wrote {path}")


def bootstrap_interval(
    statistic: Callable[[list[int]], float], n: int, draws: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """95% percentile bootstrap interval of `statistic(picks)`, where `picks` resamples range(n) with replacement.

    Paired: the statistic reads every series it compares at the same picks (e.g. the same prompt sets for both
    methods), so what the sets have in common cancels out.
    """
    rng = random.Random(seed)
    values = sorted(statistic([rng.randrange(n) for _ in range(n)]) for _ in range(draws))
    return values[int(0.025 * draws)], values[int(0.975 * draws) - 1]
