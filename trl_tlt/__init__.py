"""trl-tlt: TLT ("Taming the Long Tail") for Hugging Face TRL.

`TLTGRPOTrainer` / `TLTConfig` are drop-in replacements for TRL's `GRPOTrainer` / `GRPOConfig` whose rollouts
use lossless speculative decoding.
"""

__version__ = "0.1.0.dev0"

from .config import TLTConfig  # noqa: E402
from .trainer import TLTGRPOTrainer  # noqa: E402


__all__ = ["TLTConfig", "TLTGRPOTrainer", "__version__"]
