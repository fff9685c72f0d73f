"""The `trl-tlt` command: `grpo`, `train-drafter`, `vllm-serve` and `accelerate-config`.

`trl-tlt grpo`: TRL's GRPO script with `TLTGRPOTrainer`, in TRL's style (dataclass arguments, YAML, `TrlParser`).
`trl-tlt train-drafter`: warm-start a drafter before RL (`trl_tlt.tooling.warm_start`; `trl-tlt train-drafter --help`).
`trl-tlt vllm-serve`: TRL's `trl vllm-serve`, speculating with the drafter a server-mode trainer trains and pushes
(`trl_tlt.tooling.serve`; docs/server.md).

    trl-tlt grpo --config recipe.yaml
    accelerate launch --config_file $(trl-tlt accelerate-config zero3) -m trl_tlt.tooling.cli grpo --config recipe.yaml

Arguments are those of `trl grpo` (`GRPOScriptArguments`, `ModelConfig`, `DatasetMixtureConfig`) with `TLTConfig`
in place of `GRPOConfig`. `dataset_name: embedded` trains on the embedded workload (`trl_tlt.tooling.workload`); any other
dataset needs a `prompt` column. `reward_funcs` takes TRL's built-ins, `workload_accuracy` (the embedded task's
reward), or a function by import path: `my_module:my_reward` or `my_module.my_reward`.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path


ACCELERATE_CONFIGS = Path(__file__).parent / "accelerate_configs"


def reward_functions(names: list[str] | None) -> list:
    from trl.rewards import (
        accuracy_reward,
        get_soft_overlong_punishment,
        reasoning_accuracy_reward,
        think_format_reward,
    )

    from .workload import accuracy_reward as workload_accuracy

    registry = {
        "accuracy_reward": accuracy_reward,
        "reasoning_accuracy_reward": reasoning_accuracy_reward,
        "think_format_reward": think_format_reward,
        "get_soft_overlong_punishment": get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256),
        "workload_accuracy": workload_accuracy,
    }
    if not names:
        raise ValueError(f"Pass at least one `reward_funcs`: one of {sorted(registry)} or `module:function`.")
    funcs = []
    for name in names:
        if name in registry:
            funcs.append(registry[name])
            continue
        module_name, sep, attr = name.partition(":") if ":" in name else name.rpartition(".")
        if not sep or not module_name or not attr:
            raise ValueError(f"Unknown reward function {name!r}: use one of {sorted(registry)} or `module:function`.")
        sys.path.insert(0, os.getcwd())
        try:
            funcs.append(getattr(importlib.import_module(module_name), attr))
        except (ImportError, AttributeError) as error:
            raise ValueError(f"Cannot load reward function {name!r}: {error}") from error
    return funcs


def train_dataset(script_args, dataset_args, training_args):
    from datasets import load_dataset
    from trl import get_dataset

    if script_args.dataset_name == "embedded":
        from .workload import make_dataset

        batch = training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps
        num_prompts = max(training_args.max_steps, 1) * batch // training_args.num_generations
        return make_dataset(max(num_prompts, 64), seed=training_args.seed)
    if dataset_args.datasets:
        dataset = get_dataset(dataset_args)
    elif script_args.dataset_name:
        dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
    else:
        raise ValueError("Pass `dataset_name` (a Hub dataset, a local path, or `embedded`) or `datasets`.")
    if script_args.dataset_train_split not in dataset:
        raise ValueError(
            f"Dataset {script_args.dataset_name!r} has no split {script_args.dataset_train_split!r} "
            f"(it has {list(dataset)}): set `dataset_train_split`."
        )
    split = dataset[script_args.dataset_train_split]
    if "prompt" not in split.column_names:
        raise ValueError(
            f"Dataset {script_args.dataset_name!r} has no `prompt` column (columns: {split.column_names}): "
            "rename the prompt column to `prompt` (e.g. `dataset.rename_column('question', 'prompt')`)."
        )
    return split


def grpo(argv: list[str] | None = None):
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser, get_peft_config
    from trl.scripts.grpo import GRPOScriptArguments

    from trl_tlt import TLTConfig, TLTGRPOTrainer

    parser = TrlParser((GRPOScriptArguments, TLTConfig, ModelConfig, DatasetMixtureConfig), prog="trl-tlt grpo")
    script_args, training_args, model_args, dataset_args = parser.parse_args_and_config(
        args=argv, fail_with_unknown_args=True
    )
    if not model_args.model_name_or_path:
        raise ValueError("Pass `model_name_or_path` (a Hub id or a local directory).")
    model_init_kwargs = {"revision": model_args.model_revision, "dtype": model_args.dtype}
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = model_init_kwargs
    trainer = TLTGRPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=reward_functions(script_args.reward_funcs),
        args=training_args,
        train_dataset=train_dataset(script_args, dataset_args, training_args),
        peft_config=get_peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    drafter = trainer.tlt.trainable_drafter
    if getattr(drafter, "exportable", True) is False:  # an EAGLE-3 head of a policy under 3 layers
        trainer.accelerator.print("The drafter cannot be exported for vLLM/SGLang; checkpoints hold it (drafter/).")
    elif drafter is not None:
        trainer.save_drafter(os.path.join(training_args.output_dir, "drafter"))
        trainer.accelerator.print(f"Drafter saved to {os.path.join(training_args.output_dir, 'drafter')}.")
    return trainer


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = (
        "usage: trl-tlt grpo [--config recipe.yaml] [ARGS] | trl-tlt train-drafter --policy P --output DIR [ARGS] "
        "| trl-tlt vllm-serve --model P [ARGS] | trl-tlt accelerate-config {"
        + ",".join(sorted(p.stem for p in ACCELERATE_CONFIGS.glob("*.yaml")))
        + "}"
    )
    if not argv or argv[0] in ("-h", "--help"):
        print(usage + "\n\n" + __doc__)
        return
    command, rest = argv[0], argv[1:]
    if command == "grpo":
        grpo(rest)
    elif command == "train-drafter":
        from .warm_start import main as train_drafter

        train_drafter(rest)
    elif command == "vllm-serve":
        from .serve import main as vllm_serve

        vllm_serve(rest)
    elif command == "accelerate-config":
        path = ACCELERATE_CONFIGS / f"{rest[0] if rest else ''}.yaml"
        if not rest or not path.exists():
            raise SystemExit(usage)
        print(path)
    else:
        raise SystemExit(f"Unknown command {command!r}.\n{usage}")


if __name__ == "__main__":
    main()
