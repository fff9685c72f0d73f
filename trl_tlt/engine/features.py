"""`FeatureRecorder`: the policy's hidden states at a few layers, for every position a rollout's forwards computed.

Drafter training needs, at every position of a rollout, the hidden states its drafter reads (an EAGLE-3 head's
auxiliary layers) and the last one (the policy's distribution there, through its LM head). The rollout's prefill and
verification forwards compute them all: the engine records each kept position as it goes, so drafter training never
runs the policy again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class FeatureRecorder:
    """Collects, per row of a `generate` call, the hidden states at `layers` of every position the policy forwarded.

    Args:
        layers: Layer ids (`LayerTap`'s: id i < L the input of decoder layer i, id L the final norm's output).
        num_rows: Rows of the call.
        device: Where the recorded states are kept (host memory by default, whatever the policy's device).

    A row's positions are recorded in order: its prompt's at prefill, then at each decode step the positions the cache
    keeps (the last token and the accepted drafts). After generation `rows(lengths)` returns (n_i, len(layers), H) per
    row: position t's states, for t < n_i (a row of prompt + completion N tokens has N - 1 forwarded positions).
    """

    def __init__(self, layers: Sequence[int], num_rows: int, device: str | torch.device = "cpu"):
        self.layers, self.num_rows, self.device = tuple(layers), num_rows, torch.device(device)
        self._states: list[torch.Tensor] = []
        self._owners: list[torch.Tensor] = []

    def record(self, hidden_states, row_ids: torch.Tensor, kept: torch.Tensor) -> None:
        """One forward's states (`hidden_states[layer]`: (B, n, H)) at the positions `kept` (B, n) of rows `row_ids`:
        each layer's kept positions go to `device` on their own (no stacked copy of the whole forward on the
        policy's device)."""
        width = kept.size(1)
        layers = [hidden_states[i][:, :width][kept].to(self.device) for i in self.layers]
        self._states.append(torch.stack(layers, dim=1))  # (kept positions, m, H)
        self._owners.append(row_ids[:, None].expand_as(kept)[kept].to(self.device))

    def rows(self, lengths: Sequence[int]) -> list[torch.Tensor]:
        """Each row's first `lengths[i]` recorded positions, (lengths[i], len(layers), H), each in storage of its own
        (a row kept alone keeps nothing else alive). The recorder is emptied."""
        states, owners = torch.cat(self._states), torch.cat(self._owners)
        self._states, self._owners = [], []
        rows = []
        for row, n in enumerate(lengths):
            positions = (owners == row).nonzero().squeeze(1)[:n]  # recorded in order
            rows.append(states.index_select(0, positions))
        return rows
