"""Every figure the docs quote from a record matches it, and every record says where it came from.

A quoted figure is a Markdown link from the number to the JSON key that holds it: `[2.42x](benchmarks/rollout_cpu.json#
spec_speedup_bs1)` (a dotted key path; list items by index; `%` quotes a fraction times 100; units x, %, s). README's bold figures
must be such links."""

import json
import re
from pathlib import Path

import pytest


ROOT = Path(__file__).parent.parent
FIGURE = re.compile(r"\[(-?\d+(?:\.\d+)?)(x|%| s)?\]\(([^()\s#]+\.json)#([^()\s]+)\)")
BOLD_NUMBER = re.compile(r"\*\*[^*]*\d[^*]*\*\*")
PROVENANCE = ("command", "commit", "machine", "seconds")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def lookup(record, key: str):
    for part in key.split("."):
        record = record[int(part)] if isinstance(record, list) else record[part]
    return record


def figure_problems(text: str, base: Path) -> list[str]:
    """Quoted figures that do not match their record (or whose record or key does not exist)."""
    problems = []
    for number, unit, path, key in FIGURE.findall(text):
        quoted = f"[{number}{unit}]({path}#{key})"
        try:
            value = lookup(json.loads((base / path).read_text()), key)
        except (OSError, KeyError, IndexError, ValueError) as error:
            problems.append(f"{quoted}: no such record or key ({error!r})")
            continue
        value = 100 * value if unit == "%" else value
        decimals = len(number.partition(".")[2])
        if not isinstance(value, int | float) or abs(value - float(number)) > 0.5 * 10**-decimals + 1e-9:
            problems.append(f"{quoted}: the record says {value!r}")
    return problems


def test_every_quoted_figure_matches_its_record():
    quoted = {page.name: FIGURE.findall(page.read_text()) for page in pages()}
    assert len(quoted["README.md"]) >= 5 and len(quoted["benchmarks.md"]) >= 5, quoted
    problems = [f"{page.name}: {p}" for page in pages() for p in figure_problems(page.read_text(), page.parent)]
    assert not problems, problems


def test_readme_bold_figures_name_their_record():
    text = (ROOT / "README.md").read_text()
    unlinked = [bold for bold in BOLD_NUMBER.findall(text) if not FIGURE.search(bold)]
    assert not unlinked, f"bold figures without a record link: {unlinked}"


def first_screen_problems(text: str, lines: int = 70) -> list[str]:
    """What README's first screen lacks of a user's first questions: install, the swap, a multi-GPU launch."""
    screen = "\n".join(text.splitlines()[:lines])
    wanted = {"install": "pip install", "the swap": "TLTGRPOTrainer(", "a multi-GPU launch": "accelerate launch"}
    return [name for name, snippet in wanted.items() if snippet not in screen]


def test_readme_s_first_screen_shows_install_the_swap_and_a_multi_gpu_launch():
    """#64. Negative control: the launch moved below the results table (where it was) is caught."""
    text = (ROOT / "README.md").read_text()
    assert not first_screen_problems(text)
    launch = text[text.index("## Launch it your way") : text.index("## What to expect")]
    assert first_screen_problems(text.replace(launch, "") + launch) == ["a multi-GPU launch"]


@pytest.mark.parametrize("edit", ["figure", "key"])
def test_the_figure_check_fails_on_an_edited_copy(edit):
    """Negative control: a copy of README with one quoted figure (or its key) changed fails the check."""
    text = (ROOT / "README.md").read_text()
    number, unit, path, key = FIGURE.findall(text)[0]
    original = f"[{number}{unit}]({path}#{key})"
    changed = (
        f"[{float(number) + 0.5:g}{unit}]({path}#{key})" if edit == "figure" else f"[{number}{unit}]({path}#nokey)"
    )
    assert not figure_problems(original, ROOT)
    assert figure_problems(text.replace(original, changed, 1), ROOT)


def records() -> list[Path]:
    return sorted((ROOT / "docs" / "benchmarks").glob("*.json")) + [ROOT / "docs" / "demo" / "demo.json"]


@pytest.mark.parametrize("record", records(), ids=lambda p: p.name)
def test_every_record_says_where_it_came_from(record):
    data = json.loads(record.read_text())
    missing = [key for key in PROVENANCE if key not in data]
    assert not missing, f"{record.name} lacks {missing} (write it with trl_tlt.tooling.benchmarks.write_json)"
    if "provenance" not in data:  # recorded with the helper: every field known
        assert all(data[key] not in (None, "") for key in PROVENANCE), {k: data[k] for k in PROVENANCE}
