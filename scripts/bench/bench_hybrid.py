"""Hybrid drafting benchmark (`HybridDrafter`): rollout throughput, a cold start, and the same prompts over epochs.

Three parts, each in one process on the embedded workload (temperature 1, 512 tokens):

- `rollout`: at batch 8 (2 prompts x 4) and 64 (8 x 8), interleaved on the same prompt sets: the engine without
  speculation, the n-gram drafter (k = 4), the warm EAGLE-3 head alone, as a fixed chain of 6 (`eagle3_k6`) and under
  the trainer's bandit (`eagle3`: chains up to 6), the hybrid under the trainer's bandit (chains up to 6, and 8, 12,
  16 with lookups past the head's 6) with no history (a prompt seen for the first time), and the same with a history
  holding one earlier rollout of the same prompts (`hybrid_history`: a later epoch; that rollout untimed). Each arm
  keeps one drafter and one bandit over the sets, as the trainer does. Ratios of throughput (tokens per second,
  totalled over the sets) with 95% bootstrap intervals over the prompt sets: `hybrid_over_eagle3_bs8` = hybrid /
  head alone (same bandit) = the ratio of their spec-on/off speed-ups, and so on.
- `cold`: 30 steps of 8 x 8 from a new head (no warm start): GRPOTrainer, TLTGRPOTrainer with the head alone
  and with the hybrid (`hybrid_drafting=True`). `hybrid_cold_step_ratio`: GRPOTrainer's median step
  over the hybrid's, steps 1-10; `hybrid_over_head_steps_10_30`: the head alone's median step over the hybrid's.
- `epochs`: 24 steps of 8 x 8 over 64 prompts (3 epochs), from a new head, the hybrid with its history and without
  (`history_max_tokens=0`, the control): rollout seconds per epoch and the history's share of accepted tokens.
  `history_epoch3_over_epoch1`: epoch 1 / epoch 3 rollout time, with a 95% bootstrap interval over the steps.

    python scripts/bench/bench_hybrid.py --output docs/benchmarks/hybrid_cpu.json
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import tempfile
import time
from types import SimpleNamespace

from trl_tlt.tooling.benchmarks import bootstrap_interval, write_json  # first: the Hugging Face libraries offline


# isort: split

import torch  # noqa: E402
from bench_e2e import run as run_trainer  # noqa: E402
from bench_rollout import throughput_ratio  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from trl_tlt.drafters import NgramDrafter  # noqa: E402
from trl_tlt.drafters.eagle3 import Eagle3Drafter, Eagle3Model  # noqa: E402
from trl_tlt.drafters.history import PromptHistory  # noqa: E402
from trl_tlt.drafters.hybrid import HybridDrafter  # noqa: E402
from trl_tlt.engine.generate import SpeculativeEngine  # noqa: E402
from trl_tlt.engine.sampling import SamplingParams  # noqa: E402
from trl_tlt.engine.speculation import BANDIT_DRAFT_LENGTHS, LOOKUP_DRAFT_LENGTHS, Arm, BanditSpeculation  # noqa: E402
from trl_tlt.tooling.workload import build_eagle3_drafter, build_policy, make_dataset, prompt_token_ids  # noqa: E402


ARMS = ("engine_no_spec", "ngram", "eagle3_k6", "eagle3", "hybrid", "hybrid_history")
K = 6  # TLTConfig's num_speculative_tokens


def bandit(hybrid: bool) -> BanditSpeculation:
    """The trainer's bandit (`speculative_selector="bandit"`): chains up to K, and past it with hybrid drafting."""
    lengths = [k for k in BANDIT_DRAFT_LENGTHS if k <= K] + [k for k in LOOKUP_DRAFT_LENGTHS if hybrid and k > K]
    return BanditSpeculation(arms=[Arm("default", k) for k in lengths])


def rollout_part(shapes: list[str], sets: list[int], max_new_tokens: int) -> dict:
    policy_path = build_policy()
    model = AutoModelForCausalLM.from_pretrained(policy_path).eval()
    head = Eagle3Model.from_pretrained(build_eagle3_drafter(), model)
    tokenizer = AutoTokenizer.from_pretrained(policy_path)
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, eos_token_ids=(tokenizer.eos_token_id,))
    warm = prompt_token_ids(tokenizer, make_dataset(2, seed=99)["prompt"])
    SpeculativeEngine(model, Eagle3Drafter(head), 6).generate(warm, SamplingParams(max_new_tokens=8))
    out = {"policy": policy_path.name, "eagle3": "warm start (cached)", "per_batch_size": {}}
    for shape, num_sets in zip(shapes, sets, strict=True):
        num_prompts, num_generations = (int(x) for x in shape.split("x"))
        batch = num_prompts * num_generations
        # As in the trainer: one drafter and one bandit per arm over all the sets.
        hybrids = {name: HybridDrafter(Eagle3Drafter(head), learned_tokens=K) for name in ("hybrid", "hybrid_history")}
        bandits = {name: bandit(hybrid=name != "eagle3") for name in ("eagle3", *hybrids)}
        head_alone = Eagle3Drafter(head)
        engines = {
            "engine_no_spec": lambda: SpeculativeEngine(model),
            "ngram": lambda: SpeculativeEngine(model, NgramDrafter(), num_speculative_tokens=4),
            "eagle3_k6": lambda: SpeculativeEngine(model, Eagle3Drafter(head), num_speculative_tokens=K),
            "eagle3": functools.partial(SpeculativeEngine, model, head_alone, speculation=bandits["eagle3"]),
            **{
                name: functools.partial(SpeculativeEngine, model, d, speculation=bandits[name])
                for name, d in hybrids.items()
            },
        }
        tokens = {a: [] for a in ARMS}
        seconds = {a: [] for a in ARMS}
        accepted = {a: [0, 0] for a in ARMS}  # accepted draft tokens, verify steps
        by_source = {a: {} for a in ("hybrid", "hybrid_history")}
        for j in range(num_sets):
            data = make_dataset(num_prompts, seed=3000 + 17 * j + num_prompts)
            prompts = [p for p in prompt_token_ids(tokenizer, data["prompt"]) for _ in range(num_generations)]
            earlier = SpeculativeEngine(model).generate(prompts, params, generator=torch.Generator().manual_seed(j))
            hybrids["hybrid_history"].history = PromptHistory(1 << 20)
            hybrids["hybrid_history"].history.add(prompts, earlier.completion_ids)
            for arm in ARMS:
                start = time.perf_counter()
                result = engines[arm]().generate(
                    prompts, params, generator=torch.Generator().manual_seed(10_000 * j + 7)
                )
                seconds[arm].append(time.perf_counter() - start)
                tokens[arm].append(result.stats.num_emitted_tokens)
                accepted[arm][0] += result.stats.num_accepted_tokens
                accepted[arm][1] += sum(1 for k in result.stats.num_speculative_tokens if k > 0)
                if arm in by_source:
                    for source, n in result.stats.num_accepted_tokens_by_source.items():
                        by_source[arm][source] = by_source[arm].get(source, 0) + n
        ratio = functools.partial(throughput_ratio, tokens, seconds)
        row = {
            "batch_size": batch,
            "prompt_sets": num_sets,
            "tokens_per_second": {a: sum(tokens[a]) / sum(seconds[a]) for a in ARMS},
            "spec_on_off": {a: ratio(a, "engine_no_spec", range(num_sets)) for a in ARMS},
            # accepted draft tokens per speculative decode step (a step verifies every active row once)
            "accepted_tokens_per_verify_step": {a: accepted[a][0] / max(accepted[a][1], 1) for a in ARMS},
            "accepted_by_source": by_source,
        }
        for arm in ("hybrid", "hybrid_history"):
            for other in ("eagle3", "eagle3_k6", "ngram"):
                key = f"{arm}_over_{other}_bs{batch}"
                out[key] = ratio(arm, other, range(num_sets))
                out[f"{key}_95ci"] = bootstrap_interval(functools.partial(ratio, arm, other), num_sets)
        out["per_batch_size"][shape] = row
        print(f"batch {batch}: " + ", ".join(f"{a} {row['spec_on_off'][a]:.2f}x" for a in ARMS), flush=True)
    return out


def trainer_args(steps: int, epochs: int, tlt_args: str) -> SimpleNamespace:
    """bench_e2e's arguments: 8 prompts x 8, 512 tokens, a new EAGLE-3 head (every default but `tlt_args`)."""
    return SimpleNamespace(
        steps=steps,
        epochs=epochs,
        num_prompts=8,
        num_generations=8,
        max_completion_length=512,
        learning_rate=5e-5,
        drafter_type="eagle3-new",
        tlt_args=tlt_args,
        acceptance_every=0,
        eval_problems=0,
    )


def cold_part(steps: int, seed: int) -> dict:
    policy_path = build_policy()
    arms = {
        "grpo": ("grpo", "{}"),
        "head_alone": ("tlt_new", '{"hybrid_drafting": false}'),
        "hybrid": ("tlt_new", '{"hybrid_drafting": true}'),
    }
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arm, (name, tlt_args) in arms.items():
            print(f"== cold start: {arm} ==", flush=True)
            runs[arm] = run_trainer(name, policy_path, seed, trainer_args(steps, 1, tlt_args), f"{tmp}/{arm}")

    def median(arm, first, last):
        return statistics.median(runs[arm]["step_time"][first - 1 : last])

    return {
        "seed": seed,
        "steps": steps,
        "hybrid_cold_step_ratio": median("grpo", 1, 10) / median("hybrid", 1, 10),
        "head_alone_cold_step_ratio": median("grpo", 1, 10) / median("head_alone", 1, 10),
        "hybrid_over_head_steps_1_10": median("head_alone", 1, 10) / median("hybrid", 1, 10),
        "hybrid_over_head_steps_10_30": median("head_alone", 10, steps) / median("hybrid", 10, steps),
        "grpo_over_hybrid_steps_10_30": median("grpo", 10, steps) / median("hybrid", 10, steps),
        "median_step_seconds": {
            arm: {"steps_1_10": median(arm, 1, 10), f"steps_10_{steps}": median(arm, 10, steps)} for arm in runs
        },
        "runs": runs,
    }


def epoch_ratio_interval(times: list[float], per_epoch: int, draws: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of epoch 1 / epoch 3 total rollout time, resampling each epoch's steps."""
    rng = random.Random(0)
    first, third = times[:per_epoch], times[2 * per_epoch : 3 * per_epoch]
    values = sorted(sum(rng.choices(first, k=per_epoch)) / sum(rng.choices(third, k=per_epoch)) for _ in range(draws))
    return values[int(0.025 * draws)], values[int(0.975 * draws) - 1]


def epochs_part(steps: int, seed: int) -> dict:
    policy_path = build_policy()
    per_epoch = steps // 3
    arms = {
        "hybrid": '{"hybrid_drafting": true}',
        "hybrid_no_history": '{"hybrid_drafting": true, "history_max_tokens": 0}',
    }
    out = {"seed": seed, "steps": steps, "prompts": 8 * per_epoch, "steps_per_epoch": per_epoch, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for arm, tlt_args in arms.items():
            print(f"== epochs: {arm} ==", flush=True)
            r = run_trainer("tlt_new", policy_path, seed, trainer_args(steps, 3, tlt_args), f"{tmp}/{arm}")
            times = r["rollout_time"]
            share = [x or 0.0 for x in r["accepted_from_history"]]
            out["runs"][arm] = {
                "rollout_seconds_per_epoch": [sum(times[e * per_epoch : (e + 1) * per_epoch]) for e in range(3)],
                "history_share_per_epoch": [
                    statistics.mean(share[e * per_epoch : (e + 1) * per_epoch]) for e in range(3)
                ],
                "mean_acceptance_length_per_epoch": [
                    statistics.mean(x or 1.0 for x in r["mean_acceptance_length"][e * per_epoch : (e + 1) * per_epoch])
                    for e in range(3)
                ],
                "epoch1_over_epoch3": sum(times[:per_epoch]) / sum(times[2 * per_epoch :]),
                "epoch1_over_epoch3_95ci": epoch_ratio_interval(times, per_epoch),
                "run": r,
            }
    out["history_epoch3_over_epoch1"] = out["runs"]["hybrid"]["epoch1_over_epoch3"]
    out["history_epoch3_over_epoch1_95ci"] = out["runs"]["hybrid"]["epoch1_over_epoch3_95ci"]
    out["no_history_epoch3_over_epoch1"] = out["runs"]["hybrid_no_history"]["epoch1_over_epoch3"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--parts", default="rollout,cold,epochs")
    parser.add_argument("--shapes", default="2x4,8x8")
    parser.add_argument("--sets", default="48,16", help="prompt sets per shape")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--cold-steps", type=int, default=30)
    parser.add_argument("--epoch-steps", type=int, default=24, help="steps of the 3-epoch run (divisible by 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    parts = args.parts.split(",")
    result = {"benchmark": "hybrid", "parts": parts}
    if "rollout" in parts:
        shapes, sets = args.shapes.split(","), [int(s) for s in args.sets.split(",")]
        result["rollout"] = rollout_part(shapes, sets, args.max_new_tokens)
        result.update({k: v for k, v in result["rollout"].items() if k.startswith("hybrid")})
    if "cold" in parts:
        result["cold"] = cold_part(args.cold_steps, args.seed)
        result["hybrid_cold_step_ratio"] = result["cold"]["hybrid_cold_step_ratio"]
    if "epochs" in parts:
        if args.epoch_steps % 3:
            raise SystemExit(f"--epoch-steps must be divisible by 3, got {args.epoch_steps}.")
        result["epochs"] = epochs_part(args.epoch_steps, args.seed)
        result["history_epoch3_over_epoch1"] = result["epochs"]["history_epoch3_over_epoch1"]
        result["history_epoch3_over_epoch1_95ci"] = result["epochs"]["history_epoch3_over_epoch1_95ci"]
    print({k: v for k, v in result.items() if not isinstance(v, dict)})
    write_json(result, args.output)


if __name__ == "__main__":
    main()
