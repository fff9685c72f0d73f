"""Spot training: the drafter learns from recent rollouts in the time a rank would otherwise idle.

`DataBuffer` keeps the token sequences of the last `window` rollouts (TLT's one-step-offset rule: the previous
rollout's long sequences balance the current one's early finishers) with the policy's hidden states their rollout
recorded, bounded in tokens and in memory; every eighth sequence is held out for evaluation. A sequence without
recorded states (a vLLM rollout) is forwarded through the policy when a drafter step draws it, or dropped where the
policy is sharded across processes.

`SpotTrainer` runs drafter optimizer steps:
- with several processes, on each rank from the moment its own rollouts are done until every rank's are: an
  asynchronous barrier on a dedicated gloo group is polled between (and inside) drafter steps, so the rank that
  finishes last never waits for more than one phase of a drafter step; then the ranks' drafters are merged by
  parameter averaging weighted by the steps each took, before anyone returns to RL work;
- with one process (no idle rank), between rollouts, within a time budget that `SpotBudget` sets from the drafter's
  measured acceptance (timed and reported).

`SpotSchedule` sets the learning rate from the drafter's step count: constant for a warm-started drafter; for a new
head, a cold start (a high learning rate, as offline warm starts use) that follows a cosine down to the warm regime
over `cold_steps` drafter steps. `SpotBudget` decides how much of the time budget a phase between rollouts spends,
from the acceptance the drafter measures on held-out rollouts (verl-SpeCo's acceptance-driven schedule): fast and
slow moving averages; all of it while a new head warms up and while acceptance falls (the policy drifts) or rises,
a quarter on a plateau, none for a drafter that accepts too little to pay for its drafting (probed again after 1,
2, 4, ... skipped phases).

A new EAGLE-3 head's draft vocabulary (`DraftVocabulary`) is revised at the start of a phase from the rollouts' token
counts (summed over ranks at the merge), its LM head rows and their optimizer moments carried along.
"""

from .buffer import HELD_OUT_EVERY, DataBuffer, take_tokens
from .schedule import SpotBudget, SpotSchedule
from .stats import SpotStats
from .trainer import SpotTrainer


__all__ = ["HELD_OUT_EVERY", "DataBuffer", "SpotBudget", "SpotSchedule", "SpotStats", "SpotTrainer", "take_tokens"]
