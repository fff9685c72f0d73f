"""What could lift a new head's acceptance on the real-regime policy (#52's `real_regime_acceptance_end`, 2.5 asked),
each lever measured on its own, on the tuned SmolLM2-135M of `bench_real_regime.py`:

- `schedules`: the online head training offline, as the swap feeds it: rollouts of 4 prompts x 4 arrive one by one
  (the policy's samples at T = 1 with the features its forward records), and after each the head trains on a window
  of the last 2 for the same drafter-step seconds (`--seconds-per-rollout`) in every variant: learning-rate schedules
  and tokens per step. Teacher-forced held-out acceptance (k = the head's TTT length, 4) every 6 rollouts.
- `temperature`: one head trained as `base` above, then its acceptance when the engine speculates k = 6 on held-out
  prompts at T = 1 with the drafts sampled from q at T = 1 (what the engine does), from a sharper q
  (0.7, 0.5), or greedy (a one-hot q): every variant is lossless, only how often the policy accepts changes.
- `arms`: TLTGRPOTrainer on the tuned policy as `bench_real_regime.py --parts swap` runs it (30 steps of 4 x 4,
  T = 1), with hybrid drafting on, and with a new head's full-share warm-up lasting `--warmup-phases` phases instead
  of 3: medians over steps 10-30 and the head's held-out acceptance at the end, to set beside that part's
  `real_regime_*` keys.

    pip install -e ".[real-model]"
    python scripts/bench/bench_head_levers.py --parts schedules temperature arms --output docs/benchmarks/head_levers_cpu.json
"""

import argparse
import copy
import dataclasses
import statistics
import time

from trl_tlt.tooling.benchmarks import run_parts  # first: the Hugging Face libraries offline


# isort: split


import torch  # noqa: E402
from bench_real_model import encode, run_trainer  # noqa: E402  (scripts/bench/, beside this script)
from bench_real_regime import forward_features, held_out_acceptance, new_head  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import trl_tlt.drafters.eagle3.drafter as eagle3_drafter  # noqa: E402
import trl_tlt.trainer.build as trainer_build  # noqa: E402
from trl_tlt.drafters.eagle3 import Eagle3Drafter  # noqa: E402
from trl_tlt.engine import SamplingParams, SpeculativeEngine  # noqa: E402
from trl_tlt.engine.sampling import sample_draft  # noqa: E402
from trl_tlt.tooling.real_model import real_model_prompts, real_regime_policy_path  # noqa: E402
from trl_tlt.tooling.workload import prompt_token_ids  # noqa: E402
from trl_tlt.training.distillation import DrafterSample  # noqa: E402
from trl_tlt.training.spot import DataBuffer, SpotSchedule, SpotTrainer  # noqa: E402
from trl_tlt.training.warm_start import evaluate_acceptance  # noqa: E402


GROUP = 16  # rows of one rollout: 4 prompts x 4
SCHEDULES = {  # name: (learning-rate schedule, tokens per step); `base` is what the trainer uses for a new head
    "base": (SpotSchedule(learning_rate=3e-5, cold_steps=600), 256),
    "cold_lr_1e-3": (SpotSchedule(learning_rate=3e-5, cold_steps=600, cold_learning_rate=1e-3), 256),
    "cold_lr_4e-3": (SpotSchedule(learning_rate=3e-5, cold_steps=600, cold_learning_rate=4e-3), 256),
    "cold_steps_1200": (SpotSchedule(learning_rate=3e-5, cold_steps=1200), 256),
    "constant_2e-3": (SpotSchedule(learning_rate=2e-3, cold_steps=0), 256),
    "tokens_512": (SpotSchedule(learning_rate=3e-5, cold_steps=300), 512),
    "tokens_1024": (SpotSchedule(learning_rate=3e-5, cold_steps=150), 1024),
}


DRAFTS = {1.0: "q_t10", 0.7: "q_t07", 0.5: "q_t05", 0.0: "greedy"}  # draft temperature over T: its key's name


class Setting:
    """The tuned policy, `rollouts` rollouts of 4 prompts x 4 at T = 1 with their features, and a held-out set."""

    def __init__(self, rollouts: int, max_new_tokens: int):
        path = real_regime_policy_path()
        self.policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.params = SamplingParams(
            temperature=1.0, max_new_tokens=max_new_tokens, eos_token_ids=(self.tokenizer.eos_token_id,)
        )
        start = time.perf_counter()
        self.prompts, self.completions = self.sample(4 * rollouts, seed=7)
        held_prompts, held_completions = self.sample(16, seed=4242)
        self.sampling_seconds = time.perf_counter() - start
        self.head = new_head(self.policy, self.completions[:GROUP])  # its vocabulary from the first rollout
        layers = SpotTrainer(self.head, DataBuffer(window=1)).feature_layers(self.policy)
        self.features = forward_features(self.policy, self.prompts, self.completions, layers)
        held_features = forward_features(self.policy, held_prompts, held_completions, layers)
        self.held = [
            DrafterSample(p + c, len(p), f, 0)
            for p, c, f in zip(held_prompts, held_completions, held_features, strict=True)
            if c
        ]
        self.rollouts = rollouts

    def sample(self, num_prompts: int, seed: int):
        rows = [r for r in real_model_prompts(num_prompts, seed=seed) for _ in range(4)]
        prompts = prompt_token_ids(self.tokenizer, [r["prompt"] for r in rows])
        out = SpeculativeEngine(self.policy).generate(
            prompts, self.params, generator=torch.Generator().manual_seed(seed)
        )
        return prompts, out.completion_ids

    def train(self, schedule: SpotSchedule, tokens_per_step: int, seconds_per_rollout: float, every: int = 6):
        """The head trained online-style: after each rollout, drafter steps until `seconds_per_rollout` x rollouts
        seen have been spent in them; the curve of (rollouts, steps, seconds, held-out acceptance)."""
        spot = SpotTrainer(
            copy.deepcopy(self.head), DataBuffer(window=2), schedule=schedule, tokens_per_step=tokens_per_step,
            seed=0, autocast_dtype=torch.bfloat16,
        )  # fmt: skip
        spent, curve = 0.0, []
        for r in range(self.rollouts):
            rows = slice(GROUP * r, GROUP * (r + 1))
            spot.observe_rollout(self.prompts[rows], self.completions[rows], self.features[rows], version=0)
            while spent < seconds_per_rollout * (r + 1):
                start = time.perf_counter()
                spot.step(self.policy)
                spent += time.perf_counter() - start
            if (r + 1) % every == 0 or r + 1 == self.rollouts:
                acceptance = held_out_acceptance(self.policy, spot.drafter, self.held)
                curve.append(
                    {"rollouts": r + 1, "steps": spot.total_steps, "seconds": spent, "acceptance": acceptance}
                )
        return spot, curve


def part_schedules(args) -> dict:
    setting = Setting(args.rollouts, args.max_new_tokens)
    runs = {}
    for name, (schedule, tokens) in SCHEDULES.items():
        runs[name] = setting.train(schedule, tokens, args.seconds_per_rollout)[1]
        print(name, [round(c["acceptance"], 3) for c in runs[name]], flush=True)
    return {
        "schedules": {
            "rollouts": args.rollouts,
            "train_tokens": sum(len(p) + len(c) for p, c in zip(setting.prompts, setting.completions, strict=True)),
            "held_out_completion_tokens": sum(len(s.token_ids) - s.prompt_length for s in setting.held),
            "seconds_per_rollout": args.seconds_per_rollout,
            "runs": runs,
        },
        **{f"schedule_acceptance_{name}": run[-1]["acceptance"] for name, run in runs.items()},
    }


def part_temperature(args) -> dict:
    setting = Setting(args.rollouts // 2, args.max_new_tokens)
    spot, curve = setting.train(*SCHEDULES["base"], seconds_per_rollout=2 * args.seconds_per_rollout)
    drafter = Eagle3Drafter(spot.drafter)
    held_out = encode(setting.tokenizer, real_model_prompts(args.eval_prompts, seed=99))
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=1.0, do_sample=True,
        eos_token_ids=(setting.tokenizer.eos_token_id,),
    )  # fmt: skip

    def drafting(scale: float):
        """The head's drafts from q at `scale` x the sampling temperature; 0: greedy, with a one-hot q."""

        def draft(logits, draft_params, generator):
            if scale == 0.0:
                tokens, probs = sample_draft(logits, dataclasses.replace(draft_params, do_sample=False), None)
                return tokens, torch.nn.functional.one_hot(tokens, probs.size(-1)).to(probs.dtype)
            scaled = dataclasses.replace(draft_params, temperature=draft_params.temperature * scale)
            return sample_draft(logits, scaled, generator)

        return draft

    results = {}
    try:
        for scale in DRAFTS:
            eagle3_drafter.sample_draft = drafting(scale)  # what the head's `propose` samples its drafts with
            lengths = [
                evaluate_acceptance(setting.policy, drafter, held_out, params, k=6, seed=seed)[
                    "mean_acceptance_length"
                ]
                for seed in (0, 1)
            ]
            results[DRAFTS[scale]] = statistics.fmean(lengths)
            print(scale, lengths, flush=True)
    finally:
        eagle3_drafter.sample_draft = sample_draft
    return {
        "temperature": {"head_steps": spot.total_steps, "head_curve": curve, "eval_prompts": args.eval_prompts},
        **{f"acceptance_{name}_k6": value for name, value in results.items()},
    }


def part_arms(args) -> dict:
    steps, path = argparse.Namespace(steps=args.swap_steps), real_regime_policy_path()
    runs = {"hybrid": run_trainer("tlt", steps, {"hybrid_drafting": True}, path=path, completion=args.max_new_tokens)}
    default = trainer_build.NEW_HEAD_WARMUP_PHASES
    trainer_build.NEW_HEAD_WARMUP_PHASES = args.warmup_phases  # read when the trainer builds its budget
    try:
        runs["long_warmup"] = run_trainer("tlt", steps, {}, path=path, completion=args.max_new_tokens)
    finally:
        trainer_build.NEW_HEAD_WARMUP_PHASES = default
    out = {"arms": {"steps": args.swap_steps, "prompts": 4, "warmup_phases": args.warmup_phases, "runs": runs}}
    for name, run in runs.items():
        out[f"{name}_step_seconds_median"] = statistics.median(run["step_seconds"][9:])
        out[f"{name}_rollout_seconds_median"] = statistics.median(run["rollout_seconds"][9:])
        out[f"{name}_rollout_tokens_per_second"] = statistics.fmean(run["rollout_tokens_per_second"][9:])
        out[f"{name}_acceptance_end"] = run["heldout_acceptance_k6"]["mean_acceptance_length"]
        out[f"{name}_drafter_steps"] = sum(run["drafter_steps"])
    return out


PARTS = {"schedules": part_schedules, "temperature": part_temperature, "arms": part_arms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--rollouts", type=int, default=24, help="schedules: rollouts of 4 x 4 (temperature: half).")
    parser.add_argument("--seconds-per-rollout", type=float, default=2.14, help="schedules: drafter-step seconds.")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--eval-prompts", type=int, default=64, help="temperature: held-out prompts, 2 seeds each.")
    parser.add_argument("--swap-steps", type=int, default=30, help="arms: GRPO steps per run.")
    parser.add_argument("--warmup-phases", type=int, default=17, help="arms: the long warm-up's full-share phases.")
    parser.add_argument("--output", default=None, help="JSON to write (its keys from other parts are kept).")
    args = parser.parse_args()
    torch.set_num_threads(2)
    run_parts("head_levers", PARTS, args.parts, args, args.output)


if __name__ == "__main__":
    main()
