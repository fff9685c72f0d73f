"""Each `TLTConfig` default is written once: the field's default, its docstring entry and its `help` agree, and
docs/trainer.md names every field without restating a default."""

import ast
import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from trl import GRPOConfig

from trl_tlt.config import TLTConfig, field_docs


TRAINER_DOC = Path(__file__).parent.parent / "docs" / "trainer.md"


def tlt_fields() -> list[dataclasses.Field]:
    grpo = {f.name for f in dataclasses.fields(GRPOConfig)}
    return [f for f in dataclasses.fields(TLTConfig) if f.name not in grpo]


def disagreements(doc: str, fields: list[dataclasses.Field], trainer_md: str) -> list[str]:
    documented = field_docs(doc)
    problems = []
    for f in fields:
        if f.name not in documented:
            problems.append(f"{f.name}: not in TLTConfig's docstring")
            continue
        default, text = documented[f.name]
        if ast.literal_eval(default) != f.default:
            problems.append(f"{f.name}: docstring says defaults to {default}, the field {f.default!r}")
        if f.metadata.get("help", "").replace("%%", "%") != text:
            problems.append(f"{f.name}: `help` is not the docstring's text")
        if f"`{f.name}`" not in trainer_md:
            problems.append(f"{f.name}: docs/trainer.md does not name it")
        if re.search(rf"^\| `{f.name}` \| `", trainer_md, flags=re.M):
            problems.append(f"{f.name}: docs/trainer.md restates its default in a table")
    return problems


def test_defaults_docstring_help_and_trainer_doc_agree():
    assert not disagreements(TLTConfig.__doc__, tlt_fields(), TRAINER_DOC.read_text())


def test_help_prints_the_docstring_text():
    from transformers import HfArgumentParser

    text = " ".join(HfArgumentParser(TLTConfig).format_help().split())
    assert "exploring them costs rollout throughput" in text


@pytest.mark.parametrize("edit", ["default", "help", "restated", "unnamed"])
def test_a_drifted_copy_is_caught(edit):
    """Negative controls, on copies: a docstring default edited, a `help` that says something else, a default
    restated in docs/trainer.md, a field docs/trainer.md no longer names."""
    doc, fields, trainer_md = TLTConfig.__doc__, tlt_fields(), TRAINER_DOC.read_text()
    if edit == "default":
        doc = doc.replace("defaults to `0.5`", "defaults to `0.25`")
    elif edit == "help":
        index = next(i for i, f in enumerate(fields) if f.name == "selector_epsilon")
        fields[index] = SimpleNamespace(name="selector_epsilon", default=0.1, metadata={"help": "Exploration rate."})
    elif edit == "restated":
        trainer_md += "\n| `spot_time_budget` | `0.5` | the budget |\n"
    else:
        trainer_md = trainer_md.replace("`micro_batching`", "micro-batching")
    assert disagreements(doc, fields, trainer_md)


def logged_metrics(source_root: Path) -> set[str]:
    """Every `tlt/` metric key the library logs (an f-string's field as its capitalised initial: `{bucket}` as `{B}`)."""
    keys = set()
    for path in source_root.rglob("*.py"):
        for key in re.findall(r"f?\"(tlt/[a-z0-9_{}]+)\"", path.read_text()):
            keys.add(re.sub(r"\{(\w)\w*\}", lambda m: "{" + m.group(1).upper() + "}", key))
    return keys


def undefined_metrics(keys: set[str], docs: str) -> set[str]:
    """Keys without a row `| `key` | definition |` in a docs table."""
    return {key for key in keys if f"| `{key}` |" not in docs}


def test_every_logged_metric_is_defined_in_the_docs():
    root = Path(__file__).parent.parent
    keys = logged_metrics(root / "trl_tlt")
    assert "tlt/mean_acceptance_length" in keys and "tlt/k_bucket_{B}" in keys
    docs = (root / "docs" / "metrics.md").read_text()  # the page a user reads a run with
    assert not undefined_metrics(keys, docs)
    assert undefined_metrics(keys | {"tlt/never_documented"}, docs) == {"tlt/never_documented"}  # negative control
