"""The embedded policy described: accuracy and completion lengths, a length histogram (`python -m trl_tlt.tooling.workload`)."""

from __future__ import annotations

import json
from pathlib import Path

from datasets import Dataset

from .builds import build_drift_policy, build_policy
from .task import accuracy_reward, make_dataset, prompt_token_ids, solution_style


def evaluate_policy(
    model,
    tokenizer,
    dataset: Dataset,
    num_generations: int = 8,
    temperature: float = 1.0,
    max_new_tokens: int = 512,
    seed: int = 0,
    prompts_per_batch: int = 8,
) -> dict:
    """Sample `num_generations` completions per problem with the engine; accuracy and length statistics.

    `accuracy_by_style` splits the accuracy by solution style and by problem length (short: 1-3 additions, long: 4
    or more), each as `[accuracy, number of samples]`: the drift scenario needs its styles equally accurate.
    """
    import numpy as np
    import torch

    from trl_tlt.engine.generate import SpeculativeEngine
    from trl_tlt.engine.sampling import SamplingParams

    engine = SpeculativeEngine(model, pad_token_id=tokenizer.pad_token_id)
    params = SamplingParams(
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else 1.0,
        max_new_tokens=max_new_tokens,
        eos_token_ids=(tokenizer.eos_token_id,),
    )
    generator = torch.Generator(device=model.device).manual_seed(seed)
    lengths, rewards, cells = [], [], {}
    for begin in range(0, len(dataset), prompts_per_batch):
        batch = dataset[begin : begin + prompts_per_batch]
        ids = [p for p in prompt_token_ids(tokenizer, batch["prompt"]) for _ in range(num_generations)]
        out = engine.generate(ids, params, generator=generator)
        texts = tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
        answers = [a for a in batch["answer"] for _ in range(num_generations)]
        batch_rewards = accuracy_reward(texts, answers)
        rewards += batch_rewards
        lengths += [len(c) for c in out.completion_ids]
        steps = [n for n in batch["num_steps"] for _ in range(num_generations)]
        for text, reward, n in zip(texts, batch_rewards, steps, strict=True):
            cells.setdefault(f"{solution_style(text)}, {'short' if n <= 3 else 'long'}", []).append(reward)
    lengths_arr = np.array(lengths)
    median = float(np.median(lengths_arr))
    return {
        "num_problems": len(dataset),
        "num_generations": num_generations,
        "temperature": temperature,
        "accuracy": float(np.mean(rewards)),
        "accuracy_by_style": {cell: [float(np.mean(r)), len(r)] for cell, r in sorted(cells.items())},
        "length_median": median,
        "length_p99": float(np.percentile(lengths_arr, 99)),
        "length_max": int(lengths_arr.max()),
        "p99_over_median": float(np.percentile(lengths_arr, 99) / median),
        "max_over_median": float(lengths_arr.max() / median),
        "clipped_fraction": float(np.mean(lengths_arr >= max_new_tokens)),
        "lengths": lengths,
    }


def plot_lengths(lengths: list[int], path: str | Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.hist(lengths, bins=60, log=True, color="tab:blue")
    for q, style in ((50, "-"), (99, "--")):
        ax.axvline(np.percentile(lengths, q), color="k", linestyle=style, label=f"p{q}")
    ax.set_xlabel("completion length (tokens)")
    ax.set_ylabel("count (log)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    import argparse

    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description="Build (or load) the embedded policy and describe it.")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--drift", action="store_true", help="The drift scenario's start policy instead.")
    parser.add_argument(
        "--steps-prompt-fraction",
        type=float,
        default=0.0,
        help="Fraction of the prompts that ask for the steps style.",
    )
    parser.add_argument("--num-problems", type=int, default=256)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--plot", default=None, help="Write the length histogram to this PNG.")
    args = parser.parse_args()
    path = build_drift_policy(cache_dir=args.cache_dir)[0] if args.drift else build_policy(cache_dir=args.cache_dir)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    eval_set = make_dataset(args.num_problems, seed=12345, steps_prompt_fraction=args.steps_prompt_fraction)
    stats = evaluate_policy(model, tokenizer, eval_set, num_generations=args.num_generations)
    print(json.dumps({k: v for k, v in stats.items() if k != "lengths"}, indent=2))
    if args.plot:
        name = "Drift start policy" if args.drift else "Embedded policy"
        title = f"{name}: completion lengths ({args.num_problems} problems x {args.num_generations}, T=1)"
        plot_lengths(stats["lengths"], args.plot, title)
