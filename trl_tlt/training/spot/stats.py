"""`SpotStats`: what one spot phase did on a rank, and its summary over all ranks."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpotStats:
    """What one spot phase (between the end of this rank's rollout and the next RL work) did on this rank."""

    idle_seconds: float = 0.0  # this rank's wait for the others (0 with one process)
    seconds_used: float = 0.0  # time spent on drafter steps (and held-out evaluation)
    steps: int = 0  # drafter optimizer steps completed
    preempted: int = 0  # drafter steps abandoned because the other ranks were done
    resets: int = 0  # drafter steps discarded, or weights rolled back, because something was not finite
    losses: list[float] = field(default_factory=list)
    eval_acceptance_length: float | None = None  # estimate on the latest rollout's sequences it never trained on
    expected_speedup: float | None = None  # one process: the rollout's, speculating with it (`expected_speedup`)
    skipped: bool = False  # one process: the phase was skipped whole (a drafter that does not pay, left idle)
    budget_seconds: float | None = None  # one process: the credit the time budget gave this phase
    draft_vocab_coverage: float | None = None  # share of the latest rollout's tokens in the draft vocabulary
    draft_vocab_revised: bool = False  # the draft vocabulary was re-chosen at this phase
    refused: bool = False  # several processes: a rank could not train this rollout (`run_while_idle(refuse=True)`)
    summary: dict = field(default_factory=dict)  # over all ranks: total steps, mean seconds, mean loss

    def _local_totals(self) -> list[float]:
        evaluated = self.eval_acceptance_length is not None
        return [
            float(self.steps), self.idle_seconds, self.seconds_used, sum(self.losses),
            self.eval_acceptance_length or 0.0, float(evaluated), float(self.resets), 1.0,
        ]  # fmt: skip

    def summarize(self, totals: list[float]) -> None:
        steps, idle, used, loss_sum, eval_sum, evaluated, resets, ranks = totals
        self.summary = {
            "steps": steps,
            "resets": resets,
            "idle_seconds": idle / ranks,
            "seconds_used": used / ranks,
            "loss": loss_sum / steps if steps else None,
            "eval_acceptance_length": eval_sum / evaluated if evaluated else None,
        }
