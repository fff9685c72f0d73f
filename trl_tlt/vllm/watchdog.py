"""`DrafterWatchdog`: notices a drafter that died silently inside vLLM (its acceptance collapsed)."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class DrafterWatchdog:
    """Watches vLLM's acceptance for a drafter that died silently (draft weights wiped or stale after a wake-up or a
    sync: acceptance falls to ~1 with no error).

    `observe` reads each rollout's acceptance length against the recent level (median accepted tokens per verify
    step over the last `window` healthy rollouts, once `min_history` are known and the level is at least
    `min_level`): below `collapse_fraction` of it is a collapse. The first collapse answers "repush" (push the
    drafter again); a second in a row answers "off" (turn speculation off). A healthy rollout resets it.
    """

    collapse_fraction: float = 0.5
    window: int = 4
    min_history: int = 2
    min_level: float = 0.25
    history: deque = field(init=False)  # accepted tokens per verify step of the last `window` healthy rollouts
    repushed: bool = False

    def __post_init__(self):
        self.history = deque(maxlen=self.window)

    def observe(self, acceptance_length: float) -> str | None:
        accepted = acceptance_length - 1.0
        level = statistics.median(self.history) if len(self.history) >= self.min_history else None
        if level is not None and level >= self.min_level and accepted < self.collapse_fraction * level:
            verdict = "off" if self.repushed else "repush"
            self.repushed = True
            return verdict
        self.repushed = False
        self.history.append(accepted)
        return None

    def repush_message(self, acceptance_length: float) -> str:
        return (
            f"vLLM's acceptance length fell to {acceptance_length:.2f} against a recent level of "
            f"{1 + statistics.median(self.history):.2f}: its draft weights look wiped or stale; the drafter is pushed "
            "again."
        )

    @staticmethod
    def verify_totals(spec_stats: list[dict[str, float]]) -> list[float]:
        """[verify steps, accepted draft tokens] over turns' acceptance stats (`TLTVLLMGeneration.spec_decode_stats`)."""
        steps = sum(s["verify_steps"] for s in spec_stats)
        return [steps, sum(s["verify_steps"] * (s["mean_acceptance_length"] - 1.0) for s in spec_stats)]
