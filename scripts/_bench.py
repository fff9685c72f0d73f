"""Shared by the benchmark scripts: writing a run's result JSON."""

from __future__ import annotations

import json


def write_json(result: dict, path: str | None) -> None:
    """Write `result` to `path` (indented JSON) and say so; nothing when `path` is None."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {path}")
