"""Rollout share of the stock `GRPOTrainer` step at a forced completion length, per model shape.

How much of a training step the rollout can take on this machine, independent of any policy's length
distribution: every completion is forced to exactly `T` tokens (`generation_kwargs={"min_new_tokens": T}`; a
randomly initialised model built as `workload.build_policy` builds the policy before SFT, in the given shape,
with the embedded workload's tokenizer), so each step generates to `T` and trains on 64 rows padded to `T`, the
cost of a step whose long tail reaches `T`. 8 prompts x 8 samples per step, training micro-batches of 8
(`--micro-batch`), float32, as in `scripts/bench/bench_e2e.py`. Per (shape, T): median step time (TRL's `step_time`),
median rollout time (`_generate_single_turn`) and the rollout's share of the summed step time, the first step
left out (warm-up).

    python scripts/bench/bench_rollout_share.py --lengths 128,256,512,1024 --shapes 128x8 \
        --output docs/benchmarks/rollout_share_lengths_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from trl_tlt.tooling.benchmarks import write_json  # first: the Hugging Face libraries offline


# isort: split

from bench_e2e import timed  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from trl_tlt.tooling.tiny import build_tiny_model  # noqa: E402
from trl_tlt.tooling.workload import PolicyRecipe, accuracy_reward, build_policy, make_dataset  # noqa: E402


def measure(tokenizer, hidden: int, layers: int, length: int, steps: int, micro_batch: int) -> dict:
    # the policy's proportions (heads of 32, MLP 4x hidden), as `workload.build_policy` builds it before SFT
    model = build_tiny_model(
        tokenizer,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        max_position_embeddings=4096,
    )
    with tempfile.TemporaryDirectory() as output_dir:
        config = GRPOConfig(
            output_dir=output_dir,
            use_cpu=True,
            bf16=False,
            report_to="none",
            per_device_train_batch_size=micro_batch,
            gradient_accumulation_steps=64 // micro_batch,
            num_generations=8,
            max_completion_length=length,
            generation_kwargs={"min_new_tokens": length},
            max_steps=steps,
            learning_rate=1e-6,
            logging_steps=1,
            save_strategy="no",
            disable_tqdm=True,
        )
        trainer = timed(GRPOTrainer)(
            model=model,
            reward_funcs=accuracy_reward,
            args=config,
            train_dataset=make_dataset(8 * steps, seed=1),
            processing_class=tokenizer,
        )
        trainer.rollout_times, trainer.rollout_lengths, trainer.prepare_times = [], [], []
        trainer.train()
    step_times = [h["step_time"] for h in trainer.state.log_history if "step_time" in h][1:]
    rollout_times = trainer.rollout_times[1:]
    result = {
        "shape": f"{hidden}x{layers}",
        "parameters": sum(p.numel() for p in model.parameters()),
        "completion_length": length,
        "micro_batch": micro_batch,
        "longest_completion_per_step": [max(lengths) for lengths in trainer.rollout_lengths],
        "median_step_seconds": statistics.median(step_times),
        "median_rollout_seconds": statistics.median(rollout_times),
        "rollout_share": sum(rollout_times) / sum(step_times),
    }
    print(
        f"{result['shape']:>7} T={length:<5} micro-batch {micro_batch:<3} step {result['median_step_seconds']:6.2f}s  rollout "
        f"{result['median_rollout_seconds']:6.2f}s  share {result['rollout_share']:.3f}",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="128,512", help="forced completion lengths, comma-separated")
    parser.add_argument("--shapes", default="128x8", help="hidden x layers, comma-separated")
    parser.add_argument("--micro-batch", type=int, default=8, choices=(1, 2, 4, 8, 16, 32, 64))
    parser.add_argument("--steps", type=int, default=4, help="steps per point (the first is left out)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step is left out as warm-up")
    tokenizer = AutoTokenizer.from_pretrained(build_policy(PolicyRecipe(), verbose=False), padding_side="left")
    points = []
    for shape in args.shapes.split(","):
        hidden, layers = (int(x) for x in shape.split("x"))
        for length in (int(x) for x in args.lengths.split(",")):
            points.append(measure(tokenizer, hidden, layers, length, args.steps, args.micro_batch))
    write_json(
        {
            "benchmark": "rollout share of the stock GRPOTrainer step at forced completion lengths",
            "batch": f"8 prompts x 8 samples, training micro-batches of {args.micro_batch}, float32",
            "steps_per_point": args.steps,
            "points": points,
        },
        args.output,
    )


if __name__ == "__main__":
    main()
