"""The main job (`make demo`): a smoke run of the stock GRPO loop on a tiny model built offline.

Run with `python -m trl_tlt.demo [--output-dir DIR]`. It needs no download.
"""

import argparse
import os
import tempfile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output-dir", default=None, help="Where to write the run (default: a temporary folder).")
    parser.add_argument("--max-steps", type=int, default=2)
    args = parser.parse_args()
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from trl_tlt.tiny import build_tiny_model, build_tokenizer

    output_dir = args.output_dir or tempfile.mkdtemp(prefix="trl-tlt-demo-")
    tokenizer = build_tokenizer(["1+2=3\n3+4=7\n#### 7"] * 50, vocab_size=300)
    model = build_tiny_model(tokenizer, hidden_size=64, num_hidden_layers=2)
    dataset = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)]})

    def reward_short(completions, **kwargs):
        return [-float(len(c)) for c in completions]

    config = GRPOConfig(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=16,
        max_steps=args.max_steps,
        logging_steps=1,
        save_strategy="no",
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward_short, args=config, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.train()
    print(f"demo finished: {trainer.state.global_step} GRPO steps, output in {output_dir}")


if __name__ == "__main__":
    main()
