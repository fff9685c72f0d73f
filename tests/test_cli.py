"""`trl-tlt grpo`: TRL-style CLI (YAML config, TrlParser) around TLTGRPOTrainer."""

import json
from pathlib import Path

import pytest
import yaml

from trl_tlt.tooling import cli


REWARD_MODULE = """
def short(completions, **kwargs):
    return [-float(len(str(c))) for c in completions]
"""


def test_yaml_recipe_trains_and_saves_policy_and_drafter(tiny_model_dirs, tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(REWARD_MODULE)
    monkeypatch.chdir(tmp_path)  # `module:function` rewards import from the working directory, as in TRL
    recipe = {
        "model_name_or_path": tiny_model_dirs["qwen2"],
        "dataset_name": "embedded",
        "reward_funcs": ["workload_accuracy", "my_rewards:short"],
        "output_dir": str(tmp_path / "out"),
        "use_cpu": True,
        "bf16": False,
        "report_to": "none",
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "max_completion_length": 8,
        "max_steps": 1,
        "save_strategy": "no",
        "drafter_type": "eagle3",
        "spot_training": True,
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    trainer = cli.grpo(["--config", str(tmp_path / "recipe.yaml"), "--learning_rate", "1e-3"])
    assert trainer.state.global_step == 1 and trainer.args.learning_rate == 1e-3  # the command line overrides YAML
    assert [f.__name__ for f in trainer.reward_funcs] == ["accuracy_reward", "short"]
    assert (tmp_path / "out" / "config.json").exists() and (tmp_path / "out" / "drafter" / "config.json").exists()


def test_reward_function_errors_name_the_choices():
    with pytest.raises(ValueError, match="workload_accuracy"):
        cli.reward_functions(["no_such_reward"])
    with pytest.raises(ValueError, match="Cannot load reward function 'json:nope'"):
        cli.reward_functions(["json:nope"])
    assert cli.reward_functions(["json.dumps"]) == [json.dumps]


def test_dataset_without_prompt_column_is_refused(tiny_model_dirs, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text('{"question": "1+1?"}\n{"question": "2+2?"}\n')
    with pytest.raises(ValueError, match="no `prompt` column .*question"):
        cli.grpo(
            ["--model_name_or_path", tiny_model_dirs["qwen2"], "--dataset_name", str(data), "--reward_funcs",
             "workload_accuracy", "--output_dir", str(tmp_path / "out"), "--use_cpu", "--report_to", "none"]
        )  # fmt: skip


def test_accelerate_configs_ship_with_the_package(capsys):
    for name in ("single_gpu", "multi_gpu", "zero2", "zero3", "fsdp2"):
        cli.main(["accelerate-config", name])
        path = capsys.readouterr().out.strip()
        config = yaml.safe_load(open(path))
        assert config["distributed_type"] in ("NO", "MULTI_GPU", "DEEPSPEED", "FSDP")
    with pytest.raises(SystemExit):
        cli.main(["accelerate-config", "zero9"])


def run_train_drafter(policy: str, tmp_path, capsys, learning_rate: str = "2e-3") -> tuple[dict, str, Path]:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}="}) + "\n" for a in range(12) for b in range(3)))
    out = tmp_path / "drafter"
    cli.main(
        ["train-drafter", "--policy", policy, "--output", str(out), "--dataset", str(data), "--num-prompts", "32",
         "--eval-prompts", "4", "--epochs", "3", "--max-new-tokens", "8", "--learning-rate", learning_rate]
    )  # fmt: skip
    return json.loads((out / "train_report.json").read_text()), capsys.readouterr().out, out


def trained(report: dict) -> bool:
    """The head learned: its distillation loss fell by a fifth from the first drafter step to the last ones."""
    return report["final"]["loss"] < 0.8 * report["first"]["loss"]


def test_train_drafter_subcommand_warm_starts_a_head_the_trainer_loads(tiny_model_dirs, tmp_path, capsys):
    """`trl-tlt train-drafter`: the policy completes a dataset's prompts, the head trains, the acceptance before and
    after is reported, and the output loads as `TLTConfig(drafter_model_name_or_path=...)`."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from trl_tlt import TLTConfig, TLTGRPOTrainer
    from trl_tlt.drafters.eagle3 import Eagle3Model

    report, printed, out = run_train_drafter(tiny_model_dirs["qwen2"], tmp_path, capsys)
    assert report["num_samples"] == 32 and "acceptance length at k=4" in printed
    assert {"before", "after"} <= set(report) and (out / "model.safetensors").is_file()
    assert trained(report), (report["first"], report["final"])
    args = TLTConfig(
        output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, report_to="none", num_generations=4,
        per_device_train_batch_size=8, max_completion_length=8, drafter_model_name_or_path=str(out),
    )  # fmt: skip
    trainer = TLTGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen2"]),
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["1+2="] * 8}),
    )
    saved = Eagle3Model.from_pretrained(out, trainer.model)
    assert torch.equal(trainer.tlt_drafter.model.fc.weight, saved.fc.weight)
    assert trainer.tlt_spot.schedule.cold_steps == 0  # a warm-started head starts in the warm regime
    with pytest.raises(SystemExit):
        cli.main(
            ["train-drafter", "--policy", tiny_model_dirs["qwen2"], "--output", str(out), "--drafter-type", "model"]
        )


def test_the_train_drafter_check_fails_when_the_head_does_not_learn(tiny_model_dirs, tmp_path, capsys):
    """Negative control of `trained`: at learning rate 0 the loss does not fall."""
    report, _, _ = run_train_drafter(tiny_model_dirs["qwen2"], tmp_path, capsys, learning_rate="0")
    assert not trained(report)


def test_vllm_serve_builds_trl_s_command_with_the_drafter_and_the_transfer(tmp_path):
    """`trl-tlt vllm-serve`: TRL's `vllm serve` command line, run through vLLM's API server module, with the EAGLE-3
    drafter's speculative config, the weight-transfer backend and the read-back extension; a user's own extension is
    refused by name (it would silently replace the one the push needs)."""
    from trl.scripts.vllm_serve import ScriptArguments

    from trl_tlt.tooling.serve import ServeArguments, build_command

    serve = ServeArguments(drafter=str(tmp_path), num_speculative_tokens=4, weight_transfer_backend="tlt_shm")
    command = build_command(ScriptArguments(model="policy"), serve, ["--seed", "0"])
    assert command[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "policy"]
    assert json.loads(command[command.index("--speculative-config") + 1]) == {
        "method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 4, "draft_sample_method": "probabilistic",
        "num_speculative_tokens_per_batch_size": [[1, 32, 4], [33, 1 << 20, 0]],  # TLT's threshold, as in colocate
    }  # fmt: skip
    assert json.loads(command[command.index("--weight-transfer-config") + 1]) == {"backend": "tlt_shm"}
    assert command[-4:] == ["--seed", "0", "--worker-extension-cls", "trl_tlt.vllm.transfer.TLTWorkerExtension"]
    with pytest.raises(ValueError, match="worker-extension-cls"):
        build_command(ScriptArguments(model="policy"), serve, ["--worker-extension-cls", "mine.Extension"])
