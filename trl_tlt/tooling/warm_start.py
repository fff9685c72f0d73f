"""`trl-tlt train-drafter`: warm-start a drafter for a policy before RL (as SpecForge's online mode).

The policy completes a dataset's prompts at the RL sampling settings (or the dataset's own completions are used:
SFT data), the drafter learns the policy's next-token distribution (progress bar), and its acceptance length on
held-out prompts is measured before and after training. The output directory holds the drafter (EAGLE-3 in the
layout vLLM loads, or the small LM / its LoRA adapters) and `train_report.json`; pass it to
`TLTConfig(drafter_model_name_or_path=...)` or to vLLM's `speculative_config`.

    # EAGLE-3 head for the embedded policy, on the embedded task's prompts
    trl-tlt train-drafter --policy ~/.cache/trl_tlt/policy-c0e48ffec46e --output out/eagle3
    # LoRA on a small LM, prompts from a local JSONL file with a "prompt" column
    trl-tlt train-drafter --policy my-policy --dataset data.jsonl --drafter-type model \
        --drafter-model my-small-lm --lora-r 16 --output out/lm-lora

The defaults are the embedded warm-start recipe (`trl_tlt.tooling.workload.DrafterRecipe`: 2,000 prompts, 5 epochs, learning
rate 2e-3, 1,024 tokens per batch), which took the embedded policy's head from 1.02 to 4.27 tokens per step at k=4.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_tlt.engine.sampling import SamplingParams
from trl_tlt.training.distillation import DistillConfig
from trl_tlt.training.warm_start import warm_start_drafter


def load_prompts(args, tokenizer):
    """(prompt ids, completion ids or None) from the embedded task or a local dataset."""
    from datasets import load_dataset, load_from_disk

    if args.dataset == "embedded":
        from .workload import make_dataset

        dataset = make_dataset(args.num_prompts + args.eval_prompts, seed=args.seed + 7)
    elif os.path.isdir(args.dataset):
        dataset = load_from_disk(args.dataset)
    else:
        extension = args.dataset.rsplit(".", 1)[-1].replace("jsonl", "json")
        dataset = load_dataset(extension, data_files=args.dataset, split="train")
    if args.prompt_column not in dataset.column_names:
        raise SystemExit(f"--prompt-column {args.prompt_column!r} is not in the dataset: {dataset.column_names}.")
    dataset = dataset.select(range(min(len(dataset), args.num_prompts + args.eval_prompts)))

    def encode(prompt):
        if isinstance(prompt, list):  # conversational, rendered as GRPOTrainer does
            text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            return tokenizer(text, add_special_tokens=False)["input_ids"]
        return tokenizer(prompt)["input_ids"]

    prompts = [encode(p) for p in dataset[args.prompt_column]]
    completions = None
    if args.completion_column:
        texts = dataset[args.completion_column]
        texts = [t[-1]["content"] if isinstance(t, list) else t for t in texts]
        completions = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    return prompts, completions


def plot_curve(report: dict, path: str) -> None:
    """The acceptance length against trained tokens and seconds (`report["curve"]`), where matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    curve = report.get("curve")
    if not curve:
        return
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), sharey=True)
    for ax, key, label in ((axes[0], "tokens", "tokens trained on"), (axes[1], "seconds", "training seconds")):
        ax.plot([p[key] for p in curve], [p["acceptance"] for p in curve], marker="o")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"acceptance length (k={report['k']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trl-tlt train-drafter", description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", required=True, help="Path of the policy (a Hugging Face causal LM).")
    parser.add_argument("--output", required=True, help="Directory the drafter and train_report.json go to.")
    parser.add_argument(
        "--dataset", default="embedded", help="'embedded', a saved dataset dir, or a json/csv/parquet file."
    )
    parser.add_argument("--prompt-column", default="prompt")
    parser.add_argument("--completion-column", default=None, help="Train on these completions instead of sampling.")
    parser.add_argument("--num-prompts", type=int, default=2000)
    parser.add_argument("--eval-prompts", type=int, default=64, help="Held-out prompts for the acceptance figure.")
    parser.add_argument("--drafter-type", choices=["eagle3", "model"], default="eagle3")
    parser.add_argument("--drafter-model", default=None, help="The small LM for --drafter-type model.")
    parser.add_argument("--lora-r", type=int, default=0, help="Train LoRA adapters of this rank (0 = all weights).")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--ttt-length", type=int, default=4)
    parser.add_argument("--max-tokens-per-batch", type=int, default=1024)
    parser.add_argument(
        "--draft-vocab-size", type=int, default=None,
        help="A new head's draft vocabulary (default: sized to the tokens the policy's samples use, as in the trainer).",
    )  # fmt: skip
    parser.add_argument("--aux-layer-ids", type=int, nargs=3, default=None)
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="k of the acceptance evaluation.")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--max-seconds", type=float, default=None, help="Stop training after this many seconds.")
    parser.add_argument("--max-tokens", type=int, default=None, help="Stop training after this many tokens.")
    parser.add_argument(
        "--eval-every-seconds", type=float, default=60.0,
        help="Measure the acceptance length on the held-out prompts every this many seconds of training.",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.drafter_type == "model" and not args.drafter_model:
        parser.error("--drafter-type model needs --drafter-model (a small LM with the policy's tokenizer).")

    torch.manual_seed(args.seed)
    policy = AutoModelForCausalLM.from_pretrained(args.policy).eval()
    for p in policy.parameters():
        p.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(args.policy)
    prompts, completions = load_prompts(args, tokenizer)
    eval_prompts, prompts = prompts[: args.eval_prompts], prompts[args.eval_prompts :]
    completions = completions[args.eval_prompts :] if completions else None
    drafter = None
    if args.drafter_type == "model":
        drafter = AutoModelForCausalLM.from_pretrained(args.drafter_model)
        if args.lora_r:
            from peft import LoraConfig, get_peft_model

            drafter = get_peft_model(
                drafter, LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules="all-linear")
            )
    params = SamplingParams(
        do_sample=args.temperature > 0,
        temperature=args.temperature if args.temperature > 0 else 1.0,
        max_new_tokens=args.max_new_tokens,
        eos_token_ids=(tokenizer.eos_token_id,),
    )
    report = warm_start_drafter(
        policy,
        prompts,
        args.output,
        params,
        drafter=drafter,
        completions=completions,
        eval_prompts=eval_prompts,
        epochs=args.epochs,
        learning_rate=args.learning_rate,
        config=DistillConfig(ttt_length=args.ttt_length, max_tokens_per_batch=args.max_tokens_per_batch),
        draft_vocab_size=args.draft_vocab_size,
        aux_hidden_state_layer_ids=args.aux_layer_ids,
        k=args.num_speculative_tokens,
        seed=args.seed,
        max_seconds=args.max_seconds,
        max_tokens=args.max_tokens,
        eval_every_seconds=args.eval_every_seconds,
    )
    plot_curve(report, os.path.join(args.output, "acceptance.png"))
    before, after = report.get("before", {}), report.get("after", {})
    if after:
        print(
            f"acceptance length at k={args.num_speculative_tokens}: {before['mean_acceptance_length']:.2f} -> "
            f"{after['mean_acceptance_length']:.2f}; drafter written to {args.output}"
        )
    print(json.dumps({key: value for key, value in report.items() if key != "curve"}, indent=2))
    return report


if __name__ == "__main__":
    main()
