"""The tree shows the design: the folders are the layers of docs/development.md's table and every import runs down
them, the trainer keeps its state where its `__init__` puts it, no test imports another, and no file, function or
`TLTGRPOTrainer` outgrows its limit. Each check has a negative control."""

import ast
import re
from pathlib import Path

import pytest


ROOT = Path(__file__).parent.parent
MAX_FILE_LINES, MAX_FUNCTION_LINES, MAX_TRAINER_LINES = 500, 80, 400


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "trl_tlt":
        parts = parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def sources() -> dict[str, Path]:
    files = sorted((ROOT / "trl_tlt").rglob("*.py")) + sorted((ROOT / "kernels").rglob("*.py"))
    return {module_name(path): path for path in files if module_name(path)}


def layers() -> dict[str, int]:
    """Folder -> layer index, from the table in docs/development.md ("| layer | folder | what |"); "" is the core."""
    text = (ROOT / "docs" / "development.md").read_text()
    rows = re.findall(r"^\| (\w+) \| `(?:trl_tlt/|(\w+)/)` \|", text, flags=re.M)
    assert [name for name, _ in rows] == ["core", "engine", "drafters", "training", "vllm", "trainer", "tooling"], rows
    return {folder: index for index, (_, folder) in enumerate(rows)}


def layer_of(module: str) -> str:
    """A module's layer: its folder under trl_tlt/ ("" for the modules directly in trl_tlt/ and for the kernels)."""
    top = module.split(".")[0]
    return "" if top == "kernels" or "." not in module and not (ROOT / "trl_tlt" / top).is_dir() else top


def internal_imports(module: str, path: Path, modules_only: bool = False) -> set[str]:
    """The trl_tlt modules `path` imports at run time (not under `if TYPE_CHECKING:`), with `from m import x` also
    as `m.x` (x may be a module) unless `modules_only`."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(node)
        for branch in ast.walk(tree)
        if isinstance(branch, ast.If) and getattr(branch.test, "id", None) == "TYPE_CHECKING"
        for node in ast.walk(branch)
    }
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
            names = [] if modules_only else [f"{target}.{a.name}".strip(".") for a in node.names]
            found |= {target.strip(".")} | set(names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trl_tlt"):
            target = node.module.removeprefix("trl_tlt").strip(".")
            found |= {target} | (set() if modules_only else {f"{target}.{a.name}".strip(".") for a in node.names})
    return found


def test_the_folders_are_the_layers_and_imports_only_run_downward():
    layer_index, modules = layers(), sources()
    folders = {p.name for p in (ROOT / "trl_tlt").iterdir() if p.is_dir() and not p.name.startswith("__")}
    assert folders == set(layer_index) - {""}, (
        f"docs/development.md's layer table misses the folders {sorted(folders - set(layer_index))} or names folders "
        f"that do not exist {sorted(set(layer_index) - {''} - folders)}"
    )
    upward = [
        f"{module} ({layer_of(module) or 'core'}) imports {target} ({layer_of(target) or 'core'})"
        for module, path in modules.items()
        for target in internal_imports(module, path)
        if target in modules and layer_index[layer_of(target)] > layer_index[layer_of(module)]
    ]
    assert not upward, upward
    missing = [
        f"{module} imports {target}, which does not exist"
        for module, path in modules.items()
        for target in internal_imports(module, path, modules_only=True)
        if target and target not in modules
    ]
    assert not missing, missing


def test_the_library_never_imports_the_tooling_or_an_old_path():
    """Tooling sits beside the library: no module outside `trl_tlt.tooling` imports it, nor a moved module's old path."""
    from trl_tlt._moved import MOVED

    offending = [
        f"{module} imports {target}"
        for module, path in sources().items()
        if not module.startswith("tooling")
        for target in internal_imports(module, path, modules_only=True)
        if target.startswith("tooling") or f"trl_tlt.{target}" in MOVED
    ]
    assert not offending, offending


def attributes_set_outside_init(path: Path) -> list[str]:
    """`self.x = ...` in a method of `TLTGRPOTrainer` other than `__init__` (the trainer owns what `__init__` sets; what
    a rollout adds lives on its `RolloutStack`), and `trainer.x = ...` anywhere in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == "TLTGRPOTrainer":
            for method in node.body:
                if isinstance(method, ast.FunctionDef) and method.name != "__init__":
                    found += [f"{method.name} sets self.{a}" for a in _assigned(method, "self")]
        elif isinstance(node, ast.FunctionDef):
            found += [f"{node.name} sets trainer.{a}" for a in _assigned(node, "trainer")]
    return found


def _assigned(function: ast.FunctionDef, name: str) -> list[str]:
    targets = []
    for node in ast.walk(function):
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for part in ast.walk(target):
                    if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) and part.value.id == name:
                        if part in _direct_targets(target):
                            targets.append(part.attr)
    return targets


def _direct_targets(target: ast.AST) -> list[ast.AST]:
    """The attribute nodes a target assigns (`a.x = `, `a.x, b = `), not those it only reads (`a.x[i] = `)."""
    if isinstance(target, ast.Tuple | ast.List):
        return [t for element in target.elts for t in _direct_targets(element)]
    return [target]


def test_the_trainer_sets_its_attributes_in_init_only():
    problems = [f"{path.name}: {p}" for path in (ROOT / "trl_tlt" / "trainer").glob("*.py") for p in
                attributes_set_outside_init(path)]  # fmt: skip
    assert not problems, problems


def test_the_attribute_check_fails_on_a_method_that_sets_one(tmp_path):
    """Negative control: a hook that keeps state on the trainer, or a helper that writes one, is found."""
    source = tmp_path / "trainer.py"
    source.write_text(
        "class TLTGRPOTrainer:\n    def __init__(self):\n        self.ok = 1\n"
        "    def _generate(self, prompts):\n        self.turns = []\n        self.tlt.turns = []\n"
        "        self._metrics['train'] = {}\n\n"
        "def helper(trainer):\n    trainer.args.spot_training, trainer.flag = False, True\n"
    )
    assert attributes_set_outside_init(source) == ["_generate sets self.turns", "helper sets trainer.flag"]


def test_no_test_imports_another_test_module():
    """Shared helpers live in tests/testing_utils.py: a test module importing another runs its fixtures and its
    collection side effects, and couples files that should stand alone."""
    test_modules = {p.stem for p in (ROOT / "tests").glob("test_*.py")}
    offending = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in test_modules:
                offending.append(f"{path.name} imports {node.module}")
            elif isinstance(node, ast.Import):
                offending += [f"{path.name} imports {a.name}" for a in node.names if a.name in test_modules]
    assert not offending, offending


def sizes() -> dict[str, int]:
    """Lines of every file, function and method (`path:Class.method`), and of `TLTGRPOTrainer`."""
    out = {}
    for path in sources().values():
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        out[rel] = len(text.splitlines())
        tree = ast.parse(text)
        for node in tree.body:
            members = node.body if isinstance(node, ast.ClassDef) else [node]
            prefix = f"{node.name}." if isinstance(node, ast.ClassDef) else ""
            for member in members:
                if isinstance(member, ast.FunctionDef | ast.AsyncFunctionDef):
                    out[f"{rel}:{prefix}{member.name}"] = member.end_lineno - member.lineno + 1
            if isinstance(node, ast.ClassDef) and node.name == "TLTGRPOTrainer":
                out[f"{rel}:{node.name}"] = node.end_lineno - node.lineno + 1
    return out


def limit(name: str) -> int:
    if name.endswith(":TLTGRPOTrainer"):
        return MAX_TRAINER_LINES
    return MAX_FUNCTION_LINES if ":" in name else MAX_FILE_LINES


def test_no_file_function_or_trainer_outgrows_its_limit():
    measured = sizes()
    over = {name: n for name, n in measured.items() if n > limit(name)}
    assert not over, f"over the limit (split them): {over}"


@pytest.mark.parametrize("broken", ["upward", "unmapped"])
def test_the_layer_check_fails_on_a_broken_tree(broken, monkeypatch, tmp_path):
    """Negative control: an upward import, or a folder missing from the table, makes the check fail."""
    modules = dict(sources())
    if broken == "upward":
        fake = tmp_path / "sampling.py"
        fake.write_text("from ..trainer import TLTGRPOTrainer\n")
        modules["engine.sampling"] = fake
        monkeypatch.setattr(__import__(__name__), "sources", lambda: modules)
    else:
        rows = {folder: index for folder, index in layers().items() if folder != "vllm"}
        monkeypatch.setattr(__import__(__name__), "layers", lambda: rows)
    with pytest.raises((AssertionError, KeyError)):
        test_the_folders_are_the_layers_and_imports_only_run_downward()


KINDS = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")


def changelog_problems(text: str) -> list[str]:
    """Keep a Changelog, kept short: under each release one heading per kind, one line per change."""
    problems = []
    for release in re.split(r"^## ", text, flags=re.M)[1:]:
        name = release.splitlines()[0]
        kinds = re.findall(r"^### (.+)$", release, flags=re.M)
        problems += [f"{name}: unknown heading {k!r}" for k in kinds if k not in KINDS]
        problems += [f"{name}: heading {k!r} twice" for k in set(kinds) if kinds.count(k) > 1]
        problems += [
            f"{name}: a change runs on: {line[:60]!r}" for line in release.splitlines() if line.startswith("  ")
        ]
    return problems


def test_changelog_has_one_heading_per_kind_and_one_line_per_change():
    assert not changelog_problems((ROOT / "CHANGELOG.md").read_text())


@pytest.mark.parametrize(
    "broken", ["## [1.0]\n### Added\n- a\n### Added\n- b\n", "## [1.0]\n### Added\n- a change that\n  runs on\n"]
)
def test_the_changelog_check_fails_on_a_heading_twice_or_a_change_that_runs_on(broken):
    assert changelog_problems(broken)
