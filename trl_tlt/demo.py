"""The main job (`make demo`): GRPO with TLTGRPOTrainer on the embedded workload, built offline.

Builds (or reuses from the cache) the embedded SFT policy of `trl_tlt.workload` and its warm-start EAGLE-3
drafter, then runs a short GRPO run with `TLTGRPOTrainer` (EAGLE-3 drafter, bandit selector), prints a per-step
table (reward, rollout seconds, acceptance length, speculated fraction), exports the drafter and prints how to
serve it with vLLM. Nothing is downloaded.

    python -m trl_tlt.demo [--steps 10] [--output-dir DIR]
"""

import argparse
import os
import tempfile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10, help="GRPO steps (8 prompts x 8 samples each).")
    parser.add_argument("--output-dir", default=None, help="Where to write the run (default: a temporary folder).")
    parser.add_argument(
        "--cache-dir", default=None, help="Policy cache (default: $TRL_TLT_CACHE or ~/.cache/trl_tlt)."
    )
    args = parser.parse_args()
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")

    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    from trl_tlt import TLTConfig, TLTGRPOTrainer
    from trl_tlt.workload import accuracy_reward, build_eagle3_drafter, build_policy, make_dataset

    policy_path = build_policy(cache_dir=args.cache_dir)
    drafter_path = build_eagle3_drafter(cache_dir=args.cache_dir)
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="trl-tlt-demo-")
    config = TLTConfig(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        per_device_train_batch_size=8,  # one prompt's group per micro-batch,
        gradient_accumulation_steps=8,  # 8 groups (64 samples) per optimizer step and per rollout
        num_generations=8,
        max_completion_length=512,
        max_steps=args.steps,
        learning_rate=5e-5,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        drafter_type="eagle3",
        drafter_model_name_or_path=str(drafter_path),
    )

    columns = ("step", "reward", "rollout s", "step s", "accept len", "spec frac", "active bs")

    class Table(TrainerCallback):
        def on_train_begin(self, *a, **k):
            print("".join(f"{c:>12}" for c in columns), flush=True)

        def on_log(self, _args, state, _control, logs=None, **kwargs):
            if logs and "reward" in logs:
                values = (
                    state.global_step,
                    logs["reward"],
                    logs["tlt/rollout_seconds"],
                    logs["step_time"],
                    logs["tlt/mean_acceptance_length"],
                    logs["tlt/spec_step_fraction"],
                    logs["tlt/mean_active_batch_size"],
                )
                print("".join(f"{v:>12.3f}" if isinstance(v, float) else f"{v:>12}" for v in values), flush=True)

    trainer = TLTGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(policy_path),
        reward_funcs=accuracy_reward,
        args=config,
        train_dataset=make_dataset(8 * args.steps, seed=2024),
        processing_class=AutoTokenizer.from_pretrained(policy_path, padding_side="left"),
        callbacks=[Table()],
    )
    trainer.remove_callback(PrinterCallback)  # the table above replaces the raw log dicts
    trainer.train()
    export = os.path.join(output_dir, "drafter")
    trainer.save_drafter(export)
    print(f"demo finished: {trainer.state.global_step} GRPO steps with TLT; run in {output_dir}")
    print(
        "serve the policy with its drafter in vLLM:\n"
        f'  LLM(model="{policy_path}", speculative_config={{"method": "eagle3", "model": "{export}", '
        f'"num_speculative_tokens": {config.num_speculative_tokens}}})'
    )


if __name__ == "__main__":
    main()
