"""What a plain swap costs and gives: `GRPOTrainer` vs `TLTGRPOTrainer` with every TLT default, no drafter given.

Three set-ups, each trainer run back to back on the same prompts and seed (the order alternates between repeats):

- `bigvocab`: a policy with Qwen2.5's vocabulary size (151,665 tokens: the embedded task's tokenizer extended by
  merges of non-ASCII byte symbols, `trl_tlt.tooling.tiny.extend_vocabulary`) and random weights shaped like TRL's tiny test
  models (hidden 8, 2 layers); 8 prompts x 4, 32 completion tokens, 10 steps. `bigvocab_wall_ratio` = TLT / GRPO wall
  time (construction + `train()`), first step included.
- `bigvocab_trained`: the embedded SFT policy with the same extended vocabulary, its new output rows fitted so that
  it does not emit them (cached); same shape of run. `bigvocab_trained_step_ratio` = GRPO / TLT median step time over steps 5-10.
- `drift`: the drift scenario's start policy, `style_reward`, 8 prompts x 8 (micro-batches of one group, as in the
  demo), 30 steps, no drafter given (a new
  EAGLE-3 head). `default_step_ratio` / `default_early_step_ratio` = GRPO / TLT median step over steps 10-30 / 1-10;
  `default_adaptive_over_frozen` = the online head's acceptance length at the end over that of a copy frozen at
  step 10 (after the cold start), on the same held-out prompts (the engine speculating k=6 at every step).

    python scripts/bench/bench_plain_swap.py --output docs/benchmarks/plain_swap_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from trl_tlt.tooling.benchmarks import (  # first: the Hugging Face libraries offline
    step_timer,
    trainer_config,
    write_json,
)


# isort: split

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from trl_tlt import TLTGRPOTrainer  # noqa: E402
from trl_tlt.drafters.eagle3 import Eagle3Drafter  # noqa: E402
from trl_tlt.engine.sampling import SamplingParams  # noqa: E402
from trl_tlt.tooling.tiny import build_tokenizer, extend_vocabulary  # noqa: E402
from trl_tlt.tooling.workload import (  # noqa: E402
    PolicyRecipe,
    accuracy_reward,
    build_drift_policy,
    build_policy,
    default_cache_dir,
    drift_rewards,
    encode_sft_example,
    make_dataset,
    prompt_token_ids,
    sft_dataset,
)
from trl_tlt.training.warm_start import evaluate_acceptance  # noqa: E402


QWEN25_VOCAB_SIZE = 151_665


TRAINERS = ["grpo", "tlt"]  # --trainers
TLT_ARGS: dict = {}  # --tlt-args: TLTConfig fields for the TLT runs (none: a plain swap, every default)


def grpo_config(
    output_dir: str,
    steps: int,
    prompts: int,
    generations: int,
    completion: int,
    seed: int,
    tlt: bool = False,
    micro_batch: int | None = None,
    **extra,
) -> GRPOConfig:
    """The run's GRPOConfig (the TLT trainer turns it into a TLTConfig with every default), or a TLTConfig with
    `TLT_ARGS` when there are any. One generation of prompts x generations per optimizer step, in micro-batches of
    `micro_batch` rows (None: one)."""
    return trainer_config(
        "tlt" if tlt and TLT_ARGS else "grpo", output_dir, num_prompts=prompts, num_generations=generations,
        max_completion_length=completion, steps=steps, seed=seed, micro_batch=micro_batch or prompts * generations,
        tlt_args=TLT_ARGS, **extra,
    )  # fmt: skip


def run_trainer(trainer_cls, policy_path: str, config: GRPOConfig, dataset, rewards, probe=None) -> dict:
    """Construct and train; wall time of both, per-step times, the TLT metrics of every step."""
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(policy_path, padding_side="left")
    trainer = trainer_cls(
        model=AutoModelForCausalLM.from_pretrained(policy_path),
        reward_funcs=rewards,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    times = step_timer()
    trainer.add_callback(times)
    if probe is not None:
        trainer.add_callback(probe(trainer))
    trainer.train()
    wall = time.perf_counter() - start
    logs = [h for h in trainer.state.log_history if "reward" in h]
    result = {"wall_seconds": wall, "step_seconds": times.times, "reward": [h["reward"] for h in logs]}
    for key in ("tlt/mean_acceptance_length", "tlt/spot_seconds", "tlt/drafter_steps", "tlt/spot_budget_share",
                "tlt/drafter_eval_acceptance_length", "tlt/rollout_seconds", "tlt/draft_vocab_coverage"):  # fmt: skip
        if any(key in h for h in logs):
            result[key.removeprefix("tlt/")] = [h.get(key) for h in logs]
    return result


def random_bigvocab_policy(folder: str) -> str:
    """TRL's tiny-model shape (hidden 8, 4 heads, 2 KV heads, 2 layers, MLP 32) with Qwen2.5's vocabulary size."""
    corpus = [p[0]["content"] for p in make_dataset(2000, seed=5)["prompt"]]
    tokenizer = extend_vocabulary(build_tokenizer(corpus, vocab_size=400), QWEN25_VOCAB_SIZE)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=8, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        intermediate_size=32, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    for module in model.modules():  # TRL's init_weights_tiny_model
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.xavier_uniform_(module.weight)
        elif isinstance(module, torch.nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def trained_bigvocab_policy() -> tuple[str, dict]:
    """The embedded SFT policy with Qwen2.5's vocabulary size (cached beside it): the tokenizer extended (ASCII text
    keeps its ids), and the new output rows fitted so that the policy does not emit them: one row vector v, shared
    by every new token (plus noise of 1e-3), minimising the new tokens' total probability on the SFT data's positions
    (a 128-parameter fit of what an SFT would teach those rows). Returns the path and the new tokens' probability
    mass after the fit (mean and max over positions)."""
    base = build_policy()
    path = default_cache_dir() / f"{base.name}-vocab{QWEN25_VOCAB_SIZE}"
    report_path = path / "extension.json"
    if report_path.is_file():
        return str(path), json.loads(report_path.read_text())
    small = AutoTokenizer.from_pretrained(base)
    tokenizer = extend_vocabulary(small, QWEN25_VOCAB_SIZE)
    model = AutoModelForCausalLM.from_pretrained(base).eval()
    data = sft_dataset(PolicyRecipe()).select(range(256))
    with torch.no_grad():  # the policy's last (normed) hidden states at every position
        hidden = torch.cat([
            model.model(torch.tensor([encode_sft_example(small, p, c)[0]])).last_hidden_state[0]
            for p, c in zip(data["prompt"], data["completion"])
        ])  # fmt: skip
        real = torch.logsumexp(hidden @ model.get_output_embeddings().weight.T, dim=-1)
    num_new = QWEN25_VOCAB_SIZE - len(small)
    log_new = torch.log(torch.tensor(float(num_new)))
    v = model.get_output_embeddings().weight.detach().mean(0).clone().requires_grad_(True)
    optimizer = torch.optim.Adam([v], lr=0.05)

    def new_mass():  # per position: the new tokens' share of probability
        junk = hidden @ v + log_new
        return torch.exp(junk - torch.logaddexp(real, junk))

    for _ in range(500):
        optimizer.zero_grad()
        new_mass().mean().backward()
        optimizer.step()
    with torch.no_grad():
        mass = new_mass()
        report = {"new_token_mass_mean": float(mass.mean()), "new_token_mass_max": float(mass.max())}
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        generator = torch.Generator().manual_seed(0)
        rows = model.get_output_embeddings().weight[len(small) :]
        rows.copy_(v + 1e-3 * torch.randn(rows.shape, generator=generator))
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "extension.json").write_text(json.dumps(report))
    tmp.rename(path)
    return str(path), report


def pair(name: str, policy_path: str, config_for, dataset, rewards, repeats: int, probe=None) -> dict:
    """Both trainers, `repeats` times, alternating which goes first."""
    runs = {"grpo": [], "tlt": []}
    for repeat in range(repeats):
        order = ("grpo", "tlt") if repeat % 2 == 0 else ("tlt", "grpo")
        for trainer in (t for t in order if t in TRAINERS):
            with tempfile.TemporaryDirectory() as out:
                cls = GRPOTrainer if trainer == "grpo" else TLTGRPOTrainer
                result = run_trainer(
                    cls,
                    policy_path,
                    config_for(out, trainer == "tlt"),
                    dataset,
                    rewards,
                    probe if trainer == "tlt" else None,
                )
            runs[trainer].append(result)
            print(f"{name} {trainer} repeat {repeat}: {result['wall_seconds']:.1f}s, steps "
                  f"{[round(t, 2) for t in result['step_seconds']]}", flush=True)  # fmt: skip
    return runs


def median_steps(runs: list[dict], first: int, last: int) -> float:
    return statistics.median(t for r in runs for t in r["step_seconds"][first - 1 : last])


def bench_bigvocab(args, result: dict) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = random_bigvocab_policy(folder)
        dataset = make_dataset(8 * args.bigvocab_steps, seed=11)
        runs = pair("bigvocab", path, lambda out, tlt: grpo_config(out, args.bigvocab_steps, 8, 4, 32, 0, tlt), dataset,
                    accuracy_reward, args.repeats)  # fmt: skip
    result["bigvocab"] = {"policy": "random, hidden 8, 2 layers, vocab 151,665", "batch": "8 prompts x 4",
                          "max_completion_length": 32, "steps": args.bigvocab_steps, "runs": runs}  # fmt: skip
    if all(runs.values()):
        result["bigvocab_wall_ratio"] = sum(r["wall_seconds"] for r in runs["tlt"]) / sum(
            r["wall_seconds"] for r in runs["grpo"]
        )
        print(f"bigvocab_wall_ratio {result['bigvocab_wall_ratio']:.3f}", flush=True)


def bench_bigvocab_trained(args, result: dict) -> None:
    path, extension = trained_bigvocab_policy()
    dataset = make_dataset(8 * args.bigvocab_steps, seed=12)
    runs = pair("bigvocab_trained", path, lambda out, tlt: grpo_config(out, args.bigvocab_steps, 8, 4, 32, 0, tlt), dataset,
                accuracy_reward, args.repeats)  # fmt: skip
    result["bigvocab_trained"] = {"policy": os.path.basename(path), **extension, "batch": "8 prompts x 4",
                                  "max_completion_length": 32, "steps": args.bigvocab_steps, "runs": runs}  # fmt: skip
    if not all(runs.values()):
        return
    grpo, tlt = median_steps(runs["grpo"], 5, 10), median_steps(runs["tlt"], 5, 10)
    result["bigvocab_trained_step_ratio"] = grpo / tlt
    result["bigvocab_trained_per_step_ratio"] = [
        statistics.median(g["step_seconds"][i] for g in runs["grpo"]) / statistics.median(t["step_seconds"][i] for t in runs["tlt"])
        for i in range(args.bigvocab_steps)
    ]  # fmt: skip
    print(f"bigvocab_trained_step_ratio {result['bigvocab_trained_step_ratio']:.3f}", flush=True)


class FreezeAndCompare(TrainerCallback):
    """Freezes a copy of the online head at `freeze_at` (and one at the start); at the end, the heads' acceptance
    length on held-out prompts (k=6 at every step, temperature 1, the trained policy)."""

    def __init__(self, trainer, prompts, freeze_at: int, max_new_tokens: int):
        self.trainer, self.prompts, self.freeze_at, self.frozen, self.result = trainer, prompts, freeze_at, None, {}
        self.max_new_tokens = max_new_tokens

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = self.trainer.tlt_drafter.model.frozen_copy()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.freeze_at:
            self.frozen = self.trainer.tlt_drafter.model.frozen_copy()

    def on_train_end(self, args, state, control, **kwargs):
        policy = self.trainer.accelerator.unwrap_model(self.trainer.model).eval()
        eos = self.trainer.processing_class.eos_token_id
        params = SamplingParams(temperature=1.0, max_new_tokens=self.max_new_tokens, eos_token_ids=(eos,))
        heads = {"adaptive": self.trainer.tlt_drafter.model, "frozen": self.frozen, "frozen_at_start": self.start}
        for name, head in heads.items():
            report = evaluate_acceptance(policy, Eagle3Drafter(head), self.prompts, params, k=6, seed=0)
            self.result[name] = report["mean_acceptance_length"]


def bench_drift(args, result: dict) -> None:
    policy_path = str(build_drift_policy()[0])
    tokenizer = AutoTokenizer.from_pretrained(policy_path)
    held_out = prompt_token_ids(tokenizer, make_dataset(32, seed=999)["prompt"])
    rewards = drift_rewards()
    dataset = make_dataset(
        8 * args.drift_steps, seed=2024 + args.seed
    )  # --seed 0: the prompts the defaults were tuned on
    probes = []

    def probe(trainer):
        probes.append(FreezeAndCompare(trainer, held_out, 10, 512))
        return probes[-1]

    def config_for(out, tlt):
        # the demo's and bench_e2e's layout: one prompt's group of 8 per micro-batch, 8 per optimizer step (and the
        # demo's learning rate until 2026-12-06: 1e-4 in its drift scenario since)
        return grpo_config(out, args.drift_steps, 8, 8, 512, args.seed, tlt, micro_batch=8, learning_rate=3e-5,
                           reward_weights=rewards["reward_weights"])  # fmt: skip

    runs = pair("drift", policy_path, config_for, dataset, rewards["reward_funcs"], 1, probe)
    result["drift"] = {"policy": os.path.basename(policy_path), "batch": "8 prompts x 8", "max_completion_length": 512,
                       "steps": args.drift_steps, "runs": runs, "acceptance_k6_end": probes[0].result,
                       "frozen_at_step": 10}  # fmt: skip
    print(f"drift TLT median step 1-10 {median_steps(runs['tlt'], 1, 10):.2f}s, 10-30 "
          f"{median_steps(runs['tlt'], 10, 30):.2f}s, acceptance at the end {probes[0].result}", flush=True)  # fmt: skip
    if not all(runs.values()):
        return
    result["default_step_ratio"] = median_steps(runs["grpo"], 10, 30) / median_steps(runs["tlt"], 10, 30)
    result["default_early_step_ratio"] = median_steps(runs["grpo"], 1, 10) / median_steps(runs["tlt"], 1, 10)
    result["default_adaptive_over_frozen"] = probes[0].result["adaptive"] / probes[0].result["frozen"]
    print({k: result[k] for k in ("default_step_ratio", "default_early_step_ratio", "default_adaptive_over_frozen")})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="bigvocab,bigvocab_trained,drift")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each trainer (big-vocabulary parts)")
    parser.add_argument("--bigvocab-steps", type=int, default=10)
    parser.add_argument("--drift-steps", type=int, default=30)
    parser.add_argument("--trainers", default="grpo,tlt", help="run only some: e.g. tlt, to sweep --tlt-args")
    parser.add_argument("--tlt-args", default="{}", help="TLTConfig fields (JSON) for the TLT runs; {} = defaults")
    parser.add_argument("--seed", type=int, default=0, help="the drift part's seed and prompts (0: those tuned on)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    TLT_ARGS.update(json.loads(args.tlt_args))
    TRAINERS[:] = args.trainers.split(",")
    torch.set_num_threads(os.cpu_count() or 1)
    result = {"benchmark": "plain_swap", "seeds": [args.seed], "tlt_args": TLT_ARGS}  # write_json adds where it ran
    parts = {"bigvocab": bench_bigvocab, "bigvocab_trained": bench_bigvocab_trained, "drift": bench_drift}
    for part in args.parts.split(","):
        parts[part](args, result)
        write_json(result, args.output)


if __name__ == "__main__":
    main()
