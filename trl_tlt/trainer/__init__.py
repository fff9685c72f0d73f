"""`TLTGRPOTrainer`: the trainer's wiring (`trainer.py`) and the concerns it mixes in, one module each."""

from ..vllm_check import SAMPLING_LOGPROB_TOLERANCE
from .drafter_checkpoints import DRAFTER_DIR, ROLLOUT_STATE_NAME
from .trainer import TLTGRPOTrainer


__all__ = ["DRAFTER_DIR", "ROLLOUT_STATE_NAME", "SAMPLING_LOGPROB_TOLERANCE", "TLTGRPOTrainer"]
