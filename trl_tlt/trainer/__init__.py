"""`TLTGRPOTrainer`: the trainer's wiring (`trainer.py`) and the concerns it mixes in, one module each."""

from .drafter_checkpoints import DRAFTER_DIR, SPOT_STATE_NAME
from .trainer import TLTGRPOTrainer
from .vllm_rollouts import SAMPLING_LOGPROB_TOLERANCE


__all__ = ["DRAFTER_DIR", "SAMPLING_LOGPROB_TOLERANCE", "SPOT_STATE_NAME", "TLTGRPOTrainer"]
