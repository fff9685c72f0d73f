"""A user's first smoke run: TRL's own `test_train` configuration with `TLTGRPOTrainer` swapped in, beside GRPOTrainer.

TRL's test: a tiny Qwen2.5 stand-in (Qwen2.5's 151,665-token vocabulary, hidden 8, 2 layers, random weights),
`per_device_train_batch_size=3, num_generations=3, max_completion_length=8, learning_rate=0.1` (one prompt x 3
generations per step), three epochs of a 17-prompt set (51 steps). Here the policy is
`bench_plain_swap.random_bigvocab_policy` (that shape, the embedded task's tokenizer extended to 151,665 tokens) and the
prompts 17 of the embedded task's. Each trainer runs `--repeats` times, alternating; the wall time counts construction
and `train()` (the first step included). `short_run_wall_ratio` = TLT / GRPO median wall time (target <= 1.1).

    python scripts/bench/bench_short_run.py --output docs/benchmarks/short_run_cpu.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_plain_swap import random_bigvocab_policy, run_trainer  # noqa: E402  (first: the libraries offline)


# isort: split

from datasets import Dataset  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from trl_tlt import TLTGRPOTrainer  # noqa: E402
from trl_tlt.tooling.benchmarks import machine, trainer_config, write_json  # noqa: E402
from trl_tlt.tooling.workload import make_dataset  # noqa: E402


def reward_len(completions, **kwargs):  # TRL's test rewards with a model; any cheap reward times the same
    return [-abs(20 - len(c)) for c in completions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    prompts = [p[0]["content"] for p in make_dataset(17, seed=11)["prompt"]]
    dataset = Dataset.from_dict({"prompt": prompts})
    runs: dict[str, list[dict]] = {"grpo": [], "tlt": []}
    with tempfile.TemporaryDirectory() as folder:
        policy = random_bigvocab_policy(os.path.join(folder, "policy"))
        for repeat in range(args.repeats):
            for name in ("grpo", "tlt") if repeat % 2 == 0 else ("tlt", "grpo"):
                config = trainer_config(
                    "grpo", os.path.join(folder, name), num_prompts=1, num_generations=3, max_completion_length=8,
                    steps=-1, micro_batch=3, learning_rate=0.1, num_train_epochs=args.epochs,
                )  # fmt: skip
                trainer_cls = TLTGRPOTrainer if name == "tlt" else GRPOTrainer
                result = run_trainer(trainer_cls, policy, config, dataset, reward_len)
                runs[name].append(result)
                print(f"{name}: {result['wall_seconds']:.1f} s, {len(result['step_seconds'])} steps", flush=True)
    wall = {name: statistics.median(r["wall_seconds"] for r in rs) for name, rs in runs.items()}
    write_json(
        {
            "what": "TRL's test_train configuration (151,665-token random tiny policy, 1 prompt x 3 generations per "
            "step, 8 completion tokens, lr 0.1, 3 epochs of 17 prompts), GRPOTrainer vs TLTGRPOTrainer with every "
            "default; wall = construction + train()",
            "machine": machine(),
            "runs_per_trainer": args.repeats,
            "runs": runs,
            "wall_seconds_grpo": wall["grpo"],
            "wall_seconds_tlt": wall["tlt"],
            "short_run_wall_ratio": wall["tlt"] / wall["grpo"],
        },
        args.output,
    )
    print(f"short_run_wall_ratio {wall['tlt'] / wall['grpo']:.3f}")


if __name__ == "__main__":
    main()
