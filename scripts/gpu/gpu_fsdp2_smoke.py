"""1-GPU FSDP2 smoke run: the engine and TLTGRPOTrainer on a policy sharded by FSDP2 (docs/trainer.md, "Launch modes").

One process, one GPU: the policy's parameters are DTensors (sharded over one rank), so what the engine and drafter
training read of them is what they read under FSDP2 at any size (the whole copies of the embedding and LM head, the
recorded features), without lockstep (one rank). Prints and writes:

1. greedy identity of the engine on the sharded policy with the unsharded one, with no drafter, n-gram and an EAGLE-3
   head (the head embeds with the copied embedding);
2. TLTGRPOTrainer, 3 steps under FSDP2 (`fsdp="full_shard"`, version 2) beside GRPOTrainer, greedy: the same
   completions, and the drafter trained (spot training on).

    torchrun --nproc_per_node 1 scripts/gpu/gpu_fsdp2_smoke.py --output $OUT/gpu_fsdp2_smoke.json
    python scripts/gpu/gpu_fsdp2_smoke.py --device cpu --smoke        # part 1 on CPU (gloo, one process; tested)
"""

from __future__ import annotations

import argparse
import os
import tempfile

from trl_tlt.tooling.benchmarks import machine, write_json  # first: the Hugging Face libraries offline


# isort: split

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from trl_tlt.drafters import NgramDrafter  # noqa: E402
from trl_tlt.drafters.eagle3 import Eagle3Drafter, Eagle3Model  # noqa: E402
from trl_tlt.engine import SamplingParams, SpeculativeEngine  # noqa: E402
from trl_tlt.tooling.tiny import build_tiny_model, build_tokenizer  # noqa: E402


CORPUS = ["12+34=46\n46+7=53\n#### 53", "The quick brown fox jumps over the lazy dog. 1 2 3 4 5 6 7 8 9 10."] * 20
PROMPTS = ["12+34=", "The quick brown", "1 2 3 4", "hello"]


def engine_identity(device: str) -> dict:
    torch.manual_seed(0)
    tokenizer = build_tokenizer(CORPUS, vocab_size=320)
    model = build_tiny_model(tokenizer, hidden_size=64, num_hidden_layers=3, num_attention_heads=2).to(device).eval()
    head = Eagle3Model.for_policy(model, draft_vocab_size=64)
    drafters = {"none": None, "ngram": NgramDrafter(max_n=3, min_n=1), "eagle3": Eagle3Drafter(head)}
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    params = SamplingParams(max_new_tokens=24, do_sample=False)

    def run(name):
        engine = SpeculativeEngine(model, drafter=drafters[name], num_speculative_tokens=3, pad_token_id=0)
        return engine.generate(prompts, params)

    whole = {name: run(name).completion_ids for name in drafters}
    mesh = init_device_mesh(device if device == "cpu" else "cuda", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = {name: run(name) for name in drafters}
    return {
        "identical": {name: sharded[name].completion_ids == whole[name] for name in drafters},
        "policy_weights_copied": sharded["eagle3"].policy_weights is not None,
        "eagle3_mean_acceptance_length": sharded["eagle3"].stats.mean_acceptance_length,
    }


def trainer_run(trainer_name: str, output_dir: str) -> dict:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from trl_tlt import TLTConfig, TLTGRPOTrainer

    torch.manual_seed(0)
    tokenizer = build_tokenizer(CORPUS, vocab_size=320)
    model = build_tiny_model(tokenizer, hidden_size=64, num_hidden_layers=3, num_attention_heads=2)
    config_cls, trainer_cls = (TLTConfig, TLTGRPOTrainer) if trainer_name == "tlt" else (GRPOConfig, GRPOTrainer)
    extra = {"spot_training": True, "spot_steps_per_rollout": 2} if trainer_name == "tlt" else {}
    args = config_cls(
        output_dir=output_dir, bf16=False, report_to="none", per_device_train_batch_size=8, num_generations=4,
        max_completion_length=24, max_steps=3, learning_rate=1e-2, logging_steps=1, save_strategy="no", seed=0,
        disable_tqdm=True, generation_kwargs={"do_sample": False}, fsdp="full_shard", fsdp_config={"version": 2},
        **extra,
    )  # fmt: skip
    seen = []

    def reward(completions, completion_ids, **kwargs):
        seen.extend(list(ids) for ids in completion_ids)
        return [float(len(ids)) for ids in completion_ids]

    trainer = trainer_cls(
        model=model, reward_funcs=reward, args=args, processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 8}),
    )  # fmt: skip
    trainer.train()
    spot = getattr(trainer, "tlt_spot", None)
    return {
        "distributed_type": str(trainer.accelerator.distributed_type),
        "completions": seen,
        "drafter_steps": None if spot is None else spot.total_steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="part 1 only")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("gloo" if args.device == "cpu" else "nccl", rank=0, world_size=1)
    result = {"machine": machine(), "engine": engine_identity(args.device)}
    print("engine on the FSDP2 policy:", result["engine"])
    if not args.smoke:
        with tempfile.TemporaryDirectory() as folder:
            grpo = trainer_run("grpo", os.path.join(folder, "grpo"))
            tlt = trainer_run("tlt", os.path.join(folder, "tlt"))
        result["trainer"] = {
            "distributed_type": tlt["distributed_type"],
            "same_completions_as_grpo": tlt["completions"] == grpo["completions"],
            "drafter_steps": tlt["drafter_steps"],
        }
        print("TLTGRPOTrainer under FSDP2:", result["trainer"])
    write_json(result, args.output)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
