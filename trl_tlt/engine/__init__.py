"""The speculative engine: batched, lossless speculative generation for any Hugging Face causal LM (CPU and GPU).

`generate.py` is the loop (`SpeculativeEngine`); `draft.py` the interface drafters implement; `sampling.py` the logits
processing `generate` applies; `rejection_sampler.py` chain verification (the fused Triton kernel in the top-level
`kernels/`, installed as `trl_tlt.kernels`); `tree.py` tree drafting and verification; `kv_cache.py` the ragged,
preallocated KV cache; `speculation.py` the policies choosing whether and how far to speculate; `stats.py` what a
call counts.
"""

from .draft import DRAFT_SOURCES, Draft, DraftContext, Drafter
from .generate import GenerationOutput, SpeculativeEngine
from .sampling import SamplingParams
from .speculation import Arm, BanditSpeculation, FixedSpeculation, SpeculationPolicy, tree_arm
from .stats import GenerationStats


__all__ = [
    "DRAFT_SOURCES", "Arm", "BanditSpeculation", "Draft", "DraftContext", "Drafter", "FixedSpeculation",
    "GenerationOutput", "GenerationStats", "SamplingParams", "SpeculationPolicy", "SpeculativeEngine", "tree_arm",
]  # fmt: skip
