"""Training around the policy's: the drafter's distillation (`distillation.py`, offline and in spot training's steps),
spot training (`spot/`: the drafter trained online in the time the long tail leaves) and the training phase's layout
without the tail's padding (`micro_batching.py`)."""
