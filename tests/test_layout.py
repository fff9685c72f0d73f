"""The tree shows the design: the layer map in docs/development.md holds for every import, and no file, function
or `TLTGRPOTrainer` outgrows its limit."""

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
    """Module -> layer index, from the table in docs/development.md ("| layer | modules |")."""
    text = (ROOT / "docs" / "development.md").read_text()
    rows = re.findall(r"^\| (\w+) \| (`.+`) \|$", text, flags=re.M)
    assert [name for name, _ in rows] == ["core", "drafters", "engine", "trainer", "tooling"], rows
    return {module: index for index, (_, cell) in enumerate(rows) for module in re.findall(r"`([\w.]+)`", cell)}


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


def test_every_module_is_in_the_layer_map_and_imports_only_downward():
    layer_of, modules = layers(), sources()
    assert set(modules) == set(layer_of), (
        f"docs/development.md's layer map misses {sorted(set(modules) - set(layer_of))} "
        f"or names modules that do not exist {sorted(set(layer_of) - set(modules))}"
    )
    upward = [
        f"{module} ({layer_of[module]}) imports {target} ({layer_of[target]})"
        for module, path in modules.items()
        for target in internal_imports(module, path)
        if target in layer_of and layer_of[target] > layer_of[module]
    ]
    assert not upward, upward
    missing = [
        f"{module} imports {target}, which does not exist"
        for module, path in modules.items()
        for target in internal_imports(module, path, modules_only=True)
        if target and target not in modules
    ]
    assert not missing, missing


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
    """Negative control: an upward import, or a module missing from the map, makes the check fail."""
    modules = dict(sources())
    fake = tmp_path / "sampling.py"
    if broken == "upward":
        fake.write_text("from .trainer import TLTGRPOTrainer\n")
        modules["sampling"] = fake
    else:
        fake.write_text("")
        modules["brand_new"] = fake
    monkeypatch.setattr(__import__(__name__), "sources", lambda: modules)
    with pytest.raises(AssertionError):
        test_every_module_is_in_the_layer_map_and_imports_only_downward()


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
