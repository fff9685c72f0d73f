"""Rollout benchmark: `model.generate` (TRL's transformers path) vs the speculative engine, in one process.

On the same prompts, model and machine, runs interleaved: `model.generate`, the engine with speculation off, and
the engine with each drafter (n-gram over prompt + siblings; a 1-layer LM warm-started on the SFT data). Sampling
as GRPO does (temperature 1). Prints a table and writes JSON.

    python scripts/bench_rollout.py --output docs/benchmarks/rollout_cpu.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time


for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")

import torch  # noqa: E402
from _bench import write_json  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from trl_tlt.drafters import ModelDrafter, NgramDrafter  # noqa: E402
from trl_tlt.engine import SpeculativeEngine  # noqa: E402
from trl_tlt.sampling import SamplingParams  # noqa: E402
from trl_tlt.workload import build_draft_lm, build_policy, make_dataset, prompt_token_ids  # noqa: E402


def hf_generate(model, tokenizer, prompts, params: SamplingParams, seed: int) -> list[list[int]]:
    """TRL's transformers path: left-padded batch, `generate`, cut after the first EOS."""
    torch.manual_seed(seed)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=params.temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=params.max_new_tokens,
        eos_token_id=list(params.eos_token_ids),
        pad_token_id=tokenizer.pad_token_id,
    )[:, width:].tolist()
    eos = set(params.eos_token_ids)
    return [c[: next((i + 1 for i, t in enumerate(c) if t in eos), len(c))] for c in out]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="1x1,2x4,8x8", help="prompts x generations per batch, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="different prompt sets per shape")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--output", default=None)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    policy_path = build_policy(cache_dir=args.cache_dir)
    draft_path = build_draft_lm(cache_dir=args.cache_dir)
    model = AutoModelForCausalLM.from_pretrained(policy_path).eval()
    draft_lm = AutoModelForCausalLM.from_pretrained(draft_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(policy_path)
    params = SamplingParams(
        temperature=1.0, max_new_tokens=args.max_new_tokens, eos_token_ids=(tokenizer.eos_token_id,)
    )
    k = args.num_speculative_tokens
    methods = {
        "generate": None,
        "engine_no_spec": lambda: SpeculativeEngine(model),
        "engine_ngram": lambda: SpeculativeEngine(model, NgramDrafter(max_n=4, min_n=2), num_speculative_tokens=k),
        "engine_draft_lm": lambda: SpeculativeEngine(
            model, ModelDrafter(draft_lm, model.config.vocab_size), num_speculative_tokens=k
        ),
    }

    # Warm-up (first calls allocate).
    warm = prompt_token_ids(tokenizer, make_dataset(2, seed=99)["prompt"])
    hf_generate(model, tokenizer, warm, SamplingParams(max_new_tokens=8, eos_token_ids=params.eos_token_ids), 0)
    SpeculativeEngine(model).generate(warm, SamplingParams(max_new_tokens=8))

    per_shape = {}
    for shape in args.shapes.split(","):
        num_prompts, num_generations = (int(x) for x in shape.split("x"))
        times = {m: [] for m in methods}
        tokens = {m: 0 for m in methods}
        accept = {m: [] for m in methods}
        for repeat in range(args.repeats):
            data = make_dataset(num_prompts, seed=1000 + 17 * repeat + num_prompts)
            prompts = [p for p in prompt_token_ids(tokenizer, data["prompt"]) for _ in range(num_generations)]
            for name, make in methods.items():  # interleaved: every method sees the same prompts back to back
                seed = 10_000 * repeat + 7
                start = time.perf_counter()
                if make is None:
                    completions = hf_generate(model, tokenizer, prompts, params, seed)
                else:
                    out = make().generate(prompts, params, generator=torch.Generator().manual_seed(seed))
                    completions = out.completion_ids
                    accept[name].append(out.stats.mean_acceptance_length)
                times[name].append(time.perf_counter() - start)
                tokens[name] += sum(len(c) for c in completions)
        median = {m: statistics.median(t) for m, t in times.items()}
        per_shape[shape] = {
            "batch_size": num_prompts * num_generations,
            "median_seconds": median,
            "tokens": tokens,
            "tokens_per_second": {m: tokens[m] / sum(times[m]) for m in methods},
            "mean_acceptance_length": {m: statistics.mean(a) for m, a in accept.items() if a},
            "speedup_vs_generate": {m: median["generate"] / median[m] for m in methods},
            "speedup_vs_no_spec": {m: median["engine_no_spec"] / median[m] for m in methods},
        }
        print(f"\n== {shape} (batch {num_prompts * num_generations}), median of {args.repeats} prompt sets ==")
        print(
            f"{'method':<18}{'seconds':>9}{'tokens':>8}{'tok/s':>9}{'vs generate':>13}{'vs no-spec':>12}{'accept len':>12}"
        )
        for m in methods:
            row = per_shape[shape]
            acc = row["mean_acceptance_length"].get(m)
            print(
                f"{m:<18}{median[m]:>9.3f}{tokens[m]:>8}{row['tokens_per_second'][m]:>9.0f}"
                f"{row['speedup_vs_generate'][m]:>12.2f}x{row['speedup_vs_no_spec'][m]:>11.2f}x"
                f"{'' if acc is None else f'{acc:.2f}':>12}"
            )

    grpo = per_shape.get("8x8") or per_shape[list(per_shape)[-1]]
    drafters = ["engine_ngram", "engine_draft_lm"]
    best = max(drafters, key=lambda m: grpo["speedup_vs_no_spec"][m])
    result = {
        "benchmark": "rollout",
        "model": f"embedded policy {policy_path.name} (Qwen2, {model.config.num_hidden_layers} layers, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params), fp32",
        "draft_lm": f"{draft_path.name} ({draft_lm.config.num_hidden_layers} layer)",
        "machine": f"{platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads",
        "sampling": "temperature 1.0, no top-k/top-p",
        "num_speculative_tokens": k,
        "repeats": args.repeats,
        "best_drafter": best,
        "speedup_vs_generate": grpo["speedup_vs_generate"][best],
        "speedup_vs_no_spec": grpo["speedup_vs_no_spec"][best],
        "no_spec_speedup_vs_generate": grpo["speedup_vs_generate"]["engine_no_spec"],
        "mean_acceptance_length": grpo["mean_acceptance_length"][best],
        "per_batch_size": per_shape,
    }
    print(
        f"\nGRPO-like batch: best drafter {best}: {result['speedup_vs_generate']:.2f}x vs generate, "
        f"{result['speedup_vs_no_spec']:.2f}x vs speculation off (acceptance length "
        f"{result['mean_acceptance_length']:.2f}); speculation off {result['no_spec_speedup_vs_generate']:.2f}x vs generate"
    )
    write_json(result, args.output)


if __name__ == "__main__":
    main()
