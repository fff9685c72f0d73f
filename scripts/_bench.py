"""Shared by the benchmark scripts: the machine's description and writing a run's result JSON."""

from __future__ import annotations

import json
import os
import platform

import torch


def machine() -> str:
    """The machine a benchmark ran on, for its JSON: architecture, cores, torch version, torch threads."""
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )


def write_json(result: dict, path: str | None) -> None:
    """Write `result` to `path` (indented JSON) and say so; nothing when `path` is None."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {path}")
