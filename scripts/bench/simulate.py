"""Long-tail rollout simulator (`trl_tlt.tooling.simulator`): calibration on our CPU measurements and the TLT paper's setup.

    python scripts/bench/simulate.py measure   # ~6 min on 2 CPU cores -> docs/benchmarks/sim_calibration_cpu.json
    python scripts/bench/simulate.py predict   # ~10 s, numpy only -> docs/benchmarks/simulator.json, docs/scale*.png

`measure` records, on the embedded policy and the machine it runs on: every decode step of `transformers.generate`
on a static batch of 8 x 8 rows (the stock GRPOTrainer's rollout), fitted as a + b x position; our engine's seconds
per emitted token per sequence at each active batch size, with no speculation, the n-gram drafter and the
warm-start EAGLE-3 head (bandit selector, as TLTGRPOTrainer runs them), with each rollout's lengths and time; and a
few steps of each trainer, to see how those costs carry into a training run.

`predict` feeds those costs, plus the response lengths and the non-rollout time of the end-to-end benchmark it
predicts (docs/benchmarks/e2e_eagle3_trace_cpu.json), into the simulator and compares the step-time ratio with the
measured one (`calibration_error`); then it predicts the TLT paper's setups (facts and assumptions in the PAPER_*
constants) from 8 to 512 GPUs. See docs/scale.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trl_tlt.tooling.benchmarks  # noqa: F401  (first: the Hugging Face libraries offline)


# isort: split

import numpy as np  # noqa: E402

from trl_tlt.tooling.provenance import machine, stamp  # noqa: E402
from trl_tlt.tooling.simulator import (  # noqa: E402
    Backend,
    Cluster,
    CostTable,
    LogNormalLengths,
    TraceLengths,
    rollout_seconds,
    simulate,
)


ROOT = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------------------------------------ measure (CPU)


def measure(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LogitsProcessor

    from trl_tlt.drafters.eagle3 import Eagle3Drafter, Eagle3Model
    from trl_tlt.drafters.ngram import NgramDrafter
    from trl_tlt.engine.generate import SpeculativeEngine
    from trl_tlt.engine.sampling import SamplingParams
    from trl_tlt.engine.speculation import BanditSpeculation, FixedSpeculation, SpeculationPolicy
    from trl_tlt.tooling.workload import build_eagle3_drafter, build_policy, make_dataset, prompt_token_ids

    torch.manual_seed(args.seed)
    policy_path, drafter_path = build_policy(verbose=False), build_eagle3_drafter(verbose=False)
    tokenizer = AutoTokenizer.from_pretrained(policy_path, padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(policy_path).eval()
    prompts = prompt_token_ids(tokenizer, make_dataset(args.rollouts * args.prompts, seed=args.seed + 7)["prompt"])

    # transformers.generate as GRPOTrainer runs it (a static batch of prompts x group rows): every decode step timed
    # by a logits processor; min_new_tokens keeps all rows running to the longest response GRPO allows. The step cost
    # grows with the cache (transformers' DynamicCache), so it is fitted as a + b t over positions t.
    class StepClock(LogitsProcessor):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    batch = [p for p in prompts[: args.prompts] for _ in range(args.group)]
    inputs = tokenizer.pad({"input_ids": batch}, return_tensors="pt")
    config = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, max_new_tokens=args.max_completion_length,
        min_new_tokens=args.max_completion_length, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    step_seconds, prefills = [], []
    for _ in range(args.generate_repeats):
        clock, start = StepClock(), time.perf_counter()
        with torch.no_grad():
            policy.generate(**inputs, generation_config=config, logits_processor=[clock], disable_compile=True)
        step_seconds.append(np.diff(clock.times).tolist())  # step t: time from logits t to logits t + 1
        prefills.append(clock.times[0] - start)
    per_position = np.median(np.array(step_seconds), axis=0)
    positions = np.arange(1, len(per_position) + 1, dtype=float)
    slope, intercept = np.polyfit(positions, per_position, 1)
    print(f"generate: {intercept * 1e3:.2f} ms + {slope * 1e6:.2f} us x position per step", flush=True)

    class Recording(SpeculationPolicy):
        def __init__(self, inner):
            self.inner, self.steps = inner, []

        def choose(self, batch_size):
            return self.inner.choose(batch_size)

        def update(self, batch_size, arm, num_emitted_tokens, seconds):
            self.steps.append((batch_size, num_emitted_tokens, seconds))
            self.inner.update(batch_size, arm, num_emitted_tokens, seconds)

    def bandit():
        arms = [("default", k) for k in (1, 2, 3, 4)]
        return BanditSpeculation(arms=arms, epsilon=0.1, seed=args.seed)

    head = Eagle3Model.from_pretrained(str(drafter_path), policy)
    variants = {
        "engine_no_spec": (None, FixedSpeculation(0)),
        "engine_ngram": (NgramDrafter(), bandit()),
        "engine_eagle3": (Eagle3Drafter(head), bandit()),
    }
    params = SamplingParams(
        temperature=1.0, max_new_tokens=args.max_completion_length, eos_token_ids=(tokenizer.eos_token_id,)
    )
    engines, rollouts = {}, {}
    for name, (drafter, selector) in variants.items():
        recorder = Recording(selector)
        engine = SpeculativeEngine(policy, drafter=drafter, speculation=recorder)
        generator = torch.Generator().manual_seed(args.seed)
        rollouts[name] = []
        for r in range(args.rollouts):
            group_prompts = [p for p in prompts[r * args.prompts : (r + 1) * args.prompts] for _ in range(args.group)]
            stats = engine.generate(group_prompts, params, generator=generator)
            rollouts[name].append(
                {
                    "seconds": stats.stats.total_s,
                    "prefill_seconds": stats.stats.prefill_s,
                    "mean_acceptance_length": stats.stats.mean_acceptance_length,
                    "lengths": [len(c) for c in stats.completion_ids],
                }
            )
        engines[name] = token_seconds_table(recorder.steps)
        median = statistics.median(r["seconds"] for r in rollouts[name])
        print(f"{name}: median rollout {median:.3f} s", flush=True)

    # a few steps of each trainer (another seed than the end-to-end benchmark's): rollout wall time and lengths, to
    # measure how the costs above carry over into a training run (caches, allocator, the trainer's own work)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_e2e

    trainer_args = argparse.Namespace(
        num_prompts=args.prompts, num_generations=args.group, max_completion_length=args.max_completion_length,
        steps=args.trainer_steps, learning_rate=5e-5, drafter_type="eagle3", eval_problems=0,
    )  # fmt: skip
    trainer_rollouts = {}
    for name in ("grpo", "tlt"):
        with tempfile.TemporaryDirectory() as tmp:
            run = bench_e2e.run(name, policy_path, args.seed + 2, trainer_args, tmp)
        trainer_rollouts[name] = [
            {"seconds": t, "lengths": lengths} for t, lengths in zip(run["rollout_time"], run["rollout_lengths"])
        ]
    return {
        "benchmark": "simulator_calibration",
        "machine": machine(),
        "policy": policy_path.name,
        "drafter": drafter_path.name,
        "batch": f"{args.prompts} prompts x {args.group} samples, T = 1, max {args.max_completion_length} tokens",
        "group_size": args.group,
        "generate_batch_size": len(batch),
        "generate_step_seconds": {"intercept": float(intercept), "per_position": float(slope)},
        "generate_prefill_seconds": statistics.median(prefills),
        "generate_step_seconds_by_position": per_position.tolist(),
        "engine_token_seconds": engines,
        "engine_rollouts": rollouts,
        "trainer_rollouts": trainer_rollouts,
    }


def token_seconds_table(steps) -> dict[str, float]:
    """Seconds per emitted token per sequence, per power-of-two bucket of the active batch size: the bucket's
    summed step seconds over its summed tokens per sequence, at the bucket's mean batch size."""
    buckets: dict[int, list] = {}
    for batch, emitted, seconds in steps:
        buckets.setdefault(int(np.log2(batch)), []).append((batch, emitted, seconds))
    table = {}
    for _, rows in sorted(buckets.items()):
        mean_batch = sum(b for b, _, _ in rows) / len(rows)
        table[f"{mean_batch:.2f}"] = sum(s for _, _, s in rows) / sum(e / b for b, e, _ in rows)
    return table


# ------------------------------------------------------------------------------------------------ predict


def table(mapping: dict[str, float]) -> CostTable:
    items = sorted((float(k), v) for k, v in mapping.items())
    return CostTable(tuple(k for k, _ in items), tuple(v for _, v in items))


def scaled(backend: Backend, factor: float) -> Backend:
    """The backend with every cost multiplied by `factor`."""

    def times(t: CostTable | None) -> CostTable | None:
        return None if t is None else CostTable(t.batch_sizes, tuple(v * factor for v in t.values))

    return Backend(backend.name, times(backend.decode), static=backend.static, context=times(backend.context))


def predict_cpu(calibration: dict, e2e: dict, steps: int) -> dict:
    """Our CPU machine: one instance, 8 GRPO groups of 8 per step; baseline = transformers.generate (static batch),
    TLT = our engine with the warm-start EAGLE-3 head and the bandit. Costs from the calibration run; response
    lengths and the non-rollout seconds from the end-to-end benchmark whose step-time ratio is predicted."""
    fit, batch = calibration["generate_step_seconds"], calibration["generate_batch_size"]
    engines = {"engine_no_spec": "engine_no_spec", "engine_ngram": "engine_ngram", "tlt_eagle3": "engine_eagle3"}
    backends = [
        Backend(
            "grpo_generate",
            CostTable((batch,), (fit["intercept"],)),
            context=CostTable((batch,), (fit["per_position"],)),
            static=True,
        )
    ] + [Backend(name, table(calibration["engine_token_seconds"][key])) for name, key in engines.items()]
    prefill = {"grpo_generate": calibration["generate_prefill_seconds"]}

    def replay(backend, rollouts):  # measured / predicted seconds of recorded rollouts (same lengths)
        return [
            r["seconds"] / (prefill[backend.name] + float(rollout_seconds(backend, [r["lengths"]])[0]))
            for r in rollouts
        ]

    # the fluid model on the calibration's own engine rollouts
    fluid_check = {}
    for backend in backends[1:]:
        rollouts = calibration["engine_rollouts"][engines[backend.name]]
        prefill[backend.name] = statistics.median(r["prefill_seconds"] for r in rollouts)
        ratios = replay(backend, rollouts)
        fluid_check[backend.name] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    # how the isolated costs carry over into a training run: the calibration's few trainer steps
    in_trainer = {}
    for name, arm in (("grpo_generate", "grpo"), ("tlt_eagle3", "tlt")):
        backend = next(b for b in backends if b.name == name)
        in_trainer[name] = statistics.median(replay(backend, calibration["trainer_rollouts"][arm]))
        backends[backends.index(backend)] = scaled(backend, in_trainer[name])
        prefill[name] *= in_trainer[name]

    # the response lengths of the benchmark's own rollouts (both trainers, all seeds), as GRPO groups
    group = calibration["group_size"]
    groups = [
        rollout[g : g + group]
        for arm in ("grpo", "tlt")
        for run in e2e["runs"][arm].values()
        for rollout in run["rollout_lengths"]
        for g in range(0, len(rollout), group)
    ]
    groups_per_rollout = len(next(iter(e2e["runs"]["grpo"].values()))["rollout_lengths"][0]) // group
    other = statistics.median(
        s - r
        for arm in ("grpo", "tlt")
        for run in e2e["runs"][arm].values()
        for s, r in zip(run["step_time"], run["rollout_time"])
    )
    cluster = Cluster(num_instances=1, groups_per_instance=groups_per_rollout, other_seconds=other)
    results = simulate(cluster, TraceLengths(groups), backends, num_steps=steps)
    summaries = {name: r.summary() for name, r in results.items()}
    for name, seconds in prefill.items():  # prefill is not part of the decode tables
        summaries[name]["median_step_seconds"] += seconds
        summaries[name]["median_rollout_seconds"] += seconds
    base, tlt = summaries["grpo_generate"], summaries["tlt_eagle3"]
    predicted = base["median_step_seconds"] / tlt["median_step_seconds"]
    measured = e2e["step_time_ratio"]
    return {
        "other_seconds": other,
        "fluid_model_check": fluid_check,
        "in_trainer_factor": in_trainer,
        "backends": summaries,
        "predicted_step_time_ratio": predicted,
        "measured_step_time_ratio": measured,
        "predicted_rollout_time_ratio": base["median_rollout_seconds"] / tlt["median_rollout_seconds"],
        "measured_rollout_time_ratio": e2e["rollout_time_ratio"],
        "calibration_error": abs(predicted - measured) / measured,
    }


# The TLT paper's setup as we model it. Facts (BRIEF.md section 1): 64 H100s; end-to-end speed-ups over verl;
# speculative speed-up vs batch size BS1 3.2-3.6, BS4 ~3.0, BS16 1.9-2.7, BS32 1.7-2.5 (Qwen2.5-32B, TP4; range
# midpoints used for every model); speculation at <= 32 running sequences; rollout ~85% of the baseline's step.
# Assumptions (not in our sources): tensor parallel sizes; the batch and the log-normal response lengths (chosen
# once for all four models by a grid search on the TLT column, docs/scale.md); an H100 decode step of decode_ms at
# batch 1 (weights / (TP x ~2.5 TB/s)) costing twice that at PAPER_B_HALF; the n-gram drafter's (TLT-Base)
# speed-up 1 + (s(B) - 1) x NGRAM_GAIN (fitted on the TLT-Base column).
PAPER_SPEEDUP = CostTable((1, 4, 16, 32), (3.4, 3.0, 2.3, 2.1))
NGRAM_GAIN = 0.35
PAPER_SETUPS = {
    "Qwen2.5-7B": {"tp": 1, "decode_ms": 6.1, "tlt": 1.76, "tlt_base": 1.41},
    "R1-Distill-7B": {"tp": 1, "decode_ms": 6.1, "tlt": 1.71, "tlt_base": 1.31},
    "Qwen2.5-32B": {"tp": 4, "decode_ms": 6.6, "tlt": 2.12, "tlt_base": 1.54},
    "Llama-70B": {"tp": 8, "decode_ms": 7.1, "tlt": 1.86, "tlt_base": 1.38},
}
PAPER_BATCH = (256, 16)  # prompts per 64 GPUs, responses per prompt
PAPER_LENGTHS = {"median": 1024, "sigma": 1.2, "prompt_share": 0.3, "max_tokens": 32768}
PAPER_B_HALF = 256  # batch size at which an H100 decode step costs twice the batch-1 step
ROLLOUT_SHARE = 0.85


def paper_backends(decode_ms: float = 1.0) -> list[Backend]:
    step = decode_ms / 1000
    decode = CostTable((1, PAPER_B_HALF, 16 * PAPER_B_HALF), (step, 2 * step, 17 * step))
    ngram = CostTable(PAPER_SPEEDUP.batch_sizes, tuple(1 + (s - 1) * NGRAM_GAIN for s in PAPER_SPEEDUP.values))
    return [
        Backend("baseline", decode),
        Backend("tlt_base", decode, speedup=ngram, threshold=32),
        Backend("tlt", decode, speedup=PAPER_SPEEDUP, threshold=32),
    ]


def paper_run(name: str, num_gpus: int, steps: int, prompts: int | None = None) -> dict:
    setup = PAPER_SETUPS[name]
    num_prompts, group = PAPER_BATCH
    num_prompts = prompts or num_prompts * num_gpus // 64  # weak scaling: the batch grows with the cluster
    instances = num_gpus // setup["tp"]
    if num_prompts % instances:
        raise ValueError(f"{num_prompts} prompts do not split over {instances} instances.")
    lengths = LogNormalLengths(group_size=group, **PAPER_LENGTHS)
    backends = paper_backends(setup["decode_ms"])
    cluster = Cluster(
        num_instances=instances, groups_per_instance=num_prompts // instances, gpus_per_instance=setup["tp"]
    )
    # other seconds: the baseline's rollout is ROLLOUT_SHARE of its step
    probe = simulate(cluster, lengths, backends[:1], num_steps=steps)["baseline"]
    cluster.other_seconds = float(np.median(probe.rollout)) * (1 - ROLLOUT_SHARE) / ROLLOUT_SHARE
    # the drafter step: ~1/L of a policy training step on one GPU, taken as 2% of the other phases
    cluster.drafter_step_seconds = 0.02 * cluster.other_seconds
    results = simulate(cluster, lengths, backends, num_steps=steps, keep_instances=True)
    out = {name_: r.summary() for name_, r in results.items()}
    base = out["baseline"]["median_step_seconds"]
    for name_ in ("tlt_base", "tlt"):
        out[name_]["speedup"] = base / out[name_]["median_step_seconds"]
    out["instances"], out["sequences_per_instance"] = instances, num_prompts // instances * group
    out["_results"] = results
    return out


def predict(args) -> dict:
    calibration = json.loads(Path(args.calibration).read_text())
    e2e = json.loads(Path(args.e2e).read_text())
    cpu = predict_cpu(calibration, e2e, args.steps)
    print(
        f"CPU: predicted step-time ratio {cpu['predicted_step_time_ratio']:.3f}, measured "
        f"{cpu['measured_step_time_ratio']:.3f}, calibration_error {cpu['calibration_error']:.1%} "
        f"(rollout ratio predicted {cpu['predicted_rollout_time_ratio']:.2f}, measured "
        f"{cpu['measured_rollout_time_ratio']:.2f})"
    )
    paper, scale = {}, {}
    for name, setup in PAPER_SETUPS.items():
        run = paper_run(name, 64, args.steps)
        results = run.pop("_results")
        paper[name] = {
            "predicted_tlt": run["tlt"]["speedup"],
            "paper_tlt": setup["tlt"],
            "error_tlt": abs(run["tlt"]["speedup"] - setup["tlt"]) / setup["tlt"],
            "predicted_tlt_base": run["tlt_base"]["speedup"],
            "paper_tlt_base": setup["tlt_base"],
            "error_tlt_base": abs(run["tlt_base"]["speedup"] - setup["tlt_base"]) / setup["tlt_base"],
            **run,
        }
        print(
            f"{name}: TLT {run['tlt']['speedup']:.2f} (paper {setup['tlt']}), TLT-Base "
            f"{run['tlt_base']['speedup']:.2f} (paper {setup['tlt_base']}); median step "
            f"{run['baseline']['median_step_seconds']:.0f} s -> {run['tlt']['median_step_seconds']:.0f} s"
        )
        scale[name] = {}
        for gpus in (8, 16, 32, 64, 128, 256, 512):
            row = paper_run(name, gpus, args.steps)
            row.pop("_results")
            scale[name][str(gpus)] = {
                "tlt_speedup": row["tlt"]["speedup"],
                "tlt_base_speedup": row["tlt_base"]["speedup"],
                "idle_gpu_seconds_per_step": row["tlt"]["idle_gpu_seconds_per_step"],
                "harvested_share_of_idle": row["tlt"]["harvested_share_of_idle"],
                "drafter_steps_per_rl_step": row["tlt"]["drafter_steps_per_rl_step"],
                "rollout_share_baseline": row["baseline"]["rollout_share"],
            }
        if name == "Qwen2.5-32B":
            plot_tail(results, Path(args.docs) / "scale_tail.png")
    out = {
        "benchmark": "simulator",
        "calibration_file": os.path.relpath(args.calibration, ROOT),
        "e2e_file": os.path.relpath(args.e2e, ROOT),
        "steps": args.steps,
        "calibration_error": cpu["calibration_error"],
        "cpu": cpu,
        "paper_assumptions": {
            "speedup_vs_batch": dict(zip(map(str, PAPER_SPEEDUP.batch_sizes), PAPER_SPEEDUP.values)),
            "ngram_gain": NGRAM_GAIN,
            "batch": {"prompts_per_64_gpus": PAPER_BATCH[0], "responses_per_prompt": PAPER_BATCH[1]},
            "lengths": PAPER_LENGTHS,
            "rollout_share_baseline": ROLLOUT_SHARE,
            "setups": PAPER_SETUPS,
            "b_half": PAPER_B_HALF,
        },
        "paper": paper,
        "scale": scale,
    }
    plot_scale(scale, Path(args.docs) / "scale.png")
    # how fast: 512 instances x 2,048 sequences each, the three paper back-ends, 20 steps
    start = time.perf_counter()
    big = Cluster(num_instances=512, groups_per_instance=128)
    simulate(big, LogNormalLengths(group_size=16, **PAPER_LENGTHS), paper_backends(), num_steps=20)
    out["timing"] = {
        "instances": 512,
        "sequences_per_instance": 2048,
        "backends": 3,
        "steps": 20,
        "seconds": time.perf_counter() - start,
        "machine": machine(),
    }
    print(f"512 instances x 2,048 sequences x 3 back-ends x 20 steps: {out['timing']['seconds']:.1f} s")
    return out


def plot_scale(scale: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in scale.items():
        gpus = [int(g) for g in rows]
        left.plot(gpus, [r["tlt_speedup"] for r in rows.values()], marker="o", label=f"{name} TLT")
        left.plot(gpus, [r["tlt_base_speedup"] for r in rows.values()], ls="--", color=left.lines[-1].get_color())
        shares = [(g, r["harvested_share_of_idle"]) for g, r in zip(gpus, rows.values())]
        right.plot(*zip(*[(g, h) for g, h in shares if h is not None]), marker="o", label=name)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs (batch grows with the cluster)")
    left.set_ylabel("predicted step-time speed-up over baseline")
    left.set_title("TLT (solid) and model-free SD (dashed)")
    right.set_ylabel("share of idle GPU-seconds harvested")
    right.set_title("spot training (whole drafter steps)")
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_tail(results: dict, path: Path) -> None:
    """Per-instance rollout times of one simulated step (sorted): the long tail and what speculation does to it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, result in results.items():
        ax.plot(np.sort(result.instance_rollouts[0]), label=name)
    ax.set_xlabel("instance (sorted by rollout time)")
    ax.set_ylabel("rollout time (s)")
    ax.set_title("Qwen2.5-32B, 64 GPUs: one simulated step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["measure", "predict"])
    parser.add_argument("--rollouts", type=int, default=12, help="measure: rollouts per engine variant")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generate-repeats", type=int, default=3)
    parser.add_argument("--trainer-steps", type=int, default=10, help="measure: steps of each trainer")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--calibration", default=str(ROOT / "docs/benchmarks/sim_calibration_cpu.json"))
    parser.add_argument("--e2e", default=str(ROOT / "docs/benchmarks/e2e_eagle3_trace_cpu.json"))
    parser.add_argument("--steps", type=int, default=200, help="predict: simulated steps per configuration")
    parser.add_argument("--docs", default=str(ROOT / "docs"))
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    result = measure(args) if args.mode == "measure" else predict(args)
    output = args.output or (
        args.calibration if args.mode == "measure" else str(ROOT / "docs/benchmarks/simulator.json")
    )
    Path(output).write_text(json.dumps(stamp(result), indent=1) + "\n")
    print(f"wrote {output}", file=sys.stderr)


if __name__ == "__main__":
    main()
