"""Triton kernels (trl_tlt.kernels) against their torch references, on CPU through Triton's interpreter."""

import os
import subprocess
import sys
import zipfile

import pytest
import torch

from trl_tlt.engine.generate import SpeculativeEngine
from trl_tlt.engine.rejection_sampler import use_triton, verify_drafts, verify_reference
from trl_tlt.engine.sampling import SamplingParams


pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton needs a GPU or TRITON_INTERPRET=1 (set by conftest without a GPU)",
)


def random_case(batch, k, vocab, has_q, do_sample, dtype, seed, top_k=None):
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(batch, k + 1, vocab, generator=g, dtype=dtype)
    if top_k:  # processed logits with -inf outside the top k, as after top-k filtering
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    logp = torch.log_softmax(logits, -1)
    q = None
    if has_q and k:
        q = torch.softmax(logits[:, :k].nan_to_num(neginf=-30) + torch.randn(batch, k, vocab, generator=g), -1)
        q = q.to(dtype)
        drafts = torch.multinomial(q.reshape(-1, vocab).float(), 1, generator=g).reshape(batch, k)
    else:
        drafts = torch.randint(0, vocab, (batch, k), generator=g)
        if k:  # make some drafts the argmax so that greedy verification accepts a few
            take = torch.rand(batch, k, generator=g) < 0.6
            drafts = torch.where(take, logp[:, :k].argmax(-1), drafts)
    num = torch.randint(0, k + 1, (batch,), generator=g)
    num[0] = k  # at least one full-length draft
    uniform_accept = torch.rand(batch, k, generator=g, dtype=dtype) if do_sample else None
    uniform_sample = torch.rand(batch, generator=g, dtype=dtype) if do_sample else None
    return logp, drafts, num, q, uniform_accept, uniform_sample


def assert_same(case):
    from trl_tlt.kernels import verify_triton

    accepted, tokens, emitted = verify_triton(*case)
    ref_accepted, ref_tokens, ref_emitted = verify_reference(*case)
    assert torch.equal(accepted, ref_accepted)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(emitted, ref_emitted, rtol=1e-6, atol=1e-6)
    return accepted


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("has_q, do_sample", [(True, True), (False, True), (True, False), (False, False)])
def test_verify_kernel_matches_reference(k, has_q, do_sample):
    accepted = []
    for seed, (batch, vocab, dtype) in enumerate(
        [(1, 7, torch.float32), (5, 300, torch.float64), (16, 2500, torch.float32)]
    ):
        accepted.append(assert_same(random_case(batch, k, vocab, has_q, do_sample, dtype, seed=100 * k + seed)))
    accepted = torch.cat(accepted)
    assert accepted.max() > 0  # the cases accept drafts, so the cases exercise ragged accepted lengths


def test_verify_kernel_edge_cases():
    assert_same(random_case(3, 0, 50, False, True, torch.float32, seed=1))  # k = 0: the speculation-off path
    assert_same(random_case(6, 4, 64, True, True, torch.float32, seed=2, top_k=3))  # -inf outside the top 3
    assert_same(random_case(6, 4, 64, False, False, torch.float32, seed=3, top_k=1))
    # ties: greedy takes the first argmax in both
    logp = torch.log_softmax(torch.zeros(2, 3, 40), -1)
    drafts = torch.tensor([[0, 0], [5, 0]])
    assert_same((logp, drafts, torch.tensor([2, 2]), None, None, None))
    # a deterministic-drafter row whose draft has target probability 0 (rejected for sure) next to accepted rows
    logp = torch.log_softmax(torch.randn(4, 2, 30, generator=torch.Generator().manual_seed(4)), -1)
    logp[0, 0, 3] = float("-inf")
    drafts = torch.tensor([[3], [1], [2], [4]])
    assert_same((logp, drafts, torch.ones(4, dtype=torch.long), None, torch.full((4, 1), 0.001), torch.rand(4)))


def test_dispatch(monkeypatch):
    monkeypatch.delenv("TRL_TLT_KERNELS", raising=False)
    assert not use_triton(torch.device("cpu"))
    assert use_triton(torch.device("cuda"))  # triton is installed: the engine takes the kernel on CUDA
    monkeypatch.setenv("TRL_TLT_KERNELS", "torch")
    assert not use_triton(torch.device("cuda"))
    monkeypatch.setenv("TRL_TLT_KERNELS", "triton")
    assert use_triton(torch.device("cpu"))
    monkeypatch.setenv("TRL_TLT_KERNELS", "cuda")
    with pytest.raises(ValueError, match="TRL_TLT_KERNELS"):
        use_triton(torch.device("cpu"))


def test_verify_drafts_same_tokens_either_way(monkeypatch):
    logp, drafts, num, q, _, _ = random_case(8, 4, 100, True, True, torch.float32, seed=7)
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("TRL_TLT_KERNELS", backend)
        results[backend] = verify_drafts(logp, drafts, num, q, True, torch.Generator().manual_seed(0))
    for a, b in zip(results["torch"], results["triton"]):
        torch.testing.assert_close(a, b)


def test_engine_with_the_kernel_matches_generate_greedy(monkeypatch, tiny_model_f64):
    from testing_utils import hf_greedy, random_prompts

    from trl_tlt.drafters import ModelDrafter

    monkeypatch.setenv("TRL_TLT_KERNELS", "triton")
    model = tiny_model_f64
    prompts = random_prompts(5, model.config.vocab_size, seed=3)
    engine = SpeculativeEngine(model, drafter=ModelDrafter(model, model.config.vocab_size), num_speculative_tokens=3)
    out = engine.generate(prompts, SamplingParams(do_sample=False, max_new_tokens=12))
    assert out.completion_ids == hf_greedy(model, prompts, 12)


def skewed_sampler(verify_triton):
    """Negative control: the kernel's inverse-CDF sample reads u^2 instead of u (a broken sampler)."""

    def skewed(logp, drafts, num, q, uniform_accept, uniform_sample):
        return verify_triton(logp, drafts, num, q, uniform_accept, uniform_sample**2)

    return skewed


@pytest.mark.slow
@pytest.mark.parametrize("fault", [None, "skewed_sampler"])
def test_engine_with_the_kernel_samples_the_policy_distribution(monkeypatch, tokenizer, fault):
    """Chi-square of sampled completions against the exact distribution, as tests/test_engine.py does for the torch
    path (fewer samples: the interpreter runs one program per row); at that sample size a skewed sampler fails it."""
    from testing_utils import chi_square_pvalue, exact_sequence_distribution, peaked_model

    import trl_tlt.kernels
    from trl_tlt.drafters import ModelDrafter

    monkeypatch.setenv("TRL_TLT_KERNELS", "triton")
    if fault:
        monkeypatch.setattr(trl_tlt.kernels, "verify_triton", skewed_sampler(trl_tlt.kernels.verify_triton))
    policy = peaked_model(tokenizer)
    params = SamplingParams(temperature=0.7, top_k=5, max_new_tokens=3)
    prompt = [11, 12, 13, 11, 12]
    drafter = ModelDrafter(peaked_model(tokenizer, noise=0.3), policy.config.vocab_size)
    engine = SpeculativeEngine(policy, drafter=drafter, num_speculative_tokens=3)
    out = engine.generate([prompt] * 1500, params, generator=torch.Generator().manual_seed(99))
    assert 0 < out.stats.num_accepted_tokens < out.stats.num_draft_tokens
    expected = exact_sequence_distribution(policy, prompt, params, length=3)
    p_value = chi_square_pvalue([tuple(c) for c in out.completion_ids], expected)
    assert p_value < 1e-6 if fault else p_value > 1e-3


def test_kernels_ship_inside_the_package(tmp_path):
    """The wheel holds trl_tlt/kernels/ and no top-level `kernels` package."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            root,
        ],
        check=True,
    )
    (wheel,) = tmp_path.glob("trl_tlt-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "trl_tlt/kernels/verify.py" in names and "trl_tlt/kernels/__init__.py" in names
    assert not [n for n in names if n.startswith("kernels/")]
    assert "trl_tlt/tooling/accelerate_configs/zero3.yaml" in names  # package data of the CLI


@pytest.mark.parametrize("spelling", ["cwd", "symlink"])
def test_the_repository_root_does_not_shadow_hugging_faces_kernels(tmp_path, spelling):
    """Run from the repository root (on sys.path), also under a second spelling (a symlink to it on PYTHONPATH, which
    once made each copy import the other forever), `import kernels` is Hugging Face's package where one is installed
    (transformers >= 5.18 imports it) and never this repository's kernels: transformers imports as usual."""
    from importlib.machinery import PathFinder

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    if spelling == "symlink":
        os.symlink(root, tmp_path / "link")
        env["PYTHONPATH"] = str(tmp_path / "link")
    code = (
        "import kernels, transformers.modeling_utils; from transformers.utils import is_kernels_available; "
        "is_kernels_available(); print(kernels.__file__, hasattr(kernels, 'verify_triton'))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, check=True, capture_output=True, text=True)
    path, has_ours = out.stdout.split()
    assert has_ours == "False"
    others = [p for p in sys.path if os.path.realpath(p or os.curdir) != os.path.realpath(root)]
    hf_installed = PathFinder.find_spec("kernels", others) is not None
    assert (not os.path.realpath(path).startswith(os.path.realpath(root))) == hf_installed, out.stdout


@pytest.mark.slow  # a script for GPUs, through the interpreter: CI's second stage
def test_micro_benchmark_script_runs(tmp_path):
    """scripts/gpu/bench_kernels.py (meant for a GPU) runs end to end through the interpreter and checks tokens."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "kernels.json"
    subprocess.run(
        [sys.executable, os.path.join(root, "scripts", "gpu", "bench_kernels.py"), "--device", "cpu", "--vocab", "256",
         "--batch-sizes", "1,3", "--iters", "1", "--output", str(out)],
        check=True, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
    )  # fmt: skip
    import json

    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4 and all(row["same_tokens"] for row in rows)
