"""Deprecated aliases: the old import paths of moved modules, kept for one release.

Each still imports (and runs with `python -m`), with a FutureWarning that names the new path. They go in the release
after 0.1 (CHANGELOG, Deprecated).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings


MOVED = {
    "trl_tlt.cli": "trl_tlt.tooling.cli",
    "trl_tlt.demo": "trl_tlt.tooling.demo",
    "trl_tlt.selector": "trl_tlt.engine.speculation",
    "trl_tlt.selector_sim": "trl_tlt.tooling.selector_sim",
    "trl_tlt.speculative": "trl_tlt.engine.rejection_sampler",
    "trl_tlt.simulator": "trl_tlt.tooling.simulator",
    "trl_tlt.tiny": "trl_tlt.tooling.tiny",
    "trl_tlt.warm_start": "trl_tlt.tooling.warm_start",
    "trl_tlt.workload": "trl_tlt.tooling.workload",
    "trl_tlt.workload.builds": "trl_tlt.tooling.workload.builds",
    "trl_tlt.workload.evaluate": "trl_tlt.tooling.workload.evaluate",
    "trl_tlt.workload.task": "trl_tlt.tooling.workload.task",
    "trl_tlt.workload.__main__": "trl_tlt.tooling.workload.__main__",
    # the layers as folders (#46): engine/, training/, vllm/
    "trl_tlt.sampling": "trl_tlt.engine.sampling",
    "trl_tlt.kv_cache": "trl_tlt.engine.kv_cache",
    "trl_tlt.rejection_sampler": "trl_tlt.engine.rejection_sampler",
    "trl_tlt.tree": "trl_tlt.engine.tree",
    "trl_tlt.speculation": "trl_tlt.engine.speculation",
    "trl_tlt.stats": "trl_tlt.engine.stats",
    "trl_tlt.drafters.base": "trl_tlt.engine.draft",
    "trl_tlt.drafter_training": "trl_tlt.training.distillation",
    "trl_tlt.micro_batching": "trl_tlt.training.micro_batching",
    "trl_tlt.spot": "trl_tlt.training.spot",
    "trl_tlt.spot.buffer": "trl_tlt.training.spot.buffer",
    "trl_tlt.spot.schedule": "trl_tlt.training.spot.schedule",
    "trl_tlt.spot.trainer": "trl_tlt.training.spot.trainer",
    "trl_tlt.vllm_generation": "trl_tlt.vllm.generation",
    "trl_tlt.vllm_check": "trl_tlt.vllm.check",
    "trl_tlt.vllm_cpu_fix": "trl_tlt.vllm.cpu_fix",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old path as a module that forwards every attribute to the new one (the same objects)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        is_package = importlib.util.find_spec(MOVED[fullname]).submodule_search_locations is not None
        return importlib.util.spec_from_loader(fullname, self, is_package=is_package)

    def create_module(self, spec):
        return types.ModuleType(spec.name)

    def exec_module(self, module):
        new = MOVED[module.__name__]
        warnings.warn(f"`{module.__name__}` moved to `{new}`; import that instead.", FutureWarning, stacklevel=2)
        target = importlib.import_module(new)
        module.__getattr__ = lambda name: getattr(target, name)
        module.__doc__ = target.__doc__

    def get_code(self, fullname):
        """`python -m <old path>` runs the new module as __main__ (a package's `__main__`, by the package's name)."""
        fullname = fullname.removesuffix(".__main__")
        new = MOVED[fullname]
        source = (
            f"import runpy, warnings\nwarnings.warn('`python -m {fullname}` moved to `python -m {new}`.', "
            f"FutureWarning)\nrunpy.run_module({new!r}, run_name='__main__', alter_sys=True)\n"
        )
        return compile(source, f"<moved: {fullname}>", "exec")


def install() -> None:
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.append(_Alias())
