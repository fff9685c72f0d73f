"""Micro-benchmark of the fused verification kernel against the torch reference (for a lent GPU; ~2 minutes).

For each batch size, times `verify_triton` and `verify_reference` on the same inputs (k draft tokens, a vocabulary
the size of Qwen2.5's, float32, sampling with draft probabilities and greedy), checks that both give the same
tokens, and prints a table of microseconds per call and the speed-up.

    python scripts/gpu/bench_kernels.py --output docs/benchmarks/kernels_h200.json
    TRITON_INTERPRET=1 python scripts/gpu/bench_kernels.py --device cpu --vocab 512 --batch-sizes 1,4 --iters 2  # smoke
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from trl_tlt.engine.rejection_sampler import verify_reference
from trl_tlt.kernels import verify_triton
from trl_tlt.tooling.benchmarks import write_json


def case(batch, k, vocab, do_sample, device, generator):
    logits = 3 * torch.randn(batch, k + 1, vocab, device=device, generator=generator)
    logp = torch.log_softmax(logits, -1)
    q = torch.softmax(logits[:, :k] + torch.randn(batch, k, vocab, device=device, generator=generator), -1)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=generator).reshape(batch, k)
    num = torch.full((batch,), k, device=device)
    if not do_sample:
        return logp, drafts, num, None, None, None
    uniform_accept = torch.rand(batch, k, device=device, generator=generator)
    uniform_sample = torch.rand(batch, device=device, generator=generator)
    return logp, drafts, num, q, uniform_accept, uniform_sample


def timed(fn, args, iters, device) -> float:
    """Median seconds per call over `iters` calls (after 3 warm-up calls)."""
    for _ in range(3):
        fn(*args)
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(*args)
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("No CUDA device: run on a GPU, or pass --device cpu with TRITON_INTERPRET=1 (a smoke run).")
    generator = torch.Generator(device=device).manual_seed(0)
    rows = []
    print(f"{'mode':>7} {'batch':>5} {'torch us':>9} {'triton us':>9} {'speed-up':>8}")
    for do_sample in (True, False):
        for batch in map(int, args.batch_sizes.split(",")):
            inputs = case(batch, args.k, args.vocab, do_sample, device, generator)
            fused, reference = verify_triton(*inputs), verify_reference(*inputs)
            same = all(torch.equal(a, b) for a, b in zip(fused[:2], reference[:2]))
            t_ref = timed(verify_reference, inputs, args.iters, device)
            t_fused = timed(verify_triton, inputs, args.iters, device)
            mode = "sample" if do_sample else "greedy"
            rows.append(
                {
                    "mode": mode,
                    "batch": batch,
                    "torch_us": t_ref * 1e6,
                    "triton_us": t_fused * 1e6,
                    "same_tokens": same,
                }
            )
            print(
                f"{mode:>7} {batch:>5} {t_ref * 1e6:9.1f} {t_fused * 1e6:9.1f} {t_ref / t_fused:7.2f}x"
                + ("" if same else "  DIFFERENT TOKENS")
            )
    result = {
        "benchmark": "kernels_verify",
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"{platform.machine()} (interpreter)",
        "torch": torch.__version__,
        "k": args.k,
        "vocab": args.vocab,
        "iters": args.iters,
        "rows": rows,
    }
    write_json(result, args.output)


if __name__ == "__main__":
    main()
