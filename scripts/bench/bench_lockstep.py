"""What lockstep costs: the engine on a policy sharded by FSDP2 over 2 processes, beside the same policy whole.

Each rank samples its own rows (T = 1) from a random Qwen2 whose EOS is any of `--num-eos` token ids, so completion
lengths are geometric (long-tailed, capped at `--max-new-tokens`) and the ranks finish at different times. Sharded,
every forward all-gathers the parameters and the rank done first runs placeholder forwards until the other is done
(`tlt/placeholder_forward_share`); whole (what gathering the policy once per rollout gives: ZeRO-3's
`ds3_gather_for_generation`, FSDP1's `summon_full_params`), forwards are local and each rank stops when its rows do.
Records, per rollout and rank, the placeholder forwards' share of the rank's forwards and the wall time of both.

    torchrun --nproc_per_node 2 scripts/bench/bench_lockstep.py --output docs/benchmarks/lockstep_fsdp2_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import time

from trl_tlt.tooling.benchmarks import machine, write_json  # first: the Hugging Face libraries offline


# isort: split

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from trl_tlt.engine import SamplingParams, SpeculativeEngine  # noqa: E402
from trl_tlt.tooling.tiny import build_tiny_model, build_tokenizer  # noqa: E402


CORPUS = ["12+34=46\n46+7=53\n#### 53", "The quick brown fox jumps over the lazy dog. 1 2 3 4 5 6 7 8 9 10."] * 20


def rollout(model, prompts, params, seed: int, synced: bool) -> dict:
    """One generate call; its wall time is the group's (the slowest rank's)."""
    engine = SpeculativeEngine(model, pad_token_id=0)
    dist.barrier()
    start = time.perf_counter()
    out = engine.generate(prompts, params, generator=torch.Generator().manual_seed(seed), synced=synced)
    seconds = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    stats = out.stats
    forwards = 1 + stats.num_target_forwards + stats.num_placeholder_forwards
    return {
        "seconds": seconds.item(),
        "longest_completion": max(map(len, out.completion_ids)),
        "forwards": forwards,
        "placeholder_forwards": stats.num_placeholder_forwards,
        "placeholder_forward_share": stats.num_placeholder_forwards / forwards,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=6)
    parser.add_argument("--rows", type=int, default=16, help="rows per rank")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--num-eos", type=int, default=8, help="token ids that end a completion (its length)")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokenizer = build_tokenizer(CORPUS, vocab_size=320)
    model = build_tiny_model(
        tokenizer, hidden_size=args.hidden_size, num_hidden_layers=args.layers, num_attention_heads=4
    ).eval()
    eos = tuple(range(40, 40 + args.num_eos))
    params = SamplingParams(max_new_tokens=args.max_new_tokens, do_sample=True, temperature=1.0, eos_token_ids=eos)
    prompts = [tokenizer(text)["input_ids"] for text in ["12+34=", "The quick brown", "1 2 3 4", "hello"]]
    prompts = (prompts * args.rows)[: args.rows]
    seeds = [1000 * (i + 1) + rank for i in range(args.rollouts)]
    whole = [rollout(model, prompts, params, seed, synced=False) for seed in seeds]
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = [rollout(model, prompts, params, seed, synced=True) for seed in seeds]
    reports = [None] * world
    dist.all_gather_object(reports, {"whole": whole, "sharded": sharded})
    if rank == 0:
        shares = [r["placeholder_forward_share"] for report in reports for r in report["sharded"]]
        seconds_whole = [r["seconds"] for r in reports[0]["whole"]]
        seconds_sharded = [r["seconds"] for r in reports[0]["sharded"]]
        result = {
            "what": "SpeculativeEngine.generate (no drafter) on a policy sharded by FSDP2 over 2 gloo processes, "
            "in lockstep, beside the same policy whole on each rank (gathered once per rollout)",
            "machine": machine(),
            "config": {**vars(args), "eos_token_ids": list(eos), "world_size": world, "sampling": "T = 1"},
            "runs": args.rollouts,
            "ranks": reports,
            "placeholder_forward_share_mean": statistics.mean(shares),
            "placeholder_forward_share_max": max(shares),
            "rollout_seconds_whole_median": statistics.median(seconds_whole),
            "rollout_seconds_sharded_median": statistics.median(seconds_sharded),
            "sharded_over_whole_seconds": statistics.median(seconds_sharded) / statistics.median(seconds_whole),
        }
        write_json(result, args.output)
        print(
            f"placeholder share mean {result['placeholder_forward_share_mean']:.3f} "
            f"(max {result['placeholder_forward_share_max']:.3f}); rollout s whole "
            f"{result['rollout_seconds_whole_median']:.2f} sharded {result['rollout_seconds_sharded_median']:.2f}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
