"""Triton kernels for the speculative hot path, installed as `trl_tlt.kernels` (not a top-level `kernels`).

Each kernel has a torch reference in `trl_tlt` that the engine uses off CUDA; `trl_tlt.rejection_sampler.use_triton`
dispatches. Tests run the kernels on CPU with `TRITON_INTERPRET=1`.
"""

from .verify import verify_triton


__all__ = ["verify_triton"]
