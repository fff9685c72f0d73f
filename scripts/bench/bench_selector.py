"""Adaptive speculation vs every fixed arm, on the embedded workload, in one process.

Sweeps fixed arms (speculation off; n-gram with k in {1, 2, 4}; the 1-layer draft LM with k in {1, 2, 3, 4, 6})
and the bandit over all of them, on the same GRPO-like batches (8 prompts x 8 samples, temperature 1). The bandit
keeps its state across batches, as it does across RL steps; it is warmed up on `--warmup` batches that are not
timed. Reports total rollout time per method over the timed batches and the adaptive / best-fixed ratio.

    python scripts/bench/bench_selector.py --output docs/benchmarks/selector_cpu.json
"""

from __future__ import annotations

import argparse
import time

from trl_tlt.tooling.benchmarks import bootstrap_interval, write_json  # first: the Hugging Face libraries offline


# isort: split

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from trl_tlt.drafters import ModelDrafter, NgramDrafter  # noqa: E402
from trl_tlt.drafters.eagle3 import Eagle3Drafter, Eagle3Model  # noqa: E402
from trl_tlt.engine.generate import SpeculativeEngine  # noqa: E402
from trl_tlt.engine.sampling import SamplingParams  # noqa: E402
from trl_tlt.engine.speculation import BanditSpeculation, FixedSpeculation  # noqa: E402
from trl_tlt.tooling.workload import (  # noqa: E402
    build_draft_lm,
    build_eagle3_drafter,
    build_policy,
    make_dataset,
    prompt_token_ids,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, default=6, help="timed batches of 8 prompts x 8 samples")
    parser.add_argument("--warmup", type=int, default=3, help="untimed batches the bandit learns on first")
    parser.add_argument("--rounds", type=int, default=2, help="passes over the timed batches")
    parser.add_argument("--epsilon", type=float, default=0.1, help="exploration probability of the bandit")
    parser.add_argument(
        "--bandit-drafters", default="ngram,lm", help="drafters whose arms the bandit may play (it always has 'off')"
    )
    parser.add_argument(
        "--drafter-set",
        choices=["ngram+lm", "eagle3"],
        default="ngram+lm",
        help="ngram+lm: n-gram (k 1, 2, 4) and the 1-layer draft LM (k 1, 2, 3, 4, 6); eagle3: the warm-start EAGLE-3 "
        "head alone with k in --ks (TLTGRPOTrainer's default set-up)",
    )
    parser.add_argument(
        "--ks", default="1,2,3,4", help="eagle3: draft lengths (the trainer's, num_speculative_tokens=4)"
    )
    parser.add_argument(
        "--greedy",
        action="store_true",
        help="greedy rollouts: every method emits the same tokens (lossless), so times differ only by speed, not by "
        "the sampled lengths of the long tail",
    )
    parser.add_argument("--output", default=None)
    args = parser.parse_args()

    policy_path = build_policy()
    model = AutoModelForCausalLM.from_pretrained(policy_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(policy_path)
    if args.drafter_set == "eagle3":
        head = Eagle3Model.from_pretrained(str(build_eagle3_drafter()), model)
        drafters = {"eagle3": Eagle3Drafter(head)}
        arms = [("eagle3", int(k)) for k in args.ks.split(",")]
        args.bandit_drafters = "eagle3"
    else:
        drafters = {
            "ngram": NgramDrafter(max_n=4, min_n=2),
            "lm": ModelDrafter(AutoModelForCausalLM.from_pretrained(build_draft_lm()).eval(), model.config.vocab_size),
        }
        arms = [("ngram", k) for k in (1, 2, 4)] + [("lm", k) for k in (1, 2, 3, 4, 6)]
    params = SamplingParams(
        do_sample=not args.greedy, temperature=1.0, max_new_tokens=512, eos_token_ids=(tokenizer.eos_token_id,)
    )
    fixed = {"off": FixedSpeculation(0)} | {f"{d}:k={k}": FixedSpeculation(k, d) for d, k in arms}
    allowed = args.bandit_drafters.split(",")
    bandit = BanditSpeculation(arms=[a for a in arms if a[0] in allowed], epsilon=args.epsilon, seed=0)

    def batch(i):
        data = make_dataset(8, seed=5000 + i)
        return [p for p in prompt_token_ids(tokenizer, data["prompt"]) for _ in range(8)]

    for i in range(args.warmup):
        SpeculativeEngine(model, drafter=drafters, speculation=bandit).generate(batch(-1 - i), params)

    per_batch = {name: [] for name in [*fixed, "bandit"]}
    for _ in range(args.rounds):
        for i in range(args.batches):
            prompts = batch(i)
            for name in per_batch:  # interleaved: every method sees the same prompts back to back
                policy = bandit if name == "bandit" else fixed[name]
                engine = SpeculativeEngine(model, drafter=drafters, speculation=policy)
                start = time.perf_counter()
                engine.generate(prompts, params, generator=torch.Generator().manual_seed(i))
                per_batch[name].append(time.perf_counter() - start)
    totals = {name: sum(times) for name, times in per_batch.items()}
    best_fixed = min((t, n) for n, t in totals.items() if n != "bandit")
    # 95% bootstrap interval of the ratio, resampling batches (paired: the same batches for both methods)
    interval = bootstrap_interval(
        lambda picks: sum(per_batch["bandit"][j] for j in picks) / sum(per_batch[best_fixed[1]][j] for j in picks),
        len(per_batch["bandit"]),
    )
    result = {
        "benchmark": "selector",
        "workload": f"embedded policy {policy_path.name}, 8 prompts x 8 samples, "
        f"{'greedy' if args.greedy else 'temperature 1'}, "
        f"{args.batches} batches x {args.rounds} rounds (bandit warmed up on {args.warmup} batches)",
        "total_seconds": totals,
        "best_fixed_arm": best_fixed[1],
        "adaptive_over_best_fixed": totals["bandit"] / best_fixed[0],
        "adaptive_over_best_fixed_95ci": list(interval),
        "per_batch_seconds": per_batch,
        "epsilon": args.epsilon,
        "drafter_set": args.drafter_set,
        "bandit_arms": [list(a) for a in bandit.arms],
        "bandit_best_arms": {str(b): list(a if a.is_tree else a[:2]) for b, a in bandit.best_arms().items()},
    }
    for name, seconds in sorted(totals.items(), key=lambda x: x[1]):
        print(f"{name:<12}{seconds:8.2f}s")
    low, high = result["adaptive_over_best_fixed_95ci"]
    print(
        f"adaptive / best fixed ({best_fixed[1]}): {result['adaptive_over_best_fixed']:.3f} (95% {low:.3f}-{high:.3f})"
    )
    print("bandit's arms per bucket:", result["bandit_best_arms"])
    write_json(result, args.output)


if __name__ == "__main__":
    main()
