"""`RolloutTurn`: one generation turn of a rollout, kept until the rollout ends (`TLTGRPOTrainer._end_rollout`)."""

from __future__ import annotations

from typing import NamedTuple


class RolloutTurn(NamedTuple):
    """One generation turn: the prompts (tool results included after a rollout's first turn) and what the policy
    sampled after them, in `seconds`; `spec_stats`: vLLM's acceptance over the turn (None on trl-tlt's engine)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    seconds: float
    spec_stats: dict[str, float] | None = None
