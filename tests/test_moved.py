"""Moved modules keep their old import paths for one release: same objects, a FutureWarning naming the new path."""

import importlib
import subprocess
import sys

import pytest

from trl_tlt._moved import MOVED


@pytest.mark.parametrize("old", sorted(m for m in MOVED if not m.endswith("__main__")))
def test_an_old_path_imports_the_new_module_with_a_warning(old):
    sys.modules.pop(old, None)
    with pytest.warns(FutureWarning, match=MOVED[old].replace(".", r"\.")):
        alias = importlib.import_module(old)
    new = importlib.import_module(MOVED[old])
    public = [name for name in vars(new) if not name.startswith("_")]
    assert public and all(getattr(alias, name) is getattr(new, name) for name in public)
    with pytest.raises(AttributeError):
        alias.no_such_name  # noqa: B018


@pytest.mark.parametrize(
    "command, prints",
    [("trl_tlt.cli accelerate-config zero3", "accelerate_configs/zero3.yaml"), ("trl_tlt.workload --help", "--drift")],
)
def test_an_old_path_still_runs_with_python_m(command, prints):
    old, *args = command.split()
    done = subprocess.run([sys.executable, "-m", old, *args], capture_output=True, text=True, check=True)
    assert prints in done.stdout
    assert f"moved to `python -m {MOVED[old]}`" in done.stderr
