"""The real policy in RL's regime (#52): SmolLM2-135M-Instruct before and after a few minutes of SFT on its task
(`trl_tlt.tooling.real_model.real_regime_policy_path`), and what a drafter is up against: the per-token entropy of
its samples at temperature 1, their reward and lengths.

    pip install -e ".[real-model]"
    python scripts/bench/bench_real_regime.py --output docs/benchmarks/real_regime_cpu.json
"""

import argparse
import dataclasses
import statistics
import time

from trl_tlt.tooling.benchmarks import write_json  # first: the Hugging Face libraries offline


# isort: split


import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from trl_tlt.engine import SamplingParams, SpeculativeEngine  # noqa: E402
from trl_tlt.tooling.real_model import (  # noqa: E402
    RealRegimeRecipe,
    answer_reward,
    completion_entropy,
    real_model_path,
    real_model_prompts,
    real_regime_policy_path,
)
from trl_tlt.tooling.workload import prompt_token_ids  # noqa: E402


def describe(path: str, rows: list[dict], max_new_tokens: int, seed: int) -> dict:
    """Sample every prompt once at temperature 1 (no truncation) and describe the samples."""
    policy = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = prompt_token_ids(tokenizer, [r["prompt"] for r in rows])
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, eos_token_ids=(tokenizer.eos_token_id,))
    out = SpeculativeEngine(policy, drafter=None).generate(
        prompts, params, generator=torch.Generator().manual_seed(seed)
    )
    texts = tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
    rewards = answer_reward(texts, [r["answer"] for r in rows], [r["first"] for r in rows])
    lengths = [len(c) for c in out.completion_ids]
    return {
        "entropy_nats_per_token": completion_entropy(policy, prompts, out.completion_ids),
        "mean_reward": statistics.fmean(rewards),
        "exact_answer_share": statistics.fmean(r == 1.0 for r in rewards),
        "mean_length": statistics.fmean(lengths),
        "max_length": max(lengths),
        "truncated_share": statistics.fmean(n >= max_new_tokens for n in lengths),
        "example": texts[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32, help="Held-out prompts, one sample each.")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    recipe = RealRegimeRecipe()
    start = time.perf_counter()
    path = real_regime_policy_path(recipe)
    build_seconds = time.perf_counter() - start
    rows = real_model_prompts(args.prompts, seed=4242)  # held out: the SFT draws its problems from seed + 101
    before = describe(real_model_path(), rows, args.max_new_tokens, seed=0)
    after = describe(path, rows, args.max_new_tokens, seed=0)
    result = {
        "benchmark": "real_regime",
        "recipe": dataclasses.asdict(recipe),
        "build_seconds": build_seconds,
        "held_out_prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "real_regime_entropy_before": before["entropy_nats_per_token"],
        "real_regime_entropy_after": after["entropy_nats_per_token"],
        "before": before,
        "after": after,
    }
    print({k: v for k, v in result.items() if k not in ("before", "after")})
    print("before:", before)
    print("after:", after)
    write_json(result, args.output)


if __name__ == "__main__":
    main()
