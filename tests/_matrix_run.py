"""Helper of tests/test_multiprocess.py (not a test): one GRPO run under `accelerate launch` (or torchrun), as a user's
script would be, with the case's options; every rank writes what the test compares.

    accelerate launch --num_processes 2 ... tests/_matrix_run.py SPEC.json

SPEC.json: {"trainer": "grpo" | "tlt", "model_dir", "output_dir", "tag", "config": {extra config fields},
"sharding": null | "fsdp2" | "zero2" | "zero3" (the policy sharded as accelerate would shard it on GPUs: `sharded_at_the_seam`),
"max_completion_length_by_rank": [n0, n1] or null (the ranks' rollouts end at different lengths),
"completion_lengths_by_rank": [[lengths of rank 0's rows], [rank 1's]] or null (both trainers' generation replaced
by fixed completions of those lengths, EOS-terminated: long-tailed training batches without a trained policy),
"tools": bool, "slow_rank": rank or null (that rank's generation turns take `slow_seconds` longer: the ranks' rollouts
end at different times), "kill_after": global step or null (every rank exits abruptly once that step's checkpoint is
written, as a killed job), "resume": checkpoint folder or null, "prompts": [...]}.
Each rank writes TAG-rank{r}.json: the completion ids of every step, sha256 of its policy and drafter weights, the draft
vocabulary's size, the steps it trained the drafter.
"""

import hashlib
import json
import os
import sys
import time


for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from testing_utils import multiply_tool  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from trl_tlt import TLTConfig, TLTGRPOTrainer  # noqa: E402
from trl_tlt.tooling.sharding import sharded_at_the_seam  # noqa: E402


def digest(tensors) -> str:
    h = hashlib.sha256()
    for tensor in tensors:
        h.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class KillAfter(TrainerCallback):
    """Exit every rank abruptly (no teardown, as a killed job) once step `step`'s checkpoint is on disk."""

    def __init__(self, trainer, step):
        self.trainer, self.step = trainer, step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:  # the checkpoint of `step` was written at its end
            if hasattr(self.trainer, "join_drafter_writes"):
                self.trainer.join_drafter_writes()
            if torch.distributed.is_initialized():
                torch.distributed.barrier()  # every rank's own files are written
            sys.stdout.flush()
            os._exit(0)


def _load_on_cpu(load):
    """transformers (5.16) loads the optimizer of a resumed run with map_location=args.device, which reads cpu:0 under
    multi-process CPU data parallel, a location torch.load refuses (GRPOTrainer alike): read "cpu" there instead."""

    def patched(*args, map_location=None, **kwargs):
        if isinstance(map_location, torch.device) and map_location.type == "cpu":
            map_location = "cpu"
        return load(*args, map_location=map_location, **kwargs)

    return patched


def main(spec_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    tlt = spec["trainer"] == "tlt"
    trainer_cls, config_cls = (TLTGRPOTrainer, TLTConfig) if tlt else (GRPOTrainer, GRPOConfig)
    config = dict(
        output_dir=spec["output_dir"], use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=4,
        num_generations=4, max_completion_length=12, max_steps=4, learning_rate=1e-2, logging_steps=1,
        save_strategy="no", seed=0, disable_tqdm=True, ddp_timeout=180,
    )  # fmt: skip
    config.update(spec.get("config", {}))
    if spec.get("max_completion_length_by_rank"):
        config["max_completion_length"] = spec["max_completion_length_by_rank"][rank]
    if spec.get("sharding"):
        sharded_at_the_seam(spec["sharding"], config)
    if not tlt:
        config = {k: v for k, v in config.items() if k in GRPOConfig.__dataclass_fields__}
    seen = []

    def reward(completions, completion_ids, **kwargs):
        seen.append([list(ids) for ids in completion_ids])
        return [float(len(ids)) for ids in completion_ids]

    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    prompts = spec["prompts"]
    extra = {}
    if spec.get("tools"):
        prompts = [[{"role": "user", "content": p}] for p in prompts]
        extra["tools"] = [multiply_tool]
    args = config_cls(**config)  # first, as transformers documents for ZeRO-3: the policy then loads partitioned
    trainer = trainer_cls(
        model=AutoModelForCausalLM.from_pretrained(spec["model_dir"]),
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        **extra,
    )
    if spec.get("completion_lengths_by_rank"):
        lengths = spec["completion_lengths_by_rank"][rank]

        def fixed_generate(prompt_ids, *args, **kwargs):
            eos = trainer.eos_token_ids[0]
            return [[(p[-1] + 7 * j + i) % 200 + 5 for j in range(lengths[i % len(lengths)] - 1)] + [eos]
                    for i, p in enumerate(prompt_ids)], None  # fmt: skip

        trainer._generate_single_turn = fixed_generate
    if spec.get("slow_rank") == rank:  # this rank's generation turns end later than the other's
        generate = trainer._generate_single_turn

        def slow_generate(*args, **kwargs):
            time.sleep(spec.get("slow_seconds", 1.0))
            return generate(*args, **kwargs)

        trainer._generate_single_turn = slow_generate
    if spec.get("kill_after") is not None:
        trainer.add_callback(KillAfter(trainer, spec["kill_after"]))
    if spec.get("resume"):
        torch.load = _load_on_cpu(torch.load)
    trainer.train(resume_from_checkpoint=spec.get("resume"))
    drafter = getattr(trainer, "tlt_drafter", None)
    drafter_model = getattr(drafter, "model", None)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    # every rank joins the gather of a sharded policy (rank 0's holds it whole)
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped) if spec.get("sharding") else policy.state_dict()
    report = {
        "rank": rank,
        "world_size": trainer.accelerator.num_processes,
        "global_step": trainer.state.global_step,
        "completions": seen,
        "policy_sha256": digest(p for _, p in sorted(state.items())) if state else None,
        "drafter_sha256": None if drafter_model is None else digest(drafter_model.parameters()),
        "draft_vocab_size": getattr(getattr(drafter_model, "config", None), "draft_vocab_size", None),
        "drafter_steps": None if getattr(trainer, "tlt_spot", None) is None else trainer.tlt_spot.total_steps,
        "tool_calls": [h.get("tools/call_frequency") for h in trainer.state.log_history if "loss" in h],
        "accepted": None if getattr(trainer, "tlt_last_stats", None) is None else trainer.tlt_last_stats.to_dict(),
        "drafter_rerun_samples": None
        if getattr(trainer, "tlt_spot", None) is None
        else trainer.tlt_spot.rerun_samples,
        "placeholder_shares": [
            h.get("tlt/placeholder_forward_share", 0.0) for h in trainer.state.log_history if "loss" in h
        ],
    }
    with open(os.path.join(spec["output_dir"], f"{spec['tag']}-rank{rank}.json"), "w") as f:
        json.dump(report, f)
    folder = os.path.join(spec["output_dir"], f"{spec['tag']}-rank{rank}-policy")
    if spec.get("sharding"):
        if state:
            from safetensors.torch import save_file

            os.makedirs(folder, exist_ok=True)
            save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, f"{folder}/model.safetensors")
    else:
        policy.save_pretrained(folder)


if __name__ == "__main__":
    main(sys.argv[1])
    # As tests/_spot_run.py: tear the process groups down, then leave without interpreter shutdown (gloo's threads can
    # race it and abort the process after the results were written).
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
