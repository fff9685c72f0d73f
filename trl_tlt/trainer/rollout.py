"""What a rollout is made of (`RolloutTurn`) and what a drafter trains (`drafter_model`): shared by the rollout stack,
its builder and the trainer."""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers import PreTrainedModel

from ..drafters.eagle3 import Eagle3Drafter, Eagle3Model
from ..drafters.model import ModelDrafter
from ..engine import Drafter


def drafter_model(drafter: Drafter | None) -> Eagle3Model | PreTrainedModel | None:
    """A drafter's own model (an `Eagle3Model` or a causal LM), or None for model-free drafters and none."""
    return drafter.model if isinstance(drafter, Eagle3Drafter | ModelDrafter) else None


class RolloutTurn(NamedTuple):
    """One generation turn: the prompts (tool results included after a rollout's first turn) and what the policy
    sampled after them, in `seconds`; `spec_stats`: vLLM's acceptance over the turn (None on trl-tlt's engine);
    `features`: the policy's hidden states the engine recorded for drafter training, per row (None: none);
    `batch_sizes`: the engine's active batch size at each decode step (None: not the engine's turn)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    seconds: float
    spec_stats: dict[str, float] | None = None
    features: list[torch.Tensor] | None = None
    batch_sizes: list[int] | None = None
