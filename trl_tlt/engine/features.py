"""`FeatureRecorder`: the policy's hidden states at a few layers, for every position a rollout's forwards computed.

Drafter training needs, at every position of a rollout, the hidden states its drafter reads (an EAGLE-3 head's
auxiliary layers) and the last one (the policy's distribution there, through its LM head). The rollout's prefill and
verification forwards compute them all: the engine records each kept position as it goes, so drafter training never
runs the policy again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from .kv_cache import LayerTap


class FeatureRecorder:
    """Collects, per row of a `generate` call, the hidden states at `layers` of every position the policy forwarded.

    Args:
        layers: Layer ids (`LayerTap`'s: id i < L the input of decoder layer i, id L the final norm's output).
        num_rows: Rows of the call.
        device: Where the recorded states are kept (host memory by default, whatever the policy's device).
        max_bytes: What the recorded states may hold at most (None: no bound). Recording stops before a forward's
            states would pass it: rows finished by then keep their features, the others get none (drafter training
            runs the policy over them, or drops them), so the recorder never holds more than `max_bytes`.

    A row's positions are recorded in order: its prompt's at prefill, then at each decode step the positions the cache
    keeps (the last token and the accepted drafts), each row's in storage of its own. After generation `rows(lengths)`
    returns (n_i, len(layers), H) per row: position t's states, for t < n_i (a row of prompt + completion N tokens has
    N - 1 forwarded positions), or None for a row whose recording stopped.
    """

    def __init__(
        self, layers: Sequence[int], num_rows: int, device: str | torch.device = "cpu", max_bytes: int | None = None
    ):
        self.layers, self.num_rows, self.device = tuple(layers), num_rows, torch.device(device)
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.stopped = False  # `max_bytes` was reached: nothing more is recorded
        self._pieces: list[list[torch.Tensor]] = [[] for _ in range(num_rows)]
        self._complete: set[int] = set()  # rows finished before recording stopped

    def record(self, hidden_states, row_ids: torch.Tensor, kept: torch.Tensor) -> None:
        """One forward's states (`hidden_states[layer]`: (B, n, H)) at the positions `kept` (B, n) of rows `row_ids`,
        each row's moved to `device` on its own (no copy of the whole forward stays alive)."""
        if self.stopped:
            return
        width = kept.size(1)
        first = hidden_states[self.layers[0]]
        counts = kept.sum(dim=1).tolist()
        # sized before anything is stacked: a forward past the budget allocates nothing
        size = sum(counts) * len(self.layers) * first.size(-1) * first.element_size()
        if self.max_bytes is not None and self.num_bytes + size > self.max_bytes:
            self.stopped = True
            return
        self.num_bytes += size
        # only the kept positions, (N, m, H) for N = sum(counts), moved in one copy and split per row on the host
        flat = kept.flatten()
        states = torch.stack([hidden_states[i][:, :width].flatten(0, 1)[flat] for i in self.layers], dim=1)
        pieces = states.to(self.device, copy=True).split(counts)
        for row, piece, count in zip(row_ids.tolist(), pieces, counts, strict=True):
            if count:
                self._pieces[row].append(piece)

    def finished(self, row_ids: torch.Tensor) -> None:
        """These rows emitted their last token: what they recorded so far is their whole sequence."""
        if not self.stopped:
            self._complete.update(row_ids.tolist())

    def rows(self, lengths: Sequence[int]) -> list[torch.Tensor | None]:
        """Each row's first `lengths[i]` recorded positions, (lengths[i], len(layers), H), in storage of its own (one
        row's pieces joined at a time); None for a row whose recording stopped before it finished. Empties it."""
        rows = []
        for row, n in enumerate(lengths):
            pieces, self._pieces[row] = self._pieces[row], []
            if not pieces or (self.stopped and row not in self._complete):
                rows.append(None)
                continue
            states = torch.cat(pieces)
            rows.append(states if len(states) == n else states[:n].clone())  # drafts kept past an EOS: cut off
        self.num_bytes = 0
        return rows


PREFIX_INDEX = 16  # `SequenceFeatures` finds a row a sequence begins by its first tokens


class SequenceFeatures:
    """The policy's hidden states at `layers` over whole sequences, taken from a forward that runs anyway (the check
    of vLLM's samples, at the rollout's weights), for a rollout's rows to claim by their tokens: drafter training then
    runs no forward of its own over rollouts the engine did not record (vLLM's).

    Args:
        layers: Layer ids, as `FeatureRecorder`'s.
        device: Where the states are kept (host memory by default).
        max_bytes: What they may hold at most (None: no bound); rows past it are not recorded (their drafter training
            runs the policy, as before).

    Example:
        >>> sink = SequenceFeatures([1, 3, 5, 6])
        >>> with sink.recording(policy):
        ...     policy(input_ids=ids, attention_mask=mask)
        >>> sink.claim(prompt + completion)  # (len - 1, 4, H), or None
    """

    def __init__(self, layers: Sequence[int], device: str | torch.device = "cpu", max_bytes: int | None = None):
        self.layers, self.device, self.max_bytes = tuple(layers), torch.device(device), max_bytes
        self.num_bytes = 0
        self._rows: dict[tuple[int, ...], torch.Tensor] = {}
        self._by_start: dict[tuple[int, ...], list[tuple[int, ...]]] = {}  # first PREFIX_INDEX tokens -> rows

    @contextlib.contextmanager
    def recording(self, model):
        """Within it, every forward of `model` called with `input_ids` and `attention_mask` records its rows. A model
        whose layers cannot be tapped (`LayerTap.supported`) records nothing."""
        tap = LayerTap(model, self.layers)
        if not tap.supported:
            yield
            return
        with tap.capture() as states:

            def hook(module, args, kwargs, output):
                ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
                if ids is not None and mask is not None and all(i in states for i in self.layers):
                    self.record(ids, mask, states)

            handle = model.register_forward_hook(hook, with_kwargs=True)
            try:
                yield
            finally:
                handle.remove()

    def record(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, hidden_states) -> None:
        """One forward's rows (`input_ids`, `attention_mask`: (B, T), padded on either side; `hidden_states[layer]`:
        (B, T, H)). A row whose mask is not one run of ones (a hole changes the positions after it) is skipped."""
        width = len(self.layers) * hidden_states[self.layers[0]].size(-1)
        element = hidden_states[self.layers[0]].element_size()
        for b, (ids, mask) in enumerate(zip(input_ids, attention_mask.bool(), strict=True)):
            where = mask.nonzero().flatten().tolist()
            if len(where) < 2 or where[-1] - where[0] + 1 != len(where):
                continue
            start, end = where[0], where[-1] + 1
            size = (end - start - 1) * width * element
            if self.max_bytes is not None and self.num_bytes + size > self.max_bytes:
                return
            self.num_bytes += size
            # detached: a training forward's states belong to its autograd graph, which must not outlive its backward
            row = torch.stack(
                [hidden_states[i][b, start : end - 1].detach() for i in self.layers], dim=1
            )  # (n-1, m, H)
            key = tuple(ids[start:end].tolist())
            self._rows[key] = row.to(self.device)
            self._by_start.setdefault(key[:PREFIX_INDEX], []).append(key)

    def claim(self, tokens: Sequence[int]) -> torch.Tensor | None:
        """The states of the sequence `tokens` at every position but the last, (len(tokens) - 1, m, H): those of a
        recorded row equal to it, or beginning with it (a causal policy's states at a prefix are the prefix's own: a
        tool turn's rows are prefixes of the final ones); None where no recorded row covers it."""
        key = tuple(tokens)
        if key in self._rows:
            return self._rows[key]
        # rows are indexed by their first tokens (a prompt's, shared by its group): few candidates to compare
        candidates = self._by_start.get(key[:PREFIX_INDEX], ()) if len(key) >= PREFIX_INDEX else self._rows
        for row_tokens in candidates:
            if len(row_tokens) > len(key) and row_tokens[: len(key)] == key:
                return self._rows[row_tokens][: len(key) - 1].clone()
        return None
