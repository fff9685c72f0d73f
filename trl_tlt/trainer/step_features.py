"""The drafter's data from the training step: the policy's hidden states at the layers the drafter reads, recorded by
hooks on the policy's own forward in GRPO's loss computation (NeMo-RL's and AReaL's source), for every completion the
step trains on.

That forward runs on every rank under every launch mode (DDP, FSDP, ZeRO-3, vLLM's rollouts): activations are whole on
each rank even where parameters are shards, so the drafter gets its data with no forward of its own and no collective.
The states are detached (the drafter never sends a gradient into the policy) and kept in host memory, within the
buffer's memory cap. `TLTGRPOTrainer` records the first pass over each generation batch (not the repeats of
`num_iterations > 1`, whose policy has moved) and trains the drafter once the batch's last loss forward is done.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from ..engine.features import SequenceFeatures


def row_tokens(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Each row's tokens under its mask (left-padded prompts, right-padded completions)."""
    return [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]


@dataclass
class StepFeatures:
    """What the loss forwards of one generation batch recorded for drafter training: each row's prompt, completion and
    states (`SequenceFeatures.claim`: (len - 1, m, H), None where recording stopped at the memory cap or the row's mask
    has a hole).

    Args:
        layers: `LayerTap` ids (the drafter's auxiliary layers, then the final norm's output).
        max_bytes: What the states may hold in all (the buffer's memory cap, less what it holds).
        version: The policy's optimizer steps when they were computed.
    """

    layers: list[int]
    max_bytes: int
    version: int
    prompts: list[list[int]] = field(default_factory=list)
    completions: list[list[int]] = field(default_factory=list)
    features: list[torch.Tensor | None] = field(default_factory=list)
    num_bytes: int = 0

    @contextlib.contextmanager
    def recording(self, model: PreTrainedModel, inputs: dict):
        """Within it, the forwards of `model` over the micro-batch `inputs` (GRPOTrainer's: `prompt_ids`, `prompt_mask`,
        `completion_ids`, `completion_mask`) record its rows; on exit each row claims its states."""
        sink = SequenceFeatures(self.layers, max_bytes=max(self.max_bytes - self.num_bytes, 0))
        with sink.recording(model):
            yield
        prompts = row_tokens(inputs["prompt_ids"], inputs["prompt_mask"])
        completions = row_tokens(inputs["completion_ids"], inputs["completion_mask"])
        for prompt, completion in zip(prompts, completions, strict=True):
            states = sink.claim(prompt + completion) if completion else None
            self.prompts.append(prompt)
            self.completions.append(completion)
            self.features.append(states)
        self.num_bytes += sink.num_bytes
