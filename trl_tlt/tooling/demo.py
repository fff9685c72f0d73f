"""The main job (`make demo`): GRPO with TLTGRPOTrainer on the embedded workload, built offline, next to TRL's own.

Takes the drift scenario of `trl_tlt.tooling.workload` (`build_drift_policy`: a policy trained by SFT on solutions in
two styles, writing the second in about a quarter of its samples, and its warm-start EAGLE-3 drafter) as shipped with
the package, checked against its checksums (`--rebuild` builds both from code instead, deterministically); GRPO under `style_reward` (1 for a correct answer, times 1.5 in the "Step 1: 7+13=20" style) moves the policy
to that style while the reward rises, so a drafter frozen at the start goes stale. Then:

1. runs GRPO with `TLTGRPOTrainer` (EAGLE-3 drafter trained online between rollouts with `TLTConfig`'s defaults;
   bandit selector), printing a
   per-step table (reward, rollout seconds, acceptance length, speculated fraction, drafter loss) under a progress
   bar, logging to TensorBoard, and every `--eval-every` steps measuring the acceptance length of the adaptive drafter
   and of a frozen copy of the starting one on the same held-out prompts;
2. runs the same GRPO with TRL's `GRPOTrainer` (same seed, prompts and settings) for comparison;
3. writes PNG plots: acceptance length over RL steps (adaptive vs frozen), active batch size over the decode steps
   of the longest rollout with speculation marked (the long tail), rollout time per step and reward per step (TLT
   vs GRPO); exports the drafter and prints how to serve it with vLLM. Nothing is downloaded.

    python -m trl_tlt.tooling.demo [--steps 30] [--scenario drift|embedded] [--output-dir DIR] [--plots-dir DIR] [--no-baseline]
        [--rebuild]

`--scenario embedded` runs the embedded policy under its accuracy reward instead (little drift: adaptive and frozen
drafters stay equal).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile
import time
from pathlib import Path


PROMPT_SEED = 2024  # the training prompts (make_dataset)
EVAL_SEED = 999  # the held-out prompts of the drafter evaluations, never trained on
# GRPO's learning rate per scenario: in the drift scenario, high enough that the policy moves to the steps style
# within the run's 30 steps (at 3e-5 its share went from 0.33 to 0.47).
DEFAULT_LEARNING_RATE = {"drift": 1e-4, "embedded": 3e-5}
COLUMNS = ("step", "reward", "steps style", "rollout s", "step s", "accept len", "spec frac", "drafter loss")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="GRPO steps (8 prompts x 8 samples each).")
    parser.add_argument(
        "--scenario",
        choices=["drift", "embedded"],
        default="drift",
        help="drift: the drift scenario's policy and style_reward; embedded: the embedded policy, accuracy reward.",
    )
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=None,
        help="Both trainers' learning rate (default: 1e-4 in the drift scenario, 3e-5 in the embedded one).",
    )
    parser.add_argument("--seed", type=int, default=0, help="Both trainers' seed.")
    parser.add_argument(
        "--spot-learning-rate",
        type=float,
        default=None,
        help="Drafter learning rate (default: TLTConfig's).",
    )
    parser.add_argument(
        "--spot-steps-per-rollout",
        type=int,
        default=None,
        help="A fixed number of drafter steps between rollouts (default: TLTConfig's time budget).",
    )
    parser.add_argument("--output-dir", default=None, help="Where to write the run (default: a temporary folder).")
    parser.add_argument("--plots-dir", default=None, help="Where to write the PNG plots (default: OUTPUT_DIR/plots).")
    parser.add_argument("--eval-every", type=int, default=5, help="Steps between adaptive-vs-frozen evaluations.")
    parser.add_argument("--eval-prompts", type=int, default=32, help="Held-out prompts per evaluation.")
    parser.add_argument("--no-baseline", action="store_true", help="Skip the GRPOTrainer comparison run.")
    parser.add_argument("--max-completion-length", type=int, default=512)
    parser.add_argument(
        "--cache-dir", default=None, help="Policy cache (default: $TRL_TLT_CACHE or ~/.cache/trl_tlt)."
    )
    parser.add_argument(
        "--rebuild",
        action="store_true",
        help="Build the drift scenario's policy and head from code (16 minutes on 2 cores) instead of taking the "
        "shipped ones, and compare their checksums with the shipped builds'.",
    )
    parser.add_argument("--policy", default=None, help="A policy directory to use instead of the embedded one.")
    parser.add_argument(
        "--drafter", default=None, help="With --policy: its EAGLE-3 drafter (default: a new head, trained online)."
    )
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")
    from transformers import AutoTokenizer

    from trl_tlt.tooling.provenance import stamp
    from trl_tlt.tooling.workload import build_drift_policy, build_eagle3_drafter, build_policy, make_dataset
    from trl_tlt.tooling.workload.builds import build_checksum

    if args.policy:
        policy_path, drafter_path = args.policy, args.drafter
    elif args.scenario == "drift":
        policy_path, drafter_path = (
            str(p) for p in build_drift_policy(cache_dir=args.cache_dir, rebuild=args.rebuild)
        )
    else:
        policy_path = str(build_policy(cache_dir=args.cache_dir))
        drafter_path = str(build_eagle3_drafter(cache_dir=args.cache_dir))
    builds = {Path(path).name: build_checksum(path) for path in (policy_path, drafter_path) if path}
    print("builds (tensor checksums; the same on every machine of one kind, torch version and recipe):", flush=True)
    for name, checksum in builds.items():
        print(f"  {name}  {checksum}", flush=True)
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="trl-tlt-demo-")
    plots_dir = args.plots_dir or os.path.join(output_dir, "plots")
    tensorboard = importlib.util.find_spec("tensorboard") is not None
    common, reward_funcs = grpo_settings(args, tensorboard)
    tokenizer = AutoTokenizer.from_pretrained(policy_path, padding_side="left")
    data = (reward_funcs, tokenizer, make_dataset(8 * args.steps, seed=PROMPT_SEED))
    history = {"tlt": [], "grpo": [], "acceptance": [], "tail": None}

    print(f"== TLTGRPOTrainer: {args.steps} steps, EAGLE-3 drafter trained between rollouts ==", flush=True)
    config, export = run_tlt(args, policy_path, drafter_path, output_dir, common, data, history)
    if not args.no_baseline:
        print(f"== GRPOTrainer (TRL): the same {args.steps} steps, for comparison ==", flush=True)
        history["grpo"] = run_grpo(policy_path, os.path.join(output_dir, "grpo"), common, data)

    summary = summarize(history)
    os.makedirs(plots_dir, exist_ok=True)
    seeds = {"trainer": args.seed, "prompts": PROMPT_SEED, "eval_prompts": EVAL_SEED}
    settings = {"scenario": args.scenario, "learning_rate": common["learning_rate"], "steps": args.steps}
    record = stamp({"summary": summary, "seeds": seeds, "settings": settings, "builds": builds, **history})
    with open(os.path.join(plots_dir, "demo.json"), "w") as f:
        json.dump(record, f, indent=1)
    written = write_plots(history, plots_dir)
    print(f"demo finished: run in {output_dir}; plots: {', '.join(written) or 'none (matplotlib not installed)'}")
    if tensorboard:
        print(f"TensorBoard: tensorboard --logdir {output_dir}")
    print(
        "serve the policy with its drafter in vLLM:\n"
        f'  LLM(model="{policy_path}", speculative_config={{"method": "eagle3", "model": "{export}", '
        f'"num_speculative_tokens": {config.num_speculative_tokens}}})'
    )
    return history


def grpo_settings(args, tensorboard: bool) -> tuple[dict, object]:
    """The settings both trainers share, and the reward functions of the scenario."""
    import torch

    from trl_tlt.tooling.workload import accuracy_reward, drift_rewards

    common = dict(
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        gradient_checkpointing=False,
        report_to=["tensorboard"] if tensorboard else "none",
        per_device_train_batch_size=8,  # one prompt's group per micro-batch,
        gradient_accumulation_steps=8,  # 8 groups (64 samples) per optimizer step and per rollout
        num_generations=8,
        max_completion_length=args.max_completion_length,
        max_steps=args.steps,
        learning_rate=DEFAULT_LEARNING_RATE[args.scenario] if args.learning_rate is None else args.learning_rate,
        logging_steps=1,
        save_strategy="no",
        seed=args.seed,
    )
    if args.scenario != "drift":
        return common, accuracy_reward
    rewards = drift_rewards()  # the style share and the accuracy are logged beside the reward (weight 0)
    common["reward_weights"] = rewards["reward_weights"]
    return common, rewards["reward_funcs"]


def quiet(trainer) -> None:
    """The progress bar without the raw log dicts (the demo's table replaces them)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    class Progress(ProgressCallback):
        def on_log(self, *a, **k):
            pass

    for callback in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(callback)
    trainer.add_callback(Progress())


def run_tlt(args, policy_path, drafter_path, output_dir, common, data, history) -> tuple:
    """TLTGRPOTrainer with TLTConfig's drafter defaults: the per-step table, the adaptive and frozen heads' acceptance
    every `--eval-every` steps, the longest rollout's tail; the drafter exported. Returns (config, export dir)."""
    from transformers import AutoModelForCausalLM, TrainerCallback

    from trl_tlt import TLTConfig, TLTGRPOTrainer
    from trl_tlt.drafters.eagle3 import Eagle3Drafter
    from trl_tlt.engine.sampling import SamplingParams
    from trl_tlt.tooling.workload import make_dataset, prompt_token_ids
    from trl_tlt.training.warm_start import evaluate_acceptance

    reward_funcs, tokenizer, train_set = data
    eval_prompts = prompt_token_ids(tokenizer, make_dataset(args.eval_prompts, seed=EVAL_SEED)["prompt"])
    eval_params = SamplingParams(
        temperature=1.0, max_new_tokens=args.max_completion_length, eos_token_ids=(tokenizer.eos_token_id,)
    )

    def evaluate(step):
        policy = trainer.model
        was_training = policy.training
        policy.eval()
        row = {"step": step}
        for name, head in (("adaptive", trainer.tlt_drafter.model), ("frozen", frozen)):
            stats = evaluate_acceptance(policy, Eagle3Drafter(head), eval_prompts, eval_params, k=4, seed=0)
            row[name] = stats["mean_acceptance_length"]
        policy.train(was_training)
        history["acceptance"].append(row)
        print(f"  step {step}: acceptance length adaptive {row['adaptive']:.2f}, frozen {row['frozen']:.2f}")

    class Table(TrainerCallback):
        def on_train_begin(self, *a, **k):
            print("".join(f"{c:>13}" for c in COLUMNS), flush=True)

        def on_log(self, _args, state, _control, logs=None, **kwargs):
            if logs and "reward" in logs:
                record_step(history, state.global_step, logs, trainer.tlt_last_stats)

        def on_step_end(self, _args, state, _control, **kwargs):
            if state.global_step % args.eval_every == 0 or state.global_step == args.steps:
                evaluate(state.global_step)

    spot = {}  # TLTConfig's defaults unless asked otherwise
    if args.spot_learning_rate is not None:
        spot["spot_learning_rate"] = args.spot_learning_rate
    if args.spot_steps_per_rollout is not None:
        spot["spot_steps_per_rollout"] = args.spot_steps_per_rollout
    drafter_kwargs = {"drafter_model_name_or_path": drafter_path} if drafter_path else {}
    config = TLTConfig(output_dir=output_dir, **drafter_kwargs, **spot, **common)
    trainer = TLTGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(policy_path),
        reward_funcs=reward_funcs,
        args=config,
        train_dataset=train_set,
        processing_class=tokenizer,
        callbacks=[Table()],
    )
    quiet(trainer)
    frozen = trainer.tlt_drafter.model.frozen_copy()
    evaluate(0)
    trainer.train()
    export = os.path.join(output_dir, "drafter")
    trainer.save_drafter(export)
    return config, export


def record_step(history: dict, step: int, logs: dict, stats) -> None:
    """One row of the table (printed and kept), and the rollout with the most decode steps (the longest tail)."""
    row = {
        "step": step,
        "reward": logs["reward"],
        "steps_style_fraction": logs.get("rewards/steps_style_fraction/mean", float("nan")),
        "rollout_seconds": logs["tlt/rollout_seconds"],
        "step_seconds": logs["step_time"],
        "acceptance_length": logs["tlt/mean_acceptance_length"],
        "spec_step_fraction": logs["tlt/spec_step_fraction"],
        "drafter_loss": logs.get("tlt/drafter_loss", float("nan")),
    }
    history["tlt"].append(row)
    print("".join(f"{v:>13.3f}" if isinstance(v, float) else f"{v:>13}" for v in row.values()), flush=True)
    if history["tail"] is None or len(stats.active_batch_sizes) > len(history["tail"]["active"]):
        history["tail"] = {
            "step": step,
            "active": list(stats.active_batch_sizes),
            "k": list(stats.num_speculative_tokens),
        }


def run_grpo(policy_path, output_dir, common, data) -> list[dict]:
    """TRL's GRPOTrainer with the same settings, its rollouts timed; the rows of its table."""
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    reward_funcs, tokenizer, train_set = data

    class Timed(GRPOTrainer):
        def _generate_single_turn(self, *a, **k):
            start = time.perf_counter()
            out = super()._generate_single_turn(*a, **k)
            self.rollout_times.append(time.perf_counter() - start)
            return out

    baseline = Timed(
        model=AutoModelForCausalLM.from_pretrained(policy_path),
        reward_funcs=reward_funcs,
        args=GRPOConfig(output_dir=output_dir, **common),
        train_dataset=train_set,
        processing_class=tokenizer,
    )
    baseline.rollout_times = []
    quiet(baseline)
    baseline.train()
    logs = [h for h in baseline.state.log_history if "reward" in h]
    return [
        {
            "step": i + 1,
            "reward": h["reward"],
            "steps_style_fraction": h.get("rewards/steps_style_fraction/mean", float("nan")),
            "rollout_seconds": t,
            "step_seconds": h["step_time"],
        }
        for i, (h, t) in enumerate(zip(logs, baseline.rollout_times))
    ]


def summarize(history: dict) -> dict:
    """The run's headline figures (printed, and recorded in demo.json's `summary`, which README quotes)."""
    import math
    import statistics

    tlt, grpo, acceptance = history["tlt"], history["grpo"], history["acceptance"]
    summary = {}
    if acceptance:
        first, last = acceptance[0], acceptance[-1]
        summary |= {
            "acceptance_start": first["adaptive"],
            "acceptance_end_adaptive": last["adaptive"],
            "acceptance_end_frozen": last["frozen"],
            "acceptance_lowest_adaptive": min(a["adaptive"] for a in acceptance),
            "adaptive_over_frozen_end": last["adaptive"] / last["frozen"],
        }
        print(
            f"acceptance length, step {first['step']} -> {last['step']}: adaptive {first['adaptive']:.2f} -> "
            f"{last['adaptive']:.2f}, frozen {first['frozen']:.2f} -> {last['frozen']:.2f} "
            f"(adaptive / frozen {last['adaptive'] / last['frozen']:.2f}x)"
        )
    if tlt:
        for key in ("steps_style_fraction", "reward"):
            if all(math.isfinite(r.get(key, math.nan)) for r in tlt):  # logged in this scenario
                summary[f"{key}_first5"] = statistics.mean(r[key] for r in tlt[:5])
                summary[f"{key}_last5"] = statistics.mean(r[key] for r in tlt[-5:])
    if not tlt or not grpo:
        return summary
    for key, label in (("rollout_seconds", "rollout"), ("step_seconds", "step")):
        a, b = statistics.median(r[key] for r in grpo), statistics.median(r[key] for r in tlt)
        summary |= {f"median_{label}_seconds_grpo": a, f"median_{label}_seconds_tlt": b, f"{label}_ratio": a / b}
        print(f"median {label} time: GRPOTrainer {a:.2f} s, TLTGRPOTrainer {b:.2f} s ({a / b:.2f}x)")
    summary["mean_reward_grpo"] = statistics.mean(r["reward"] for r in grpo)
    summary["mean_reward_tlt"] = statistics.mean(r["reward"] for r in tlt)
    print(
        f"mean reward: GRPOTrainer {summary['mean_reward_grpo']:.3f}, TLTGRPOTrainer {summary['mean_reward_tlt']:.3f}"
    )
    return summary


def write_plots(history: dict, plots_dir: str) -> list[str]:
    """The demo's four PNG plots from its recorded history; returns the paths written."""
    if importlib.util.find_spec("matplotlib") is None:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name):
        path = os.path.join(plots_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    if history["acceptance"]:
        fig, ax = plt.subplots(figsize=(6, 4))
        steps = [r["step"] for r in history["acceptance"]]
        ax.plot(steps, [r["adaptive"] for r in history["acceptance"]], marker="o", label="adaptive (trained online)")
        ax.plot(steps, [r["frozen"] for r in history["acceptance"]], marker="s", label="frozen copy of the start")
        ax.set(
            xlabel="RL step",
            ylabel="acceptance length (k = 4, held-out prompts)",
            title="Drafter acceptance as GRPO moves the policy",
        )
        ax.legend()
        save(fig, "acceptance.png")
    if history["tail"]:
        tail = history["tail"]
        fig, ax = plt.subplots(figsize=(7, 4))
        steps = range(len(tail["active"]))
        ax.plot(steps, tail["active"], color="gray", lw=1, label="active sequences")
        speculated = [i for i, k in zip(steps, tail["k"]) if k > 0]
        ax.scatter(speculated, [tail["active"][i] for i in speculated], s=6, color="tab:green", label="speculated")
        ax.set(
            xlabel="decode step",
            ylabel="active batch size",
            title=f"The long tail: rollout of step {tail['step']} (64 sequences)",
        )
        ax.legend()
        save(fig, "tail.png")
    for key, ylabel, name in (
        ("rollout_seconds", "rollout time (s)", "rollout_time.png"),
        ("reward", "mean reward", "reward.png"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for run, label in (("grpo", "GRPOTrainer (TRL)"), ("tlt", "TLTGRPOTrainer")):
            if history[run]:
                ax.plot([r["step"] for r in history[run]], [r[key] for r in history[run]], marker=".", label=label)
        ax.set(xlabel="RL step", ylabel=ylabel)
        ax.legend()
        save(fig, name)
    return written


if __name__ == "__main__":
    main()
