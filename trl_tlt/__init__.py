"""trl-tlt: TLT ("Taming the Long Tail") for Hugging Face TRL.

`TLTGRPOTrainer` / `TLTConfig` are drop-in replacements for TRL's `GRPOTrainer` / `GRPOConfig` whose rollouts
use lossless speculative decoding.
"""

import importlib

from . import _moved


__version__ = "0.1.0.dev0"
__all__ = ["TLTConfig", "TLTGRPOTrainer", "__version__"]

# Imported on first use: vLLM imports `trl_tlt.vllm_cpu_fix` (its plugin) in every engine process, which must not pull
# in TRL and the trainer.
_LAZY = {"TLTConfig": ".config", "TLTGRPOTrainer": ".trainer"}


_moved.install()


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
