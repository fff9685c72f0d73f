"""A sharded policy on a CPU machine, for the tests and benchmarks of several processes (never the library).

accelerate engages neither FSDP nor DeepSpeed on a CPU: `sharded_at_the_seam` asks for them in the trainer's config
as on GPUs and sets the Accelerator the Trainer builds to them at its seam.
"""

from __future__ import annotations

import torch


def sharded_at_the_seam(sharding: str, config: dict) -> None:
    """The trainer's policy sharded on a CPU machine, where accelerate engages neither FSDP nor DeepSpeed: the config
    asks for it as on GPUs, and the Accelerator the Trainer builds is set to it at its seam (accelerate 1.16 picks
    MULTI_CPU for FSDP on a CPU, and under DeepSpeed on a CPU leaves its state at one process with no backend)."""
    import accelerate.state
    import transformers.trainer
    from accelerate.utils import DistributedType

    if sharding == "fsdp2":
        config.update(
            fsdp="full_shard", fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]}
        )
    else:  # DeepSpeed's CPU accelerator (gloo); ZeRO-3 gathers for generation unless the spec's config says not to
        stage = int(sharding[-1])
        config.update(use_cpu=False, deepspeed={
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "bf16": {"enabled": False},
            "zero_optimization": {
                "stage": stage, "stage3_param_persistence_threshold": 0, "stage3_gather_16bit_weights_on_model_save": True,
            },
        })  # fmt: skip
    build = transformers.trainer.Accelerator

    def accelerator(**kwargs):
        built = build(**kwargs)
        states = (accelerate.state.PartialState._shared_state, accelerate.state.AcceleratorState._shared_state)
        for state in states:
            if sharding == "fsdp2":
                state.update(distributed_type=DistributedType.FSDP, fsdp_plugin=kwargs["fsdp_plugin"])
            else:
                rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
                state.update(backend="gloo", num_processes=world, process_index=rank, local_process_index=rank)
        return built

    transformers.trainer.Accelerator = accelerator
