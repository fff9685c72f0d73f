"""`TLTGRPOTrainer`: every GRPOTrainer hook it overrides in `trainer.py`, delegating to its `RolloutStack` (`stack.py`),
built from the config in one place (`build.py`); what it samples with and when it falls back to GRPOTrainer's
generation (`generation_settings.py`), its metrics (`metrics.py`), the drafter's export (`export.py`) and callbacks."""

from ..vllm.check import SAMPLING_LOGPROB_TOLERANCE
from .stack import DRAFTER_DIR, ROLLOUT_STATE_NAME, RolloutStack
from .trainer import TLTGRPOTrainer


__all__ = ["DRAFTER_DIR", "ROLLOUT_STATE_NAME", "SAMPLING_LOGPROB_TOLERANCE", "RolloutStack", "TLTGRPOTrainer"]
