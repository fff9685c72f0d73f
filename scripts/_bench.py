"""Shared by the benchmark scripts: the machine's description and writing a run's result JSON."""

from __future__ import annotations

import json
import os
import platform
import random
import subprocess
from collections.abc import Callable

import torch


def machine() -> str:
    """The machine a benchmark ran on, for its JSON: architecture, cores, torch version, torch threads."""
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )


def commit() -> str:
    """The repository's commit (short), with "+dirty" when tracked files differ from it."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=here, text=True).strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=here).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def write_json(result: dict, path: str | None) -> None:
    """Write `result` to `path` (indented JSON) and say so; nothing when `path` is None."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
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
