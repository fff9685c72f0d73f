"""Triton kernels for the speculative hot path, installed as `trl_tlt.kernels` (not a top-level `kernels`).

Each kernel has a torch reference in `trl_tlt` that the engine uses off CUDA; `trl_tlt.rejection_sampler.use_triton`
dispatches. Tests run the kernels on CPU with `TRITON_INTERPRET=1`.

Where the repository root is on `sys.path` (`python -m ...` run there), this folder is also importable as a top-level
`kernels`, the name of Hugging Face's kernels package, which transformers >= 5.18 imports. Imported under that name, it
hands the name over to that package when one is installed (and is an empty module otherwise), so that it never
shadows it.
"""

import sys


if __name__ == "kernels":
    import importlib.util
    import os
    from importlib.machinery import PathFinder

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = PathFinder.find_spec("kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _root])
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module  # what `import kernels` returns
        _spec.loader.exec_module(_module)
else:
    from .verify import verify_triton

    __all__ = ["verify_triton"]
