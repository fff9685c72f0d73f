"""Spot-training benchmarks on the embedded workload (2-core CPU friendly).

`--mode ddp` (under `torchrun --nproc_per_node 2`, gloo, one thread per process): blocks of `--steps` GRPO steps
with spot training off and on, alternating, each from the same SFT policy and warm-start EAGLE-3 drafter. Records
every step's time and, per rank and rollout, the rank's rollout seconds, its idle seconds and the drafter steps it
took; reports the median step time with spot training on vs off (the first step of a block is warm-up, dropped).

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 scripts/bench/bench_spot.py --mode ddp --output docs/benchmarks/spot_ddp_cpu.json

`--mode adapt` (one process): GRPO with spot training from a starting drafter, while a frozen copy of that drafter
is kept aside. Every `--eval-every` steps both drafters draft for the current policy on the same held-out prompts
(same seed, k = 4, speculation at every step): their mean acceptance lengths, and the policy's reward, are recorded
and plotted.

    python scripts/bench/bench_spot.py --mode adapt --steps 40 --output docs/benchmarks/spot_adapt_cpu.json

`--mode drift` (one process): `--mode adapt` on the drift scenario (`trl_tlt.tooling.workload.build_drift_policy`, reward
`style_reward`), one run per `--seeds`: GRPO moves the policy to its second solution style while the reward rises;
records per seed the acceptance of the online drafter and of a frozen copy of the start (and the time of the
held-out rollout with each), the reward, the steps-style share, before/after samples; and across seeds
`adaptive_over_frozen_final` (mean), the acceptance changes, the reward rise vs the seed spread, and the share of
step time spent in spot training.

    python scripts/bench/bench_spot.py --mode drift --seeds 0 1 --steps 80 --learning-rate 2e-5 --prompts-per-rank 8 \
        --eval-every 10 --spot-lr 3e-4 --spot-steps 8 --output docs/benchmarks/drift_cpu.json --plot docs/spot_drift.png
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time

from trl_tlt.tooling.benchmarks import machine, trainer_config, write_json  # first: the Hugging Face libraries offline


# isort: split

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402

from trl_tlt import TLTConfig, TLTGRPOTrainer  # noqa: E402
from trl_tlt.drafters.eagle3 import Eagle3Drafter, Eagle3Model  # noqa: E402
from trl_tlt.engine.generate import SpeculativeEngine  # noqa: E402
from trl_tlt.engine.sampling import SamplingParams  # noqa: E402
from trl_tlt.tooling.workload import (  # noqa: E402
    accuracy_reward,
    build_drift_policy,
    build_eagle3_drafter,
    build_policy,
    drift_rewards,
    evaluate_policy,
    make_dataset,
    prompt_token_ids,
)
from trl_tlt.training.warm_start import evaluate_acceptance  # noqa: E402


# Drift runs: the start and end policies each answer these held-out prompts this many times.
HELDOUT_PROMPTS, HELDOUT_SAMPLES = 64, 4


class Recorder(TLTGRPOTrainer):
    """Records, per rollout, this rank's rollout seconds and spot-phase statistics."""

    def _generate_single_turn(self, *args, **kwargs):
        start = time.perf_counter()
        out = super()._generate_single_turn(*args, **kwargs)
        spot = self.tlt_last_spot
        wall = time.perf_counter() - start
        self.trace.append(
            {
                "rollout_seconds": self.tlt_last_stats.total_s,
                "phase_seconds": wall,
                "drafter_steps": spot.steps if spot else 0,
                "idle_seconds": spot.idle_seconds if spot else 0.0,
                "seconds_used": spot.seconds_used if spot else 0.0,
            }
        )
        return out


def trainer_for(args, policy_path, drafter_path, output_dir, seed, spot, reward_funcs=accuracy_reward, **overrides):
    config = trainer_config(
        "tlt", output_dir, num_prompts=args.prompts_per_rank, num_generations=args.num_generations,
        max_completion_length=args.max_completion_length, steps=args.steps, seed=seed,
        learning_rate=args.learning_rate, temperature=1.0,
        gradient_checkpointing=True,  # GRPOConfig's default, as the recorded runs had it
        tlt_args=dict(drafter_type="eagle3", drafter_model_name_or_path=drafter_path, spot_training=spot, **overrides),
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(policy_path)
    tokenizer = AutoTokenizer.from_pretrained(policy_path, padding_side="left")
    data = make_dataset(args.prompts_per_rank * args.world * args.steps, seed=100 + seed)
    trainer = Recorder(
        model=model, reward_funcs=reward_funcs, args=config, train_dataset=data, processing_class=tokenizer
    )
    trainer.trace = []
    return trainer


def run_ddp(args) -> dict:
    import torch.distributed as dist

    policy_path, drafter_path = build_policy(verbose=False), build_eagle3_drafter(verbose=False)
    blocks = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, spot in enumerate([False, True] * args.blocks):
            overrides = {"speculative_selector": args.selector, "spot_learning_rate": args.spot_lr}
            if args.greedy:  # identical rollouts with and without spot training (GRPO then learns nothing)
                overrides["generation_kwargs"] = {"do_sample": False}
            trainer = trainer_for(
                args, policy_path, str(drafter_path), os.path.join(tmp, str(i)), args.seed, spot, **overrides
            )
            trainer.train()
            logs = [h for h in trainer.state.log_history if "step_time" in h]
            block = {
                "spot_training": spot,
                "step_time": [h["step_time"] for h in logs],
                "reward": [h["reward"] for h in logs],
                "mean_acceptance_length": [h.get("tlt/mean_acceptance_length") for h in logs],
                "drafter_loss": [h.get("tlt/drafter_loss") for h in logs],
            }
            traces = [None] * dist.get_world_size()
            dist.all_gather_object(traces, trainer.trace)
            block["per_rank"] = traces
            blocks.append(block)
            if dist.get_rank() == 0:
                print(
                    f"block {i} spot={spot}: median step {statistics.median(block['step_time'][1:]):.3f}s", flush=True
                )

    def times(spot):
        return [t for b in blocks if b["spot_training"] == spot for t in b["step_time"][1:]]

    def median(spot):
        return statistics.median(times(spot))

    # 95% bootstrap interval of the ratio of medians (steps resampled within each arm)
    rng = random.Random(0)
    ratios = sorted(
        statistics.median(rng.choices(times(True), k=len(times(True))))
        / statistics.median(rng.choices(times(False), k=len(times(False))))
        for _ in range(2000)
    )

    # Per rollout of the spot-on blocks: the rank that finished its rollout first, and the one that finished last.
    rollouts = [r for b in blocks if b["spot_training"] for r in zip(*b["per_rank"])]
    first = [min(r, key=lambda x: x["rollout_seconds"]) for r in rollouts]
    last = [max(r, key=lambda x: x["rollout_seconds"]) for r in rollouts]
    return {
        "benchmark": "spot_ddp",
        "machine": f"{machine()} per process",
        "world_size": dist.get_world_size(),
        "policy": policy_path.name,
        "drafter": drafter_path.name,
        "steps_per_block": args.steps,
        "blocks": len(blocks),
        "batch": f"{args.prompts_per_rank} prompts x {args.num_generations} generations per rank",
        "median_step_time_off": median(False),
        "median_step_time_on": median(True),
        "step_time_on_over_off": median(True) / median(False),
        "step_time_on_over_off_95ci": [ratios[50], ratios[1949]],
        "steps_per_arm": len(times(True)),
        "sampling": "greedy" if args.greedy else "temperature 1",
        "selector": args.selector,
        "spot_learning_rate": args.spot_lr,
        "rollouts": len(rollouts),
        "rollouts_where_first_done_rank_trained": sum(x["drafter_steps"] > 0 for x in first),
        "rollouts_where_last_done_rank_trained": sum(x["drafter_steps"] > 0 for x in last),
        "mean_drafter_steps_first_done_rank": statistics.mean(x["drafter_steps"] for x in first),
        "mean_idle_seconds_first_done_rank": statistics.mean(x["idle_seconds"] for x in first),
        # What spot training costs the step: the last rank's wait from the end of its rollout until the merge is done
        # (the others finish their drafter phase, then the all-reduces); without spot training it waits for nobody.
        "mean_delay_seconds_last_done_rank": statistics.mean(x["idle_seconds"] for x in last),
        "delay_share_of_median_step": statistics.mean(x["idle_seconds"] for x in last) / median(False),
        "runs": blocks,
    }


def run_adapt(args, seed: int, drift: bool = False) -> dict:
    """GRPO with spot training from a starting drafter; a frozen copy of it drafts beside the online one at every
    evaluation. `drift`: the drift scenario (`build_drift_policy`, `style_reward`) instead of the embedded policy."""
    overrides = dict(
        spot_steps_per_rollout=args.spot_steps, speculative_selector="fixed", spot_learning_rate=args.spot_lr
    )
    if drift:
        policy_path, drafter_path = (str(p) for p in build_drift_policy(verbose=False))
        overrides.update(drift_rewards())
    else:
        policy_path = str(build_policy(verbose=False))
        drafter_path = None if args.start == "new" else str(build_eagle3_drafter(verbose=False))
    tokenizer = AutoTokenizer.from_pretrained(policy_path)
    eval_set = make_dataset(args.eval_prompts, seed=999)
    eval_prompts = prompt_token_ids(tokenizer, eval_set["prompt"])
    heldout_set = make_dataset(HELDOUT_PROMPTS, seed=998)
    params = SamplingParams(
        temperature=1.0, max_new_tokens=args.max_completion_length, eos_token_ids=(tokenizer.eos_token_id,)
    )
    with tempfile.TemporaryDirectory() as tmp:
        trainer = trainer_for(args, policy_path, drafter_path, tmp, seed, True, **overrides)
        adaptive: Eagle3Model = trainer.tlt_drafter.model
        frozen = adaptive.frozen_copy()
        curve, samples, results = [], {}, {}

        def evaluate(step):
            # Both drafters draft for the current policy on the same held-out prompts (same seed, k = 4): acceptance
            # and the time of that rollout with each.
            policy = trainer.model.eval()
            row = {"step": step}
            for name, head in (("adaptive", adaptive), ("frozen", frozen)):
                start = time.perf_counter()
                stats = evaluate_acceptance(policy, Eagle3Drafter(head), eval_prompts, params, k=4, seed=seed)
                row[f"{name}_rollout_seconds"] = time.perf_counter() - start
                row[name] = stats["mean_acceptance_length"]
            policy.train()
            curve.append(row)
            print(
                f"seed {seed} step {step}: acceptance adaptive {row['adaptive']:.3f} frozen {row['frozen']:.3f}",
                flush=True,
            )

        def sample(when):
            engine = SpeculativeEngine(trainer.model.eval(), pad_token_id=tokenizer.pad_token_id)
            out = engine.generate(
                eval_prompts[:2], params, generator=torch.Generator().manual_seed(seed)
            ).completion_ids
            trainer.model.train()
            samples[when] = tokenizer.batch_decode(out, skip_special_tokens=True)

        def heldout(when):
            # The policy's accuracy and steps-style share on the same held-out prompts at the start and the end
            # (paired, so not subject to the batch-to-batch spread of the per-step reward logs); one batch.
            stats = evaluate_policy(
                trainer.model.eval(),
                tokenizer,
                heldout_set,
                num_generations=HELDOUT_SAMPLES,
                max_new_tokens=args.max_completion_length,
                seed=seed,
                prompts_per_batch=HELDOUT_PROMPTS,
            )
            trainer.model.train()
            cells = stats["accuracy_by_style"]
            steps = sum(n for cell, (_, n) in cells.items() if cell.startswith("steps"))
            results[f"heldout_accuracy_{when}"] = stats["accuracy"]
            results[f"heldout_steps_style_fraction_{when}"] = steps / sum(n for _, n in cells.values())

        class Eval(TrainerCallback):
            def on_log(self, a, state, control, logs=None, **kwargs):
                if logs and "reward" in logs:
                    share = logs.get("rewards/steps_style_fraction/mean")
                    style = f" steps-style share {share:.2f}" if share is not None else ""
                    accuracy = logs.get("rewards/accuracy_reward/mean")
                    style += f" accuracy {accuracy:.2f}" if accuracy is not None else ""
                    print(f"seed {seed} step {state.global_step}: reward {logs['reward']:.3f}{style}", flush=True)

            def on_step_end(self, a, state, control, **kwargs):
                if state.global_step % args.eval_every == 0 or state.global_step == args.steps:
                    evaluate(state.global_step)

        trainer.add_callback(Eval())
        evaluate(0)
        sample("start")
        if drift:
            heldout("first")
        trainer.train()
        sample("end")
        if drift:
            heldout("last")
    logs = [h for h in trainer.state.log_history if "reward" in h]
    window = min(10, len(logs))
    return {
        "seed": seed,
        "policy": os.path.basename(policy_path),
        "start_drafter": drafter_path and os.path.basename(drafter_path) or "new EAGLE-3 head",
        "acceptance": curve,
        "final_ratio_adaptive_over_frozen": curve[-1]["adaptive"] / curve[-1]["frozen"],
        "reward": [h["reward"] for h in logs],
        "reward_first": statistics.mean(h["reward"] for h in logs[:window]),
        "reward_last": statistics.mean(h["reward"] for h in logs[-window:]),
        "steps_style_fraction": [h.get("rewards/steps_style_fraction/mean") for h in logs],
        "accuracy": [h.get("rewards/accuracy_reward/mean") for h in logs],
        "samples": samples,
        **results,
        "drafter_loss": [h.get("tlt/drafter_loss") for h in logs],
        "spot_seconds": [h.get("tlt/spot_seconds") for h in logs],
        "step_time": [h["step_time"] for h in logs],
    }


def run_settings(args) -> dict:
    """The settings of an adapt or drift run, as recorded in its JSON."""
    return {
        "steps": args.steps,
        "batch": f"{args.prompts_per_rank} prompts x {args.num_generations} generations",
        "learning_rate": args.learning_rate,
        "spot_steps_per_rollout": args.spot_steps,
        "spot_learning_rate": args.spot_lr,
        "eval_prompts": args.eval_prompts,
    }


def run_drift(args) -> dict:
    """The drift scenario over `--seeds`: adaptive vs frozen acceptance as GRPO moves the policy's style."""
    runs = [run_adapt(args, seed, drift=True) for seed in args.seeds]

    def change(run, name):
        return run["acceptance"][-1][name] / run["acceptance"][0][name] - 1

    rises = [r["reward_last"] - r["reward_first"] for r in runs]
    finals = [r["reward_last"] for r in runs]
    spot, total = sum(sum(r["spot_seconds"]) for r in runs), sum(sum(r["step_time"]) for r in runs)
    return {
        "benchmark": "spot_drift",
        "machine": f"{machine()}, one process",
        "policy": runs[0]["policy"],
        "start_drafter": runs[0]["start_drafter"],
        "reward": "style_reward (1.0 for a correct answer, 1.5 if it is in the steps style)",
        "seeds": args.seeds,
        **run_settings(args),
        "training_minutes_per_seed": [sum(r["step_time"]) / 60 for r in runs],
        "adaptive_over_frozen_final": statistics.mean(r["final_ratio_adaptive_over_frozen"] for r in runs),
        "frozen_change": [change(r, "frozen") for r in runs],
        "adaptive_change": [change(r, "adaptive") for r in runs],
        "rollout_seconds_frozen_over_adaptive_final": statistics.mean(
            r["acceptance"][-1]["frozen_rollout_seconds"] / r["acceptance"][-1]["adaptive_rollout_seconds"]
            for r in runs
        ),
        "reward_rise": statistics.mean(rises),
        "reward_seed_spread": max(finals) - min(finals),
        "steps_style_fraction_first": statistics.mean(statistics.mean(r["steps_style_fraction"][:10]) for r in runs),
        "steps_style_fraction_last": statistics.mean(statistics.mean(r["steps_style_fraction"][-10:]) for r in runs),
        "accuracy_first": statistics.mean(statistics.mean(r["accuracy"][:10]) for r in runs),
        "accuracy_last": statistics.mean(statistics.mean(r["accuracy"][-10:]) for r in runs),
        **{
            f"heldout_{key}_{when}": statistics.mean(r[f"heldout_{key}_{when}"] for r in runs)
            for key in ("accuracy", "steps_style_fraction")
            for when in ("first", "last")
        },
        "spot_share_of_step_time": spot / total,
        "runs": runs,
    }


def plot_adapt(runs: list[dict], path: str) -> None:
    """Acceptance (adaptive vs frozen) over RL steps and the reward, one line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drift = runs[0]["steps_style_fraction"][0] is not None
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, run in enumerate(runs):
        color = f"C{i}"
        steps = [r["step"] for r in run["acceptance"]]
        seed = f"seed {run['seed']}"
        ax.plot(steps, [r["adaptive"] for r in run["acceptance"]], "o-", color=color, label=f"adaptive, {seed}")
        ax.plot(steps, [r["frozen"] for r in run["acceptance"]], "s--", color=color, label=f"frozen, {seed}")
        ax2.plot(range(1, len(run["reward"]) + 1), run["reward"], color=color, alpha=0.6, label=f"reward, {seed}")
        if drift:
            fraction = run["steps_style_fraction"]
            ax2.plot(range(1, len(fraction) + 1), fraction, ":", color=color, label=f"steps-style share, {seed}")
    ax.set(xlabel="RL step", ylabel="mean acceptance length (k = 4)")
    ax.set_title(f"{runs[0]['policy']}, start drafter {runs[0]['start_drafter']}", fontsize=8)
    ax.legend(fontsize=7)
    ax2.set(xlabel="RL step", ylabel="mean reward" + (" / steps-style share" if drift else " (accuracy)"))
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mode", choices=["ddp", "adapt", "drift"], required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--blocks", type=int, default=1, help="ddp: pairs of (off, on) blocks")
    parser.add_argument("--prompts-per-rank", type=int, default=4)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=512)
    parser.add_argument("--learning-rate", type=float, default=5e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="drift: one run per seed")
    parser.add_argument("--start", choices=["warm", "new"], default="warm", help="adapt: the starting drafter")
    parser.add_argument("--spot-steps", type=int, default=4, help="adapt: drafter steps per rollout")
    parser.add_argument("--spot-lr", type=float, default=TLTConfig.spot_learning_rate)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-prompts", type=int, default=32)
    parser.add_argument("--selector", default="fixed", help="ddp: speculative_selector (fixed = deterministic)")
    parser.add_argument("--greedy", action="store_true", help="ddp: greedy rollouts (identical with spot on/off)")
    parser.add_argument("--plot", default=None)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    if args.mode == "ddp":
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        args.world = dist.get_world_size()
        result = run_ddp(args)
        is_main = dist.get_rank() == 0
    elif args.mode == "adapt":
        args.world, is_main = 1, True
        run = run_adapt(args, args.seed)
        result = {
            "benchmark": "spot_adapt",
            "machine": f"{machine()} per process",
            **run_settings(args),
            **run,
        }
        if args.plot:
            plot_adapt([run], args.plot)
    else:
        args.world, is_main = 1, True
        result = run_drift(args)
        if args.plot:
            plot_adapt(result["runs"], args.plot)
    if not is_main:
        return
    print(
        json.dumps(
            {
                k: v
                for k, v in result.items()
                if k not in ("runs", "reward", "drafter_loss", "spot_seconds", "step_time", "steps_style_fraction")
            },
            indent=2,
        )
    )
    write_json(result, args.output)


if __name__ == "__main__":
    main()
