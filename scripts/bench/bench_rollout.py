"""Rollout benchmark: `model.generate` (TRL's transformers path) vs the speculative engine, in one process.

On the same prompts, model and machine, runs interleaved: `model.generate`, the engine with speculation off, and
the engine with each drafter: n-gram (prompt + siblings), a 1-layer draft LM, and the warm-start EAGLE-3 head
drafting chains (k tokens) and trees (depth, topk, verify). Sampling as GRPO does (temperature 1). Prints a
table and writes JSON.

Completion lengths are random (sampling): the same prompt set gives each method completions of other lengths, so
speed-ups are ratios of throughput (tokens generated per second), totalled over `--repeats` prompt sets per shape,
every method on the same prompts back to back. The EAGLE-3 arm of `spec_speedup_bs*` is the fastest of that
sweep; it is then measured again against speculation off on `--confirm` fresh prompt sets (a second round, so the
figure carries no selection bias from picking the best of many noisy arms), with a 95% bootstrap interval over those
sets: the sets' random completion lengths, not the timing, spread the ratio most.

    python scripts/bench/bench_rollout.py --output docs/benchmarks/rollout_cpu.json
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

from trl_tlt.tooling.benchmarks import bootstrap_interval, write_json  # first: the Hugging Face libraries offline


# isort: split

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from trl_tlt.drafters import ModelDrafter, NgramDrafter  # noqa: E402
from trl_tlt.drafters.eagle3 import Eagle3Drafter, Eagle3Model  # noqa: E402
from trl_tlt.engine.generate import SpeculativeEngine  # noqa: E402
from trl_tlt.engine.sampling import SamplingParams  # noqa: E402
from trl_tlt.engine.speculation import FixedSpeculation  # noqa: E402
from trl_tlt.tooling.workload import (  # noqa: E402
    build_draft_lm,
    build_eagle3_drafter,
    build_policy,
    make_dataset,
    prompt_token_ids,
)


CHAINS = (2, 3, 4, 5, 6, 8, 10)
TREES = ((4, 2, 8), (6, 2, 10), (6, 3, 16), (6, 4, 24), (8, 4, 32), (10, 4, 40))


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


def eagle_methods(model, head, k: int) -> dict:
    """The EAGLE-3 arms: chains of k tokens for k in CHAINS (`--num-speculative-tokens` among them) and TREES."""
    methods = {}
    for chain in sorted({*CHAINS, k}):
        methods[f"eagle3_k{chain}"] = lambda c=chain: SpeculativeEngine(model, Eagle3Drafter(head), c)
    for depth, topk, verify in TREES:
        methods[f"eagle3_tree_d{depth}_t{topk}_v{verify}"] = lambda d=depth, t=topk, v=verify: SpeculativeEngine(
            model, Eagle3Drafter(head), speculation=FixedSpeculation(d, "default", topk=t, verify=v)
        )
    return methods


def throughput_ratio(tokens: dict, seconds: dict, method: str, baseline: str, sets) -> float:
    """Tokens per second of `method` over `baseline`, totalled over the prompt `sets` (indices; tokens and seconds
    per set and method)."""
    rate = {m: sum(tokens[m][j] for j in sets) / sum(seconds[m][j] for j in sets) for m in (method, baseline)}
    return rate[method] / rate[baseline]


def arm_depth(method: str) -> int:
    """k of a chain arm, depth of a tree arm."""
    return int(method.split("_k")[1]) if "_k" in method else int(method.split("_d")[1].split("_")[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="1x1,2x4,8x8", help="prompts x generations per batch, comma-separated")
    parser.add_argument("--repeats", default="16,16,8", help="prompt sets per shape (one number, or one per shape)")
    parser.add_argument("--confirm", default="128,128,48", help="fresh prompt sets per shape for the chosen arm")
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="k of the n-gram and draft-LM arms")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--output", default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--eagle3-arms",
        default=None,
        help="comma-separated EAGLE-3 arms to run, e.g. eagle3_k6 (default: all; the tree-vs-chain figure needs a "
        "tree and the chain of its depth)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = args.shapes.split(",")
    repeats = [int(r) for r in args.repeats.split(",")]
    repeats = repeats * len(shapes) if len(repeats) == 1 else repeats
    confirm = [int(r) for r in args.confirm.split(",")]
    confirm = confirm * len(shapes) if len(confirm) == 1 else confirm
    if len(repeats) != len(shapes) or len(confirm) != len(shapes) or min(repeats + confirm) < 1:
        raise SystemExit("--repeats / --confirm: one number >= 1, or one per shape.")

    policy_path = build_policy(cache_dir=args.cache_dir)
    draft_path = build_draft_lm(cache_dir=args.cache_dir)
    eagle_path = build_eagle3_drafter(cache_dir=args.cache_dir)
    model = AutoModelForCausalLM.from_pretrained(policy_path).eval()
    draft_lm = AutoModelForCausalLM.from_pretrained(draft_path).eval()
    head = Eagle3Model.from_pretrained(eagle_path, model)
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
        **eagle_methods(model, head, k),
    }
    if args.eagle3_arms:
        wanted = args.eagle3_arms.split(",")
        unknown = sorted(set(wanted) - set(methods))
        if unknown:
            raise SystemExit(f"--eagle3-arms: unknown {unknown}; known: {sorted(m for m in methods if 'eagle3' in m)}")
        methods = {m: make for m, make in methods.items() if not m.startswith("eagle3") or m in wanted}
    eagle = [m for m in methods if m.startswith("eagle3")]

    # Warm-up (first calls allocate).
    warm = prompt_token_ids(tokenizer, make_dataset(2, seed=99)["prompt"])
    hf_generate(model, tokenizer, warm, SamplingParams(max_new_tokens=8, eos_token_ids=params.eos_token_ids), 0)
    first_chain_and_tree = [next((m for m in eagle if ("_tree_" in m) == tree), None) for tree in (False, True)]
    for make in (methods["engine_no_spec"], *(methods[m] for m in first_chain_and_tree if m)):
        make().generate(warm, SamplingParams(max_new_tokens=8))

    counts = {m: {"accepted": 0, "drafts": 0} for m in methods}

    def run_sets(names: list[str], num_prompts: int, num_generations: int, seeds: range, count: bool = True):
        """Every method in `names` on each prompt set, back to back: seconds and tokens per set, acceptance lengths
        (and, with `count`, accepted drafts into `counts`)."""
        times = {m: [] for m in names}
        set_tokens = {m: [] for m in names}
        accept = {m: [] for m in names}
        for repeat in seeds:
            data = make_dataset(num_prompts, seed=1000 + 17 * repeat + num_prompts)
            prompts = [p for p in prompt_token_ids(tokenizer, data["prompt"]) for _ in range(num_generations)]
            for name in names:
                make, seed = methods[name], 10_000 * repeat + 7
                start = time.perf_counter()
                if make is None:
                    completions = hf_generate(model, tokenizer, prompts, params, seed)
                else:
                    out = make().generate(prompts, params, generator=torch.Generator().manual_seed(seed))
                    completions = out.completion_ids
                    accept[name].append(out.stats.mean_acceptance_length)
                    if count:
                        counts[name]["accepted"] += out.stats.num_accepted_tokens
                        counts[name]["drafts"] += out.stats.num_drafts
                times[name].append(time.perf_counter() - start)
                set_tokens[name].append(sum(len(c) for c in completions))
        return times, set_tokens, accept

    per_shape = {}
    for shape, num_sets, num_confirm in zip(shapes, repeats, confirm, strict=True):
        num_prompts, num_generations = (int(x) for x in shape.split("x"))
        times, set_tokens, accept = run_sets(list(methods), num_prompts, num_generations, range(num_sets))
        tokens = {m: sum(n) for m, n in set_tokens.items()}
        total = {m: sum(t) for m, t in times.items()}
        throughput = {m: tokens[m] / total[m] for m in methods}
        # The fastest EAGLE-3 arm of the sweep, measured again on fresh prompt sets against speculation off.
        best = max(eagle, key=lambda m: throughput[m])
        confirm_times, confirm_tokens, _ = run_sets(
            ["engine_no_spec", best], num_prompts, num_generations, range(5000, 5000 + num_confirm), count=False
        )
        confirmed_ratio = functools.partial(throughput_ratio, confirm_tokens, confirm_times, best, "engine_no_spec")
        confirmed = confirmed_ratio(range(num_confirm))
        interval = bootstrap_interval(confirmed_ratio, num_confirm)  # the same ratio over resampled prompt sets
        per_shape[shape] = {
            "batch_size": num_prompts * num_generations,
            "prompt_sets": num_sets,
            "total_seconds": total,
            "median_seconds": {m: statistics.median(t) for m, t in times.items()},
            "tokens": tokens,
            "tokens_per_second": throughput,
            "mean_acceptance_length": {m: statistics.mean(a) for m, a in accept.items() if a},
            "speedup_vs_generate": {m: throughput[m] / throughput["generate"] for m in methods},
            "speedup_vs_no_spec": {m: throughput[m] / throughput["engine_no_spec"] for m in methods},
            "seconds_per_set": times,
            "tokens_per_set": set_tokens,
            "best_eagle3_arm": best,
            "best_eagle3_speedup_vs_no_spec_confirmed": confirmed,
            "best_eagle3_speedup_vs_no_spec_confirmed_95ci": list(interval),
            "confirm_prompt_sets": num_confirm,
            "confirm_seconds_per_set": confirm_times,
            "confirm_tokens_per_set": confirm_tokens,
        }
        print(f"\n== {shape} (batch {num_prompts * num_generations}), totals over {num_sets} prompt sets ==")
        print(
            f"{'method':<28}{'seconds':>9}{'tokens':>8}{'tok/s':>8}{'vs generate':>13}{'vs no-spec':>12}{'acc len':>9}"
        )
        row = per_shape[shape]
        for m in methods:
            acc = row["mean_acceptance_length"].get(m)
            print(
                f"{m:<28}{total[m]:>9.2f}{tokens[m]:>8}{row['tokens_per_second'][m]:>8.0f}"
                f"{row['speedup_vs_generate'][m]:>12.2f}x{row['speedup_vs_no_spec'][m]:>11.2f}x"
                f"{'' if acc is None else f'{acc:.2f}':>9}"
            )
        print(
            f"fastest EAGLE-3 arm: {best}; on {num_confirm} fresh prompt sets {confirmed:.2f}x vs speculation off "
            f"(95% bootstrap interval over the sets {interval[0]:.2f}-{interval[1]:.2f})"
        )

    # Acceptance over every run: accepted draft tokens per verification, the best tree vs the chain of its depth.
    accepted_per_verify = {m: c["accepted"] / c["drafts"] for m, c in counts.items() if c["drafts"]}
    acceptance_length = {m: 1 + accepted_per_verify[m] for m in accepted_per_verify}
    trees = [m for m in eagle if "_tree_" in m and f"eagle3_k{arm_depth(m)}" in accepted_per_verify]
    best_tree = max(trees, key=lambda m: accepted_per_verify[m]) if trees else None
    chain = f"eagle3_k{arm_depth(best_tree)}" if trees else None

    grpo = per_shape.get("8x8") or per_shape[shapes[-1]]
    drafters = ["engine_ngram", "engine_draft_lm", *eagle]
    best = max(drafters, key=lambda m: grpo["speedup_vs_no_spec"][m])

    def confirmed_speedup(shape: str, key: str = "best_eagle3_speedup_vs_no_spec_confirmed"):
        return per_shape[shape][key] if shape in per_shape else None

    result = {
        "benchmark": "rollout",
        "model": f"embedded policy {policy_path.name} (Qwen2, {model.config.num_hidden_layers} layers, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params), fp32",
        "draft_lm": f"{draft_path.name} ({draft_lm.config.num_hidden_layers} layer)",
        "eagle3": f"{eagle_path.name} (warm start, 1 layer)",
        "sampling": f"temperature 1.0, no top-k/top-p, max_new_tokens {args.max_new_tokens}",
        "num_speculative_tokens": k,
        "repeats": dict(zip(shapes, repeats, strict=True)),
        "confirm": dict(zip(shapes, confirm, strict=True)),
        "spec_speedup_bs1": confirmed_speedup("1x1"),
        "spec_speedup_bs8": confirmed_speedup("2x4"),
        "spec_speedup_bs64": confirmed_speedup("8x8"),
        "spec_speedup_95ci": {
            f"bs{size}": confirmed_speedup(shape, "best_eagle3_speedup_vs_no_spec_confirmed_95ci")
            for size, shape in ((1, "1x1"), (8, "2x4"), (64, "8x8"))
        },
        "tree_over_chain_acceptance": accepted_per_verify[best_tree] / accepted_per_verify[chain] if trees else None,
        "tree_over_chain_acceptance_length": acceptance_length[best_tree] / acceptance_length[chain]
        if trees
        else None,
        "best_tree": best_tree,
        "chain_of_equal_k": chain,
        "accepted_tokens_per_verify": accepted_per_verify,
        "best_drafter": best,
        "speedup_vs_generate": grpo["speedup_vs_generate"][best],
        "speedup_vs_no_spec": grpo["speedup_vs_no_spec"][best],
        "no_spec_speedup_vs_generate": grpo["speedup_vs_generate"]["engine_no_spec"],
        "mean_acceptance_length": grpo["mean_acceptance_length"][best],
        "per_batch_size": per_shape,
    }
    print(
        f"\nspec-on / spec-off (fastest EAGLE-3 arm, confirmed on fresh sets): batch 1 {result['spec_speedup_bs1']}, "
        f"batch 8 {result['spec_speedup_bs8']}, batch 64 {result['spec_speedup_bs64']}"
    )
    if trees:
        print(
            f"accepted tokens per verify: best tree {best_tree} {accepted_per_verify[best_tree]:.2f} vs {chain} "
            f"{accepted_per_verify[chain]:.2f} ({result['tree_over_chain_acceptance']:.2f}x; acceptance length "
            f"{result['tree_over_chain_acceptance_length']:.2f}x)"
        )
    print(
        f"GRPO-like batch: best drafter {best}: {result['speedup_vs_generate']:.2f}x vs generate, "
        f"{result['speedup_vs_no_spec']:.2f}x vs speculation off"
    )
    write_json(result, args.output)


if __name__ == "__main__":
    main()
