"""Soak: a long TLTGRPOTrainer run with spot training on the embedded workload; does anything grow?

Every TLTConfig default (a new EAGLE-3 head trained online, the bandit selector), one process, 8 prompts x 8
generations per step. After every step it records the process's resident memory, the spot data buffer (sequences
and tokens), the spot optimizer's state (tensor elements), the selector's state (buckets x arms) and the engine's
per-rollout statistics kept by the trainer. Writes JSON with the per-step series and, for each, the least-squares
slope over the steps after `--warmup` (per 100 steps), the first and last value.

    python scripts/bench/soak.py --steps 300 --output docs/benchmarks/soak_cpu.json
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time

from trl_tlt.tooling.benchmarks import trainer_config, write_json  # first: the Hugging Face libraries offline


# isort: split

import psutil  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402

from trl_tlt import TLTGRPOTrainer  # noqa: E402
from trl_tlt.tooling.workload import accuracy_reward, build_policy, make_dataset  # noqa: E402


def slope_per_100(values: list[float]) -> float:
    """Least-squares slope of `values` against their index, per 100 steps."""
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    den = sum((i - mean_x) ** 2 for i in range(n))
    return 100 * num / den if den else 0.0


class Probe(TrainerCallback):
    """After each optimizer step: what a long run could accumulate."""

    def __init__(self, trainer: TLTGRPOTrainer):
        self.trainer = trainer
        self.process = psutil.Process()
        self.series: dict[str, list[float]] = {
            "rss_mib": [],
            "buffer_sequences": [],
            "buffer_tokens": [],
            "spot_optimizer_elements": [],
            "selector_entries": [],
            "log_history_entries": [],
            "seconds": [],
        }
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        trainer, spot = self.trainer, self.trainer.tlt_spot
        optimizer_elements = sum(
            v.numel() for s in spot.optimizer.state.values() for v in s.values() if hasattr(v, "numel")
        )
        selector = getattr(trainer.tlt_speculation, "_stats", {})
        values = {
            "rss_mib": self.process.memory_info().rss / 2**20,
            "buffer_sequences": len(spot.buffer.samples) + len(spot.buffer.held_out),
            "buffer_tokens": spot.buffer.num_tokens,
            "spot_optimizer_elements": optimizer_elements,
            "selector_entries": sum(len(arms) for arms in selector.values()),
            "log_history_entries": len(trainer.state.log_history),
            "seconds": time.perf_counter() - self.start,
        }
        for key, value in values.items():
            self.series[key].append(float(value))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=50, help="steps left out of the slopes (buffer filling)")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()

    policy_path = build_policy()
    with tempfile.TemporaryDirectory() as output_dir:
        config = trainer_config(
            "tlt", output_dir, num_prompts=args.num_prompts, num_generations=args.num_generations,
            max_completion_length=args.max_completion_length, steps=args.steps, seed=args.seed, learning_rate=1e-6,
            temperature=1.0, gradient_checkpointing=True,  # GRPOConfig's default, as the recorded run had it
        )  # fmt: skip
        trainer = TLTGRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(policy_path),
            reward_funcs=accuracy_reward,
            args=config,
            train_dataset=make_dataset(args.num_prompts * args.steps, seed=100 + args.seed),
            processing_class=AutoTokenizer.from_pretrained(policy_path, padding_side="left"),
        )
        probe = Probe(trainer)
        trainer.add_callback(probe)
        trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    after = slice(args.warmup, None)
    result = {
        "steps": args.steps,
        "batch": f"{args.num_prompts} prompts x {args.num_generations}, max {args.max_completion_length} tokens",
        "warmup_steps_excluded_from_slopes": args.warmup,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "drafter_steps": trainer.tlt_spot.total_steps,
        "drafter_resets": trainer.tlt_spot.total_resets,
        "mean_acceptance_length_last_50": sum(h["tlt/mean_acceptance_length"] for h in logs[-50:]) / len(logs[-50:]),
        "slope_per_100_steps": {k: slope_per_100(v[after]) for k, v in probe.series.items() if k != "seconds"},
        "first_after_warmup": {k: v[args.warmup] for k, v in probe.series.items()},
        "last": {k: v[-1] for k, v in probe.series.items()},
        "series": probe.series,
    }
    print({k: result[k] for k in ("peak_rss_mib", "drafter_steps", "drafter_resets", "slope_per_100_steps")})
    write_json(result, args.output)


if __name__ == "__main__":
    main()
