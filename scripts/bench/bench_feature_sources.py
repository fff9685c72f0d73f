"""Where the drafter's data comes from (#61): a new EAGLE-3 head trained online by TLTGRPOTrainer on the states the
rollout's forwards record (`spot_feature_source="rollout"`) or the training step's loss forward records
(`"training_step"`), and with the buffer's one-step offset (`spot_buffer_steps` 2, the default: the previous
rollout's states, one policy update old, beside the latest's) or without it (1). Every other setting is TLTConfig's
default. Each part writes its keys into one JSON (`--output`, merged with what is there), on the same machine:

- `embedded`: the drift scenario's start policy (shipped with the package), the demo's settings (8 prompts x 8, 512
  tokens, `style_reward`, learning rate 1e-4), `--steps` steps.
- `real`: the real-regime SmolLM2 policy (`trl_tlt.tooling.real_model`), 8 prompts x 4 at T = 1, 256 tokens.
- `sharded`: the drift policy under FSDP2 on 2 gloo processes (4 prompts x 8 each) against one process (8 x 8), the
  same prompts, every default, `--repeats` pairs alternated (pair i with seed i): `sharded_acceptance_ratio`, the
  FSDP2 heads' median held-out acceptance over the one-process heads'. The defaults differ in source ("auto": the
  training step's under FSDP2, the rollout's in one process).

Per run: the drafter's seconds (`tlt/spot_seconds` summed), its steps, the step's median seconds, and the head's
held-out acceptance length at the end (k = 6 at every step, T = 1, 32 held-out prompts, the trained policy);
`acceptance_per_drafter_second` = (acceptance - 1) / drafter seconds.

    python scripts/bench/bench_feature_sources.py --parts embedded real sharded --output docs/benchmarks/feature_sources_cpu.json
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from trl_tlt.tooling.benchmarks import (  # first: the Hugging Face libraries offline
    run_parts,
    step_timer,
    trainer_config,
)


# isort: split

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from trl_tlt import TLTGRPOTrainer  # noqa: E402
from trl_tlt.engine.sampling import SamplingParams  # noqa: E402
from trl_tlt.tooling.workload import build_drift_policy, drift_rewards, make_dataset, prompt_token_ids  # noqa: E402
from trl_tlt.training.warm_start import evaluate_acceptance  # noqa: E402


VARIANTS = {  # TLTConfig fields of each run (the rest: defaults)
    "rollout": {"spot_feature_source": "rollout"},
    "training_step": {"spot_feature_source": "training_step"},
    "rollout_no_offset": {"spot_feature_source": "rollout", "spot_buffer_steps": 1},
}


def held_out_acceptance(policy, drafter, eos: int, prompts: list[list[int]], max_new_tokens: int) -> float:
    """The trained head's acceptance length on held-out prompts: k = 6 at every step, T = 1, the trained policy."""
    params = SamplingParams(temperature=1.0, do_sample=True, max_new_tokens=max_new_tokens, eos_token_ids=(eos,))
    report = evaluate_acceptance(policy.eval(), drafter, prompts, params, k=6, seed=0)
    return report["mean_acceptance_length"]


def run(policy_path: str, config, dataset, rewards, held_out, max_new_tokens: int) -> dict | None:
    """One TLTGRPOTrainer run and its head's held-out acceptance (None on ranks other than 0 of a sharded run, where
    rank 0 evaluates on the policy gathered whole)."""
    tokenizer = AutoTokenizer.from_pretrained(policy_path, padding_side="left")
    trainer = TLTGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(policy_path), reward_funcs=rewards, args=config,
        train_dataset=dataset, processing_class=tokenizer,
    )  # fmt: skip
    times = step_timer()
    trainer.add_callback(times)
    trainer.train()
    policy = trainer.accelerator.unwrap_model(trainer.model)
    if trainer.accelerator.num_processes > 1:  # every rank joins the gather; rank 0 holds the policy whole
        state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
        if not trainer.accelerator.is_main_process:
            return None
        policy = AutoModelForCausalLM.from_pretrained(policy_path)
        policy.load_state_dict(state)
        # the head embeds with the policy's embedding module, here still the trained policy's shard: the whole one's
        object.__setattr__(trainer.tlt_drafter.model, "embed_tokens", policy.get_input_embeddings())
    logs = [h for h in trainer.state.log_history if "reward" in h]
    # one process: `tlt/spot_seconds`; several: `tlt/idle_seconds_used` (the ranks' mean), the other 0 (docs/metrics.md)
    seconds = sum(h.get("tlt/spot_seconds", 0.0) + h.get("tlt/idle_seconds_used", 0.0) for h in logs)
    acceptance = held_out_acceptance(policy, trainer.tlt_drafter, tokenizer.eos_token_id, held_out, max_new_tokens)
    result = {
        "drafter_seconds": seconds,
        "drafter_steps": trainer.tlt_spot.total_steps,
        "median_step_seconds": statistics.median(times.times),
        "heldout_acceptance_k6": acceptance,
        "acceptance_per_drafter_second": (acceptance - 1.0) / max(seconds, 1e-9),
        "rerun_samples": trainer.tlt_spot.rerun_samples,
        "reward": [h["reward"] for h in logs],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "reward"}), flush=True)
    return result


def drift_setting(steps: int):
    """The policy, held-out prompts, rewards and dataset (the same for every run: 8 prompts a step globally)."""
    policy_path = str(build_drift_policy()[0])
    tokenizer = AutoTokenizer.from_pretrained(policy_path)
    held_out = prompt_token_ids(tokenizer, make_dataset(32, seed=999)["prompt"])
    rewards = drift_rewards()
    dataset = make_dataset(8 * steps * 2, seed=2024)
    return policy_path, held_out, rewards, dataset


def drift_config(output_dir, steps: int, prompts: int, tlt_args: dict, seed: int = 0, **extra):
    rewards = drift_rewards()
    return trainer_config(
        "tlt", output_dir, num_prompts=prompts, num_generations=8, max_completion_length=512, steps=steps, seed=seed,
        micro_batch=8, learning_rate=1e-4, reward_weights=rewards["reward_weights"], tlt_args=tlt_args, **extra,
    )  # fmt: skip


def compare(runs: dict) -> dict:
    out = {name: run["acceptance_per_drafter_second"] for name, run in runs.items()}
    return out


def part_embedded(args) -> dict:
    policy_path, held_out, rewards, dataset = drift_setting(args.steps)
    runs = {}
    for name, tlt_args in VARIANTS.items():
        with tempfile.TemporaryDirectory() as out:
            config = drift_config(out, args.steps, 8, tlt_args)
            runs[name] = run(policy_path, config, dataset, rewards["reward_funcs"], held_out, 512)
    return {"embedded": {"steps": args.steps, "runs": runs}, "embedded_acceptance_per_drafter_second": compare(runs)}


def part_real(args) -> dict:
    from datasets import Dataset

    from trl_tlt.tooling.real_model import answer_reward, real_model_prompts, real_regime_policy_path

    path = real_regime_policy_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    dataset = Dataset.from_list(real_model_prompts(8 * args.steps, seed=11))
    held_out = prompt_token_ids(tokenizer, [r["prompt"] for r in real_model_prompts(32, seed=99)])
    runs = {}
    for name, tlt_args in VARIANTS.items():
        with tempfile.TemporaryDirectory() as out:
            config = trainer_config(
                "tlt", out, num_prompts=8, num_generations=4, max_completion_length=256, steps=args.steps, seed=0,
                tlt_args=tlt_args, temperature=1.0,
            )  # fmt: skip
            runs[name] = run(path, config, dataset, answer_reward, held_out, 256)
    return {"real": {"steps": args.steps, "runs": runs}, "real_acceptance_per_drafter_second": compare(runs)}


def worker(args) -> None:
    """One rank of the FSDP2 run (under torchrun): its report, from rank 0."""
    from trl_tlt.tooling.sharding import sharded_at_the_seam

    torch.set_num_threads(1)
    policy_path, held_out, rewards, dataset = drift_setting(args.steps)
    with tempfile.TemporaryDirectory() as out:
        extra = {}
        sharded_at_the_seam("fsdp2", extra)
        config = drift_config(out, args.steps, 4, {}, args.seed, ddp_timeout=1800, **extra)
        result = run(policy_path, config, dataset, rewards["reward_funcs"], held_out, 512)
    if result is not None:
        with open(args.worker, "w") as f:
            json.dump(result, f)


def part_sharded(args) -> dict:
    """`--repeats` pairs of runs (one process, then FSDP2), alternated: the ratio of the heads' median acceptances."""
    policy_path, held_out, rewards, dataset = drift_setting(args.steps)
    ones, fsdp2s = [], []
    for seed in range(args.repeats):  # each pair its own seed (sampling, the heads' draws)
        with tempfile.TemporaryDirectory() as out:
            config = drift_config(out, args.steps, 8, {}, seed)
            ones.append(run(policy_path, config, dataset, rewards["reward_funcs"], held_out, 512))
        with tempfile.TemporaryDirectory() as out:
            report = os.path.join(out, "fsdp2.json")
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                       __file__, "--steps", str(args.steps), "--seed", str(seed), "--worker", report]  # fmt: skip
            subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            with open(report) as f:
                fsdp2s.append(json.load(f))

    def acceptance(runs):
        return statistics.median(r["heldout_acceptance_k6"] for r in runs)

    return {
        "sharded": {"steps": args.steps, "repeats": args.repeats, "one_process": ones, "fsdp2_2_processes": fsdp2s},
        "sharded_acceptance_ratio": acceptance(fsdp2s) / acceptance(ones),
    }


PARTS = {"embedded": part_embedded, "real": part_real, "sharded": part_sharded}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=["embedded"])
    parser.add_argument("--steps", type=int, default=20, help="GRPO steps per run.")
    parser.add_argument("--repeats", type=int, default=3, help="sharded: pairs of runs (one process, FSDP2).")
    parser.add_argument("--output", default=None, help="JSON to write (its keys from other parts are kept).")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a rank of the sharded part
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)  # its seed
    args = parser.parse_args()
    if args.worker:
        worker(args)
        # As tests/_matrix_run.py: the process groups torn down, then out without interpreter shutdown (gloo's threads
        # can race it and abort the process after the report was written).
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    torch.set_num_threads(2)
    run_parts("feature_sources", PARTS, args.parts, args, args.output)


if __name__ == "__main__":
    main()
