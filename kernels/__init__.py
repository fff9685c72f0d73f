"""Triton kernels for the speculative hot path, installed as `trl_tlt.kernels` (not a top-level `kernels`).

Each kernel has a torch reference in `trl_tlt` that the engine uses off CUDA; `trl_tlt.rejection_sampler.use_triton`
dispatches. Tests run the kernels on CPU with `TRITON_INTERPRET=1`.

Where the repository root is on `sys.path` (`python -m ...` run there), this folder is also importable as a top-level
`kernels`, the name of Hugging Face's kernels package, which transformers >= 5.18 imports. Imported under that name, it
hands the name over to that package when one is installed (any import finder, this folder excluded under whatever
path spelling) and is an empty module otherwise, so that it never shadows it.
"""

import sys


def _installed_kernels_spec():
    """The spec of another `kernels` than this folder, or None."""
    import os
    from importlib.machinery import PathFinder

    here = os.path.realpath(__file__)
    root = os.path.dirname(os.path.dirname(here))
    for finder in sys.meta_path:
        if finder is PathFinder:  # sys.path, without the entries that are this repository's root
            path = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]
            spec = PathFinder.find_spec("kernels", path)
        elif hasattr(finder, "find_spec"):
            spec = finder.find_spec("kernels", None)
        else:
            continue
        if spec is not None and spec.loader is not None and spec.origin and os.path.realpath(spec.origin) != here:
            return spec
    return None


if __name__ == "kernels":
    import importlib.util

    _spec = _installed_kernels_spec()
    if _spec is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module  # what `import kernels` returns
        _spec.loader.exec_module(_module)
else:
    from .verify import verify_triton

    __all__ = ["verify_triton"]
