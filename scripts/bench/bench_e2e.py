"""End-to-end benchmark: TRL's `GRPOTrainer` vs `TLTGRPOTrainer` on the embedded workload, same seeds and machine.

For each seed both trainers start from the same SFT policy and train on the same prompts, run back to back
(the order alternates between seeds). Per step it records the reward, the step time (TRL's `step_time`: rollout
+ scoring + training) and the rollout time; after training, the accuracy of the trained policy on held-out
problems (temperature 1, 4 samples each). Writes JSON with `step_time_ratio` (GRPO / TLT), `rollout_time_ratio`,
`training_phase_ratio` (GRPO / TLT, median training-phase seconds: forward, backward, optimizer), `reward_grpo`,
`reward_tlt` (mean reward per step, averaged over seeds), `reward_test` (a paired test of the reward curves),
`profile_<trainer>` (where each step's time goes: rollout, scoring, training) and the per-seed details. The trainer
`tlt_padded` is TLTGRPOTrainer with `micro_batching="padded"` (TRL's training layout): beside `tlt` it shows what the
training phase gives (`training_phase_ratio_padded_over_tlt`) apart from the speculative rollout.

    python scripts/bench/bench_e2e.py --steps 30 --seeds 0,1 --output docs/benchmarks/e2e_cpu.json

Two processes (gloo, one thread each; the batch of 8 prompts split over the ranks; a step's rollout time is the
slowest rank's):

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 scripts/bench/bench_e2e.py --eval-problems 0 --output e2e_2proc.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time

from trl_tlt.tooling.benchmarks import trainer_config, write_json  # first: the Hugging Face libraries offline


# isort: split

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from trl_tlt import TLTGRPOTrainer  # noqa: E402
from trl_tlt.engine.sampling import SamplingParams  # noqa: E402
from trl_tlt.tooling.workload import (  # noqa: E402
    accuracy_reward,
    build_draft_lm,
    build_eagle3_drafter,
    build_policy,
    evaluate_policy,
    make_dataset,
    prompt_token_ids,
)
from trl_tlt.training.warm_start import evaluate_acceptance  # noqa: E402


def timed(trainer_cls):
    """The trainer with its rollout (`_generate_single_turn`) timed into `rollout_times`, and the lengths of its
    completions recorded in `rollout_lengths` (one list per rollout, grouped as generated)."""

    class Timed(trainer_cls):
        rollout_times: list[float]
        rollout_lengths: list[list[int]]
        prepare_times: list[float]  # rollout + rewards + advantages (+ log-prob passes), per rollout

        def _generate_single_turn(self, *args, **kwargs):
            start = time.perf_counter()
            out = super()._generate_single_turn(*args, **kwargs)
            self.rollout_times.append(time.perf_counter() - start)
            self.rollout_lengths.append([len(ids) for ids in out[0]])
            return out

        def _generate_and_score_completions(self, *args, **kwargs):
            start = time.perf_counter()
            out = super()._generate_and_score_completions(*args, **kwargs)
            self.prepare_times.append(time.perf_counter() - start)
            return out

    Timed.__name__ = trainer_cls.__name__
    return Timed


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def reward_comparison(runs: dict, seeds: list[int]) -> dict:
    """Can the reward curves be told apart? Both trainers see the same prompts at each (seed, step), so the tests are
    paired. Per step: Wilcoxon signed-rank on the differences TLT - GRPO (anti-conservative: steps of one run are
    correlated). Per seed (the independent unit; 3 seeds or more): t-test of the seeds' mean differences."""
    from scipy.stats import ttest_1samp, wilcoxon

    per_seed = {s: [t - g for t, g in zip(runs["tlt"][s]["reward"], runs["grpo"][s]["reward"])] for s in seeds}
    diffs = [d for s in seeds for d in per_seed[s]]
    rng = random.Random(0)
    means = sorted(statistics.mean(rng.choices(diffs, k=len(diffs))) for _ in range(2000))
    result = {
        "test": "Wilcoxon signed-rank, paired by (seed, step), two-sided",
        "pairs": len(diffs),
        "mean_difference_tlt_minus_grpo": statistics.mean(diffs),
        "mean_difference_95ci": [means[50], means[1949]],
        "p_value": float(wilcoxon(diffs).pvalue),
    }
    if len(seeds) >= 3:
        seed_means = [statistics.mean(per_seed[s]) for s in seeds]
        result["seed_level"] = {
            "test": "one-sample t-test of the per-seed mean differences TLT - GRPO, two-sided",
            "seeds": len(seeds),
            "per_seed_mean_difference": seed_means,
            "p_value": float(ttest_1samp(seed_means, 0.0).pvalue),
        }
    return result


def phase_profile(runs: dict, name: str, seeds: list[int]) -> dict:
    """Median seconds per step of each phase, and its share of the summed step time."""
    total = sum(t for s in seeds for t in runs[name][s]["step_time"])
    out = {}
    for phase in ("rollout_time", "scoring_time", "training_time"):
        values = [t for s in seeds for t in runs[name][s][phase]]
        out[phase] = {"median_seconds": statistics.median(values), "share": sum(values) / total}
    return out


LABELS = {
    "grpo": "GRPOTrainer",
    "tlt_padded": "TLTGRPOTrainer,\nTRL's training layout",
    "tlt": "TLTGRPOTrainer",
    "tlt_new": "TLTGRPOTrainer,\nno drafter given",
    "tlt_warm": "TLTGRPOTrainer,\nwarm-started head",
    "tlt_lm": "TLTGRPOTrainer,\nown drafter LM",
}
# The drafter of the TLT arms that fix it (the others take --drafter-type).
ARM_DRAFTERS = {"tlt_new": "eagle3-new", "tlt_warm": "eagle3", "tlt_lm": "model"}


def plot_phases(result: dict, names: list[str], path: str) -> None:
    """Stacked bars: median seconds per step of rollout, scoring and training, per trainer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = [n for n in LABELS if n in names]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for name_index, name in enumerate(order):
        bottom = 0.0
        for phase, color in (("rollout_time", "#4c72b0"), ("scoring_time", "#aaaaaa"), ("training_time", "#dd8452")):
            seconds = result[f"profile_{name}"][phase]["median_seconds"]
            label = phase.removesuffix("_time") if name_index == 0 else None
            ax.bar(name_index, seconds, bottom=bottom, color=color, label=label, width=0.6)
            bottom += seconds
        ax.text(name_index, bottom, f"{result[f'median_step_time_{name}']:.2f} s", ha="center", va="bottom")
    ax.set_xticks(range(len(order)), [LABELS[n] for n in order])
    ax.set_ylabel("median seconds per step (phase)")
    ax.set_title(f"one GRPO step, {result['batch']}, {len(result['seeds'])} seeds x {result['steps']} steps")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


class AcceptanceProbe(TrainerCallback):
    """Every `every` optimizer steps: the current drafter's acceptance length at k = 4 on fixed held-out prompts
    (the engine speculating at every step, temperature 1, the current policy). Runs between steps: not in step_time."""

    def __init__(self, trainer, prompts, every: int):
        self.trainer, self.prompts, self.every, self.values = trainer, prompts, every, {}

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if step % self.every and step != 1:
            return
        trainer = self.trainer
        policy = trainer.accelerator.unwrap_model(trainer.model)
        was_training = policy.training
        policy.eval()
        eos = trainer.processing_class.eos_token_id
        params = SamplingParams(temperature=1.0, max_new_tokens=trainer.max_completion_length, eos_token_ids=(eos,))
        report = evaluate_acceptance(policy, trainer.tlt_drafter, self.prompts, params, k=4, seed=step)
        self.values[step] = report["mean_acceptance_length"]
        policy.train(was_training)


def plot_steps(result: dict, names: list[str], path: str) -> None:
    """Per step: the drafter's acceptance length at k = 4 (when probed) and every trainer's step time, per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 6.0), sharex=True)
    colors = dict(zip(LABELS, ("#4c72b0", "#55a868", "#dd8452", "#c44e52", "#8172b2", "#937860")))
    for name in names:
        for i, run in enumerate(result["runs"][name].values()):
            steps = range(1, len(run["step_time"]) + 1)
            label = LABELS[name].replace("\n", " ") if i == 0 else None
            bottom.plot(steps, run["step_time"], color=colors[name], alpha=0.8, label=label)
            probe = run.get("acceptance_length_k4")
            if probe:
                at = sorted(probe, key=int)
                top.plot([int(s) for s in at], [probe[s] for s in at], "os"[i % 2] + "-", color=colors[name],
                         label=label)  # fmt: skip
    top.axhline(3.0, color="grey", linestyle=":", linewidth=1)
    top.set_ylabel("acceptance length, k = 4")
    top.set_title(f"{result['batch']}, {len(result['runs'][names[0]])} seeds (one line each)")
    top.legend(loc="lower right")
    bottom.set_ylabel("step seconds")
    bottom.set_xlabel("RL step")
    bottom.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def run(name: str, policy_path, seed: int, args, output_dir: str) -> dict:
    # One generation of prompts x generations per optimizer step (per rank: its share of the prompts), trained in
    # micro-batches of one group's size. TRL pads the whole generation to its longest completion before shuffling it
    # into micro-batches, so the micro-batch size does not change the padded work (scripts/bench/bench_rollout_share.py).
    common = dict(
        num_prompts=args.num_prompts // world_size(), num_generations=args.num_generations,
        max_completion_length=args.max_completion_length, steps=args.steps, seed=seed,
        learning_rate=args.learning_rate, temperature=1.0,
    )  # fmt: skip
    if name == "grpo":
        trainer_cls, config = timed(GRPOTrainer), trainer_config("grpo", output_dir, **common)
    else:
        # eagle3-new: the out-of-the-box set-up (a new EAGLE-3 head, every TLTConfig default)
        arm_drafter = ARM_DRAFTERS.get(name, args.drafter_type)
        warm_start = {"model": build_draft_lm, "eagle3": build_eagle3_drafter}.get(arm_drafter)
        drafter = {"drafter_model_name_or_path": str(warm_start())} if warm_start else {}
        drafter_type = "eagle3" if arm_drafter == "eagle3-new" else arm_drafter
        trainer_cls = timed(TLTGRPOTrainer)
        layout = {"micro_batching": "padded"} if name == "tlt_padded" else {}
        tlt_args = {"drafter_type": drafter_type, **drafter, **layout, **json.loads(args.tlt_args)}
        config = trainer_config("tlt", output_dir, **common, tlt_args=tlt_args)
    model = AutoModelForCausalLM.from_pretrained(policy_path)
    tokenizer = AutoTokenizer.from_pretrained(policy_path, padding_side="left")
    # --epochs E: the run's prompts, E times over (in a new order each time)
    train_set = make_dataset(args.num_prompts * args.steps // args.epochs, seed=100 + seed)
    trainer = trainer_cls(
        model=model, reward_funcs=accuracy_reward, args=config, train_dataset=train_set, processing_class=tokenizer
    )
    trainer.rollout_times, trainer.rollout_lengths, trainer.prepare_times = [], [], []
    probe = None
    if args.acceptance_every and name != "grpo" and trainer.tlt_drafter is not None:
        held_out = make_dataset(16, seed=555)["prompt"]
        probe = AcceptanceProbe(trainer, prompt_token_ids(tokenizer, held_out), args.acceptance_every)
        trainer.add_callback(probe)
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    logs = [h for h in trainer.state.log_history if "reward" in h]
    rollout_times, prepare_times = trainer.rollout_times, trainer.prepare_times
    if dist.is_initialized():  # a step waits for the slowest rank: keep each step's maximum over ranks
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (rollout_times, prepare_times))
        rollout_times = [max(ts) for ts in zip(*(g[0] for g in gathered))]
        prepare_times = [max(ts) for ts in zip(*(g[1] for g in gathered))]
    result = {
        "reward": [h["reward"] for h in logs],
        "step_time": [h["step_time"] for h in logs],
        "rollout_time": rollout_times,
        # where the step's time goes: rollout; scoring (rewards, advantages, padding; the rest of
        # _generate_and_score_completions); training (forward, backward, optimizer: the rest of the step)
        "scoring_time": [p - r for p, r in zip(prepare_times, rollout_times)],
        "training_time": [st - p for st, p in zip((h["step_time"] for h in logs), prepare_times)],
        "rollout_lengths": trainer.rollout_lengths,
        "train_wall_seconds": wall,
    }
    if name.startswith("tlt"):
        result["mean_acceptance_length"] = [h.get("tlt/mean_acceptance_length") for h in logs]
        result["speculated_fraction"] = [h.get("tlt/spec_step_fraction") for h in logs]
        # single process: the drafter steps between rollouts run inside the rollout call (part of rollout_time)
        for key in (
            "tlt/drafter_eval_acceptance_length",
            "tlt/spot_seconds",
            "tlt/drafter_steps",
            "tlt/accepted_from_history",
            "tlt/accepted_from_siblings",
        ):
            result[key.removeprefix("tlt/")] = [h.get(key) for h in logs]
    if probe is not None:
        result["acceptance_length_k4"] = probe.values
    if args.eval_problems:
        torch.manual_seed(seed)
        stats = evaluate_policy(
            trainer.model.eval(), tokenizer, make_dataset(args.eval_problems, seed=777), num_generations=4, seed=seed
        )
        result["eval_accuracy_after"] = stats["accuracy"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument(
        "--trainers",
        default="grpo,tlt,tlt_padded",
        help="any of grpo, tlt, tlt_padded (TRL's training layout), tlt_new (a new EAGLE-3 head: every default), "
        "tlt_warm (the warm-started head), tlt_lm (the 1-layer draft LM)",
    )
    parser.add_argument("--epochs", type=int, default=1, help="passes over the run's prompts (steps divisible by it)")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=512)
    parser.add_argument("--learning-rate", type=float, default=5e-5)
    parser.add_argument(
        "--drafter-type",
        default="eagle3",
        help="TLT drafter: eagle3 (warm-start head), eagle3-new (a new head: TLTConfig's defaults, nothing given), "
        "model (1-layer draft LM), ngram, none",
    )
    parser.add_argument("--tlt-args", default="{}", help="extra TLTConfig fields for the TLT trainers, as JSON")
    parser.add_argument(
        "--acceptance-every", type=int, default=0, help="measure the drafter's acceptance at k=4 every N steps"
    )
    parser.add_argument("--eval-problems", type=int, default=64)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--output", default=None)
    parser.add_argument("--plot", default=None, help="PNG of the phases of a step per trainer (median seconds)")
    parser.add_argument("--plot-steps", default=None, help="PNG of step times and probed acceptance per step")
    args = parser.parse_args()
    if args.epochs < 1 or args.steps % args.epochs:
        raise SystemExit(f"--epochs must be >= 1 and divide --steps ({args.steps}), got {args.epochs}.")

    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:  # under torchrun: the 2-process variant
        dist.init_process_group("gloo")
        if args.eval_problems or args.num_prompts % dist.get_world_size():
            raise SystemExit("Under torchrun pass --eval-problems 0 and a --num-prompts divisible by the processes.")
    main_process = not dist.is_initialized() or dist.get_rank() == 0
    policy_path = build_policy(cache_dir=args.cache_dir)
    seeds = [int(s) for s in args.seeds.split(",")]
    names = args.trainers.split(",")
    runs: dict[str, dict[int, dict]] = {n: {} for n in names}
    before = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, seed in enumerate(seeds):
            if args.eval_problems:
                model = AutoModelForCausalLM.from_pretrained(policy_path).eval()
                tokenizer = AutoTokenizer.from_pretrained(policy_path)
                before[seed] = evaluate_policy(
                    model, tokenizer, make_dataset(args.eval_problems, seed=777), num_generations=4, seed=seed
                )["accuracy"]
            for name in names if i % 2 == 0 else names[::-1]:
                if main_process:
                    print(f"== seed {seed}: {name} ==", flush=True)
                runs[name][seed] = run(name, policy_path, seed, args, os.path.join(tmp, f"{name}-{seed}"))
                r = runs[name][seed]
                if main_process:
                    print(
                        f"   median step {statistics.median(r['step_time']):.2f}s, rollout "
                        f"{statistics.median(r['rollout_time']):.2f}s, reward first 5 steps "
                        f"{statistics.mean(r['reward'][:5]):.3f}, last 5 {statistics.mean(r['reward'][-5:]):.3f}"
                        + (f", eval accuracy {before[seed]:.3f} -> {r['eval_accuracy_after']:.3f}" if before else ""),
                        flush=True,
                    )

    def pooled(name, key):
        return statistics.median([t for seed in seeds for t in runs[name][seed][key]])

    def mean_curve(name):
        return [statistics.mean(vals) for vals in zip(*(runs[name][s]["reward"] for s in seeds))]

    result = {
        "benchmark": "e2e",
        "policy": policy_path.name,
        "steps": args.steps,
        "seeds": seeds,
        "batch": f"{args.num_prompts} prompts x {args.num_generations} generations",
        "processes": world_size(),
        "max_completion_length": args.max_completion_length,
        "learning_rate": args.learning_rate,
        "drafter_type": args.drafter_type,
        "tlt_args": json.loads(args.tlt_args),
        "eval_accuracy_before": before,
        "runs": runs,
    }
    for name in names:
        result[f"median_step_time_{name}"] = pooled(name, "step_time")
        result[f"median_rollout_time_{name}"] = pooled(name, "rollout_time")
        result[f"median_training_time_{name}"] = pooled(name, "training_time")
        result[f"rollout_share_{name}"] = sum(t for s in seeds for t in runs[name][s]["rollout_time"]) / sum(
            t for s in seeds for t in runs[name][s]["step_time"]
        )
        result[f"reward_{name}"] = mean_curve(name)
        result[f"profile_{name}"] = phase_profile(runs, name, seeds)
    if {"grpo", "tlt"} <= set(names):
        result["step_time_ratio"] = result["median_step_time_grpo"] / result["median_step_time_tlt"]
        result["rollout_time_ratio"] = result["median_rollout_time_grpo"] / result["median_rollout_time_tlt"]
        result["training_phase_ratio"] = result["median_training_time_grpo"] / result["median_training_time_tlt"]
        result["reward_test"] = reward_comparison(runs, seeds)

    def late_median(name):  # steps 10 to the end: after a new drafter's first steps
        return statistics.median([t for s in seeds for t in runs[name][s]["step_time"][9:]])

    for name in names:  # every TLT arm against GRPOTrainer, in this run
        if name.startswith("tlt") and "grpo" in names:
            result[f"step_time_ratio_{name}"] = result["median_step_time_grpo"] / result[f"median_step_time_{name}"]
            result[f"step_time_ratio_steps_10_on_{name}"] = late_median("grpo") / late_median(name)
    if {"tlt", "tlt_padded"} <= set(names):
        result["training_phase_ratio_padded_over_tlt"] = (
            result["median_training_time_tlt_padded"] / result["median_training_time_tlt"]
        )
        result["step_time_ratio_padded_over_tlt"] = (
            result["median_step_time_tlt_padded"] / result["median_step_time_tlt"]
        )
    if not main_process:
        return
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    write_json(result, args.output)
    if args.plot:
        plot_phases(result, names, args.plot)
    if args.plot_steps:
        plot_steps(result, names, args.plot_steps)


if __name__ == "__main__":
    main()
