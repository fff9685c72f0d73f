"""What `TLTConfig(speculative_trees=True)` costs or gains: the trainer's bandit over chains vs over chains plus its
two tree arms, on the embedded policy with the warm EAGLE-3 head, in one process.

Arms as the trainer builds them for `num_speculative_tokens=4`: chains k in {1, 2, 3, 4} (and off), plus trees
(4, 2, 8) and (4, 4, 16). Each bandit keeps its state across batches, as across RL steps; both see the same prompt
sets back to back; `--warmup` batches are not timed. Reports throughput (completion tokens per second) per shape and
the ratio with trees / without.

    python scripts/bench/bench_tree_arms.py --output docs/benchmarks/tree_arms_cpu.json
"""

from __future__ import annotations

import argparse
import time

from trl_tlt.tooling.benchmarks import write_json  # first: the Hugging Face libraries offline


# isort: split

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from trl_tlt.drafters.eagle3 import Eagle3Drafter, Eagle3Model  # noqa: E402
from trl_tlt.engine.generate import SpeculativeEngine  # noqa: E402
from trl_tlt.engine.sampling import SamplingParams  # noqa: E402
from trl_tlt.engine.speculation import BanditSpeculation, tree_arm  # noqa: E402
from trl_tlt.tooling.workload import build_eagle3_drafter, build_policy, make_dataset, prompt_token_ids  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="2x4,8x8", help="prompts x generations per batch")
    parser.add_argument("--batches", default="24,10", help="timed batches per shape")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()

    policy_path = build_policy(cache_dir=args.cache_dir)
    model = AutoModelForCausalLM.from_pretrained(policy_path).eval()
    head = Eagle3Model.from_pretrained(build_eagle3_drafter(cache_dir=args.cache_dir), model)
    tokenizer = AutoTokenizer.from_pretrained(policy_path)
    params = SamplingParams(temperature=1.0, max_new_tokens=512, eos_token_ids=(tokenizer.eos_token_id,))
    chains = [("default", k) for k in (1, 2, 3, 4)]
    trees = [tree_arm("default", 4, topk, 4 * topk) for topk in (2, 4)]

    result = {"benchmark": "tree_arms", "chains": chains, "trees": trees, "per_shape": {}}
    for shape, batches in zip(args.shapes.split(","), (int(b) for b in args.batches.split(",")), strict=True):
        num_prompts, num_generations = (int(x) for x in shape.split("x"))
        bandits = {"chains": BanditSpeculation(arms=chains), "chains+trees": BanditSpeculation(arms=chains + trees)}
        seconds = dict.fromkeys(bandits, 0.0)
        tokens = dict.fromkeys(bandits, 0)
        tree_steps = dict.fromkeys(bandits, 0)
        steps = dict.fromkeys(bandits, 0)
        for i in range(args.warmup + batches):
            data = make_dataset(num_prompts, seed=3000 + 17 * i + num_prompts)
            prompts = [p for p in prompt_token_ids(tokenizer, data["prompt"]) for _ in range(num_generations)]
            for name, bandit in bandits.items():
                engine = SpeculativeEngine(model, drafter=Eagle3Drafter(head), speculation=bandit)
                start = time.perf_counter()
                out = engine.generate(prompts, params, generator=torch.Generator().manual_seed(i))
                if i >= args.warmup:
                    seconds[name] += time.perf_counter() - start
                    tokens[name] += out.stats.num_emitted_tokens
                    tree_steps[name] += out.stats.num_tree_steps
                    steps[name] += len(out.stats.active_batch_sizes)
        rate = {name: tokens[name] / seconds[name] for name in bandits}
        row = {
            "timed_batches": batches,
            "tokens_per_second": rate,
            "with_trees_over_without": rate["chains+trees"] / rate["chains"],
            "tree_step_fraction": tree_steps["chains+trees"] / steps["chains+trees"],
            "best_arms_with_trees": {
                str(b): list(a if a.is_tree else a[:2]) for b, a in bandits["chains+trees"].best_arms().items()
            },
        }
        result["per_shape"][shape] = row
        print(
            f"{shape}: tokens/s without trees {rate['chains']:.0f}, with {rate['chains+trees']:.0f} "
            f"({row['with_trees_over_without']:.3f}x); tree steps {row['tree_step_fraction']:.1%}; "
            f"best arms {row['best_arms_with_trees']}"
        )
    write_json(result, args.output)


if __name__ == "__main__":
    main()
