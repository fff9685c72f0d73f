"""Helper of tests/test_trainer_spot.py (not a test): TLT GRPO with spot training on a tiny saved model.

python tests/_spot_run.py MODEL_DIR OUTPUT_DIR MAX_STEPS [SAVE_STEPS]    (also under torchrun)
"""

import hashlib
import json
import os
import sys


for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from trl_tlt import TLTConfig, TLTGRPOTrainer  # noqa: E402


PROMPTS = ["12+34=", "The quick", "1 2 3", "hello world"]


def reward_len(completions, **kwargs):
    return [float(len(c)) for c in completions]


def digest(tensors) -> str:
    """sha256 of the tensors' bytes, in order: equal digests, bit-identical weights."""
    h = hashlib.sha256()
    for tensor in tensors:
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def make_trainer(model_dir, output_dir, max_steps, save_steps=0, **overrides):
    torch.set_num_threads(1)
    settings = dict(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=12,
        max_steps=max_steps,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        seed=0,
        disable_tqdm=True,
        spot_training=True,
        spot_tokens_per_step=64,
        spot_cold_start_steps=0,  # the warm regime's learning rate (the cold start: test_spot.py)
        spot_steps_per_rollout=4,  # a fixed count: the tests count steps (the time budget: test_spot.py)
    )
    args = TLTConfig(**{**settings, **overrides})
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return TLTGRPOTrainer(
        model=model, reward_funcs=reward_len, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS * 50})
    )


def drop_in(model_dir, output_dir, max_steps, trainer_name):
    from trl import GRPOConfig, GRPOTrainer

    trainer_cls, config_cls = (GRPOTrainer, GRPOConfig) if trainer_name == "grpo" else (TLTGRPOTrainer, TLTConfig)
    seen = []

    def reward(completions, **kwargs):
        seen.extend(completions)
        return reward_len(completions)

    torch.set_num_threads(1)
    args = config_cls(
        output_dir=output_dir, use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=8,
        num_generations=4, max_completion_length=12, max_steps=max_steps, learning_rate=1e-2, logging_steps=1,
        save_strategy="no", seed=0, disable_tqdm=True, generation_kwargs={"do_sample": False},
    )  # fmt: skip
    trainer = trainer_cls(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 50}),
    )
    trainer.train()
    rank = trainer.accelerator.process_index
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)  # gathered (full) weights under FSDP
    report = {
        "completions": seen,
        "world_size": trainer.accelerator.num_processes,
        "distributed_type": trainer.accelerator.distributed_type.value,
        "weights_sha256": digest(state.values()),
    }
    from safetensors.torch import save_file

    save_file(
        {k: v.detach().cpu().contiguous() for k, v in state.items()},
        os.path.join(output_dir, f"{trainer_name}-{rank}.safetensors"),
    )
    with open(os.path.join(output_dir, f"{trainer_name}-{rank}.json"), "w") as f:
        json.dump(report, f)


def run_spot(model_dir, output_dir, max_steps, save_steps):
    trainer = make_trainer(model_dir, output_dir, max_steps, save_steps)
    if os.environ.get("STEP_FILE"):  # tell the test which step is done (it signals the run mid-training)
        from transformers import TrainerCallback

        class StepFile(TrainerCallback):  # "{rank}" in STEP_FILE: one file per rank; they also hold the pid
            def on_step_end(self, args, state, control, **kwargs):
                with open(os.environ["STEP_FILE"].format(rank=args.process_index), "w") as f:
                    f.write(f"{state.global_step} {os.getpid()}")

        trainer.add_callback(StepFile())
    trainer.train()
    rank = trainer.accelerator.process_index
    report = {
        "rank": rank,
        "world_size": trainer.accelerator.num_processes,
        "drafter_sha256": digest(trainer.tlt_spot.params),
        "total_steps": trainer.tlt_spot.total_steps,
        "global_step": trainer.state.global_step,
        "logs": [{k: v for k, v in h.items() if k.startswith("tlt/")} for h in trainer.state.log_history],
    }
    with open(os.path.join(output_dir, f"report-{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    model_dir, output_dir, max_steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if os.environ.get("TRAINER"):
        drop_in(model_dir, output_dir, max_steps, os.environ["TRAINER"])
    else:
        run_spot(model_dir, output_dir, max_steps, int(sys.argv[4]) if len(sys.argv) > 4 else 0)
    # Tear the process groups down, then leave without interpreter shutdown: left to it, gloo's threads can race it and
    # abort the process ("terminate called without an active exception", seen about once in 30 launches here) after
    # all the results above were written.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
