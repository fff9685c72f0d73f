"""The drafter's data buffer: the last rollouts' token sequences, bounded in tokens, every eighth held out."""

from __future__ import annotations

import random
from collections import deque

from ..distillation import DrafterSample


HELD_OUT_EVERY = 8  # every 8th buffered sequence is held out for `evaluate`


def take_tokens(samples: list[DrafterSample], max_tokens: int) -> list[DrafterSample]:
    """The leading sequences that fit in `max_tokens` (at least one, if any)."""
    taken, total = [], 0
    for s in samples:
        if taken and total + len(s.token_ids) > max_tokens:
            break
        taken.append(s)
        total += len(s.token_ids)
    return taken


class DataBuffer:
    """Prompt + completion token ids of the last `window` rollouts, at most `max_tokens` tokens in all.

    Args:
        window: Rollouts kept (TLT's one-step offset: 2 = the current and the previous rollout).
        max_tokens: Memory budget in tokens (8 bytes each); the oldest sequences go first when it is exceeded.
    """

    def __init__(self, window: int = 2, max_tokens: int = 262_144):
        if window < 1:
            raise ValueError(f"`window` must be >= 1, got {window}.")
        if max_tokens < 1:
            raise ValueError(f"`max_tokens` must be >= 1, got {max_tokens}.")
        self.window, self.max_tokens = window, max_tokens
        self.rollouts: deque[list[DrafterSample]] = deque()
        self.held_out: list[DrafterSample] = []  # of the latest rollout only: "recent"
        self.num_added = 0

    def add(self, prompts: list[list[int]], completions: list[list[int]]) -> None:
        """One rollout; empty completions are skipped (nothing to learn)."""
        train, held_out = [], []
        for prompt, completion in zip(prompts, completions, strict=True):
            if not completion:
                continue
            sample = DrafterSample(list(prompt) + list(completion), len(prompt))
            self.num_added += 1
            (held_out if self.num_added % HELD_OUT_EVERY == 0 else train).append(sample)
        self.rollouts.append(train)
        self.held_out = held_out
        while len(self.rollouts) > self.window:
            self.rollouts.popleft()
        while self.num_tokens > self.max_tokens and any(self.rollouts):
            oldest = next(r for r in self.rollouts if r)
            oldest.pop(0)

    @property
    def samples(self) -> list[DrafterSample]:
        return [s for rollout in self.rollouts for s in rollout]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)

    def sample(self, max_tokens: int, rng: random.Random) -> list[DrafterSample]:
        """Sequences drawn uniformly without replacement until `max_tokens` (at least one, if any)."""
        pool = self.samples
        rng.shuffle(pool)
        return take_tokens(pool, max_tokens)

    def state_dict(self) -> dict:
        """The buffered sequences (a resumed run trains on what the uninterrupted one would) and the count that decides
        which are held out."""

        def rows(samples):
            return [(s.token_ids, s.prompt_length) for s in samples]

        return {
            "num_added": self.num_added,
            "rollouts": [rows(rollout) for rollout in self.rollouts],
            "held_out": rows(self.held_out),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a saved buffer (one saved without its sequences, before they were checkpointed, restores the count
        alone: the next rollouts refill it)."""
        self.num_added = int(state["num_added"])
        self.rollouts = deque([DrafterSample(list(t), int(n)) for t, n in r] for r in state.get("rollouts", []))
        self.held_out = [DrafterSample(list(t), int(n)) for t, n in state.get("held_out", [])]
