"""Helper of tests/test_sharded.py (not a test): `SpeculativeEngine.generate` on a policy sharded over 2 processes.

torchrun --nproc_per_node 2 tests/_sharded_engine_run.py OUT_DIR SHARDING [--no-sync]

SHARDING: `fsdp2` (torch's `fully_shard` on every decoder layer and the root) or `zero3` (DeepSpeed ZeRO-3, every
parameter partitioned, not gathered for generation: each forward gathers them). FSDP1 (`FullyShardedDataParallel`)
refuses a CPU ("FSDP needs a non-CPU accelerator device"): `fsdp1` runs on a GPU machine only.
Each rank generates greedily to its own length (rank 0: 4 tokens, rank 1: 16) with no drafter, the n-gram drafter and
an EAGLE-3 head, then `transformers.generate` on rank 1 beside the engine on rank 0; after each call an all-reduce must
pair. Writes OUT_DIR/rank{r}.json: the sharded and the unsharded completions, the placeholder forwards, the weights
the EAGLE-3 head embedded with. `--no-sync` turns lockstep off (`synced=False`): the negative control, which deadlocks.
"""

import datetime
import json
import os
import sys
from pathlib import Path


for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from trl_tlt.drafters import NgramDrafter  # noqa: E402
from trl_tlt.drafters.eagle3 import Eagle3Drafter, Eagle3Model  # noqa: E402
from trl_tlt.engine import SamplingParams, SpeculativeEngine  # noqa: E402
from trl_tlt.tooling.tiny import build_tiny_model, build_tokenizer  # noqa: E402


CORPUS = ["12+34=46\n46+7=53\n#### 53", "The quick brown fox jumps over the lazy dog. 1 2 3 4 5 6 7 8 9 10."] * 20
PROMPTS = [["12+34=", "The quick brown"], ["1 2 3 4", "hello"]]  # per rank


def shard(model, how: str):
    if how == "zero3":
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": False},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        }  # fmt: skip
        return deepspeed.initialize(model=model, config=config)[0].module
    if how == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Qwen2DecoderLayer}), device_id=None)


def paired() -> bool:
    """The next collective after a call: both ranks reach it (a deadlock times out instead)."""
    flag = torch.ones(1)
    dist.all_reduce(flag)
    return flag.item() == dist.get_world_size()


def main(out_dir: str, how: str, synced: bool) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=45 if synced else 10))
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    tokenizer = build_tokenizer(CORPUS, vocab_size=320)
    model = build_tiny_model(tokenizer, hidden_size=64, num_hidden_layers=3, num_attention_heads=2).eval()
    torch.manual_seed(1)
    head = Eagle3Model.for_policy(model, draft_vocab_size=64)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[rank]]
    params = SamplingParams(max_new_tokens=4 if rank == 0 else 16, do_sample=False)
    drafters = {"none": None, "ngram": NgramDrafter(max_n=3, min_n=1), "eagle3": Eagle3Drafter(head)}

    def run(name, **kwargs):
        engine = SpeculativeEngine(model, drafter=drafters[name], num_speculative_tokens=3, pad_token_id=0)
        return engine.generate(prompts, params, **kwargs)

    report = {"unsharded": {name: run(name).completion_ids for name in drafters}, "sharded": {}, "placeholders": {}}
    report["vocab_size"] = model.config.vocab_size
    model = shard(model, how)
    kwargs = {} if synced else {"synced": False}
    for name in drafters:
        out = run(name, **kwargs)
        report["sharded"][name] = out.completion_ids
        report["placeholders"][name] = [out.stats.num_placeholder_forwards, out.stats.num_target_forwards]
        report[f"paired_{name}"] = paired()
        if name == "eagle3":  # the head embedded with a whole copy, never the shard
            report["embedding_copy_shape"] = list(head.embedding_copy.shape)
    # one rank on the engine, the other on transformers' generate (a rank that fell back): their collectives pair
    with torch.no_grad():
        if rank == 0:
            report["mixed"] = run("none").completion_ids
        else:
            ids = torch.tensor([prompts[0]])
            out = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0, synced_gpus=True)
            report["mixed"] = [out[0, ids.size(1) :].tolist()]
    report["paired_mixed"] = paired()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--no-sync" not in sys.argv)
    # As tests/_matrix_run.py: leave without interpreter shutdown (gloo's threads can race it and abort the process
    # after the results were written).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
