"""Helper of tests/test_fidelity_stats.py (not a test): how GRPOTrainer's and TLTGRPOTrainer's rollouts end, on a
random large-vocabulary model, in a fresh process and again after other trainers have run in it.

python tests/_eos_rates.py MODEL_DIR DRAFTER_DIR WORK_DIR fresh|after_other_trainers RESULT_JSON

`fresh` measures GRPOTrainer (and a negative control) and TLTGRPOTrainer with each drafter type; `after_other_trainers`
first trains and fails other trainers in the process, then measures TLTGRPOTrainer. Each measured trainer generates ROUNDS rollouts of 16 completions through TRL's own rollout method (`_generate`,
the path of every training step up to scoring) with sampling at temperature 1; the result holds, per trainer, the
number of completions ending in EOS, ending in the pad token, and truncated (neither: TRL's rule), and the tokens.
"""

import json
import os
import sys


for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from trl_tlt import TLTConfig, TLTGRPOTrainer  # noqa: E402


ROUNDS = 12
PROMPTS = ["12+34=", "The quick", "1 2 3", "hello world", "Solve", "####", "7 8", "lazy dog"]
DRAFTERS = {
    "eagle3": {},
    "model": {"drafter_type": "model"},  # drafter_model_name_or_path: the second random model (argv)
    "ngram": {"drafter_type": "ngram"},
    "none": {"drafter_type": "none"},
}


def reward_len(completions, **kwargs):
    return [float(len(c)) for c in completions]


def build(trainer_cls, config_cls, model_dir, work_dir, **extra):
    args = config_cls(
        output_dir=work_dir,
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=16,
        save_strategy="no",
        seed=0,
        **{"learning_rate": 0.0, **extra},
    )
    return trainer_cls(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=reward_len,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}),
        processing_class=PreTrainedTokenizerFast.from_pretrained(model_dir, padding_side="left"),
    )


def measure(trainer) -> dict:
    tokenizer = trainer.processing_class
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    trainer.model.train()  # rollouts of a training step
    counts = {"eos": 0, "pad": 0, "truncated": 0, "tokens": 0}
    for r in range(ROUNDS):
        prompts = [p for p in PROMPTS[r % 2 :: 2] for _ in range(4)]  # 4 prompts x 4 generations
        completion_ids = trainer._generate(prompts)[1]
        for ids in completion_ids:
            counts["tokens"] += len(ids)
            key = "eos" if ids[-1] == eos else "pad" if ids[-1] == pad else "truncated"
            counts[key] += 1
    return counts


def measure_tlt(model_dir, drafter_dir, work_dir) -> dict:
    out = {}
    for name, extra in DRAFTERS.items():
        if name == "model":
            extra = {**extra, "drafter_model_name_or_path": drafter_dir}
        # the default configuration's bandit, rewarded by modelled cost so that the test is deterministic; no spot
        # training: it changes the drafter (tested elsewhere), not the sampler, and a 151,665-token head is slow on CPU
        trainer = build(
            TLTGRPOTrainer, TLTConfig, model_dir, work_dir, selector_deterministic=True, spot_training=False, **extra
        )
        out[f"tlt_{name}"] = measure(trainer)
    return out


def run_other_trainers(model_dir, work_dir) -> None:
    """What a notebook or a test suite does before: train both trainers, and have one fail at construction."""
    build(GRPOTrainer, GRPOConfig, model_dir, work_dir, max_steps=2, learning_rate=1e-3).train()
    # spot training on (the default) but short: one drafter step per rollout, no cold start
    spot = {"spot_cold_start_steps": 0, "spot_steps_per_rollout": 1}
    build(TLTGRPOTrainer, TLTConfig, model_dir, work_dir, max_steps=2, learning_rate=1e-3, **spot).train()
    try:
        build(TLTGRPOTrainer, TLTConfig, model_dir, work_dir, generation_kwargs={"num_beams": 2})
    except ValueError:
        pass


if __name__ == "__main__":
    model_dir, drafter_dir, work_dir, phase, result = sys.argv[1:6]
    out = {}
    if phase == "fresh":
        out["grpo"] = measure(build(GRPOTrainer, GRPOConfig, model_dir, work_dir))
        # negative control: another sampler must be told apart (temperature 0.8 sharpens the EOS / pad logits)
        out["grpo_temperature_0.8"] = measure(build(GRPOTrainer, GRPOConfig, model_dir, work_dir, temperature=0.8))
    else:
        run_other_trainers(model_dir, work_dir)
    out.update(measure_tlt(model_dir, drafter_dir, work_dir))
    with open(result, "w") as f:
        json.dump(out, f, indent=1)
