"""`PromptHistory`: each prompt's completions from its latest rollout, kept across steps for the history source.

GRPO sees the same prompts again (later epochs, repeated prompts); the completions the policy sampled for a prompt
last time predict much of what it samples now. The store is bounded and ages with the policy:

- per prompt, only its latest rollout is kept: a prompt's new completions replace the old ones (the policy moved);
- beyond `max_tokens` tokens in all (prompts and completions), the prompts seen longest ago are dropped first.

It lives on one rank (each rank keeps the prompts it generated) and goes into checkpoints (`state_dict`).
"""

from __future__ import annotations

from collections import OrderedDict


class PromptHistory:
    """Bounded store: prompt token ids -> the completions of its latest rollout.

    Args:
        max_tokens: Memory budget in tokens (prompts and completions); 0 keeps nothing.

    Example:
        >>> history = PromptHistory(max_tokens=1 << 20)
        >>> history.add(prompt_ids, completion_ids)     # after each rollout (rows of one prompt side by side)
        >>> history.get(prompt_ids[0])                  # that prompt's completions, oldest policy first dropped
    """

    def __init__(self, max_tokens: int):
        if max_tokens < 0:
            raise ValueError(f"`max_tokens` must be >= 0 (0 keeps nothing), got {max_tokens}.")
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[int, ...], list[list[int]]] = OrderedDict()
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, prompt: list[int]) -> list[list[int]]:
        return self._entries.get(tuple(prompt), [])

    def add(self, prompts: list[list[int]], completions: list[list[int]]) -> None:
        """Record one rollout: the completions of each prompt replace that prompt's earlier ones."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions.")
        rollout: dict[tuple[int, ...], list[list[int]]] = {}
        for prompt, completion in zip(prompts, completions, strict=True):
            if completion:
                rollout.setdefault(tuple(prompt), []).append(list(completion))
        for key, kept in rollout.items():
            self._drop(key)
            self._entries[key] = kept
            self.num_tokens += _size(key, kept)
        while self.num_tokens > self.max_tokens and self._entries:
            self._drop(next(iter(self._entries)))  # the prompt seen longest ago

    def _drop(self, key: tuple[int, ...]) -> None:
        kept = self._entries.pop(key, None)
        if kept is not None:
            self.num_tokens -= _size(key, kept)

    def state_dict(self) -> dict:
        return {"max_tokens": self.max_tokens, "entries": [[list(k), v] for k, v in self._entries.items()]}

    def load_state_dict(self, state: dict) -> None:
        """Restore a saved store (oldest first), within this store's own `max_tokens`."""
        self._entries.clear()
        self.num_tokens = 0
        for prompt, kept in state["entries"]:
            self.add([prompt] * len(kept), kept)


def _size(prompt: tuple[int, ...], completions: list[list[int]]) -> int:
    return len(prompt) + sum(len(c) for c in completions)
