"""`swapped`: trl-tlt's own part where TRL builds one of its own and offers no hook for it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def swapped(owner: object, name: str, value: object) -> Iterator[None]:
    """`owner.name` is `value` inside the block, and what it was again after it, error or not.

    The two places it serves: GRPOTrainer's `__init__` builds `VLLMGeneration` (the trainer's is built instead, with the
    drafter), and `VLLMGeneration._init_vllm` builds `LLM` with fixed arguments (the speculative configuration is
    added). A contract test pins both names in TRL's source (tests/test_trainer.py).
    """
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)
