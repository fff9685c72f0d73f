"""Two processes under `accelerate launch` (gloo on CPU, as on a user's machine without a GPU): every drafter type, a real
vocabulary's size, ranks whose rollouts end at different times, tools where ranks take different numbers of turns, a
killed and resumed run. Each case holds: the run finishes; every rank ends with the same policy and the same drafter;
greedy completions equal GRPOTrainer's under the same launch; a resumed run equals the uninterrupted one.

Slow (about 5 minutes on 2 cores): run by CI's second stage (`make test-slow`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from testing_utils import TOOL_CALL, assert_same_training, tool_calling_policy

from trl_tlt.tooling.cli import ACCELERATE_CONFIGS
from trl_tlt.tooling.tiny import build_tiny_model, extend_vocabulary


pytestmark = pytest.mark.slow

HELPER = str(Path(__file__).with_name("_matrix_run.py"))
PROMPTS = ["12+34=", "The quick", "1 2 3", "hello world"]
QWEN25_VOCAB_SIZE = 151_665
GREEDY = {"generation_kwargs": {"do_sample": False}}
_ports = iter(range(29600, 29700))


def launch(tmp_path: Path, tag: str, **spec) -> list[dict]:
    """One 2-process `accelerate launch` of tests/_matrix_run.py; returns each rank's report."""
    spec = {"trainer": "tlt", "output_dir": str(tmp_path), "tag": tag, "prompts": PROMPTS * 4, **spec}
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"{tag}.json"
    path.write_text(json.dumps(spec))
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CONFIGS / "multi_gpu.yaml"),
        "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(next(_ports)), HELPER, str(path),
    ]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert result.returncode == 0, result.stderr[-4000:]
    if spec.get("kill_after") is not None:
        return []
    return [json.loads((tmp_path / f"{tag}-rank{rank}.json").read_text()) for rank in (0, 1)]


def assert_ranks_agree(reports: list[dict]) -> None:
    first, second = reports
    assert first["world_size"] == second["world_size"] == 2
    assert first["global_step"] == second["global_step"] > 0
    assert first["policy_sha256"] == second["policy_sha256"]  # data parallel: bit-identical
    assert first["drafter_sha256"] == second["drafter_sha256"]  # merged after every rollout


@pytest.fixture(scope="module")
def bigvocab_dir(tokenizer, tmp_path_factory) -> str:
    """A random policy with Qwen2.5's vocabulary size (TRL's tiny Qwen2.5 shape): the default EAGLE-3 head fits its draft
    vocabulary to the tokens the policy emits."""
    path = tmp_path_factory.mktemp("bigvocab")
    big = extend_vocabulary(tokenizer, QWEN25_VOCAB_SIZE)
    build_tiny_model(big, hidden_size=32, num_hidden_layers=3, num_attention_heads=2).save_pretrained(path)
    big.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def lora_drafter_dir(tiny_model_dirs, tmp_path_factory) -> str:
    """A LoRA (peft) drafter LM: adapters on the tiny Llama, which reads the policy's tokens."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("lora-drafter")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"])
    get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(path)
    return str(path)


def test_every_default_on_a_real_vocabulary(bigvocab_dir, tmp_path):
    """The set-up that aborted both ranks at step 2 (SIGABRT in the drafter merge): 2 processes, every default
    (sampled), a 151,665-token policy, rank 1's rollouts ending later than rank 0's. Both ranks finish 4 steps with the
    same policy and the same drafter, whose draft vocabulary was fitted to the policy's tokens."""
    reports = launch(tmp_path, "defaults", model_dir=bigvocab_dir, slow_rank=1, slow_seconds=2.0)
    assert_ranks_agree(reports)
    assert reports[0]["global_step"] == 4
    assert reports[0]["draft_vocab_size"] == reports[1]["draft_vocab_size"] < 32_768  # fitted
    assert reports[0]["drafter_steps"] > 0  # rank 0 trained the drafter while rank 1 still generated


@pytest.mark.parametrize("drafter", ["eagle3-bigvocab", "model", "lora", "ngram", "hybrid"])
def test_greedy_completions_equal_grpo_trainers(drafter, tiny_model_dirs, bigvocab_dir, lora_drafter_dir, tmp_path):
    """Each drafter type, greedy, rank 1 slower than rank 0: the ranks end with the same policy and drafter, and each
    rank's completions and the trained policy are GRPOTrainer's under the same launch."""
    model_dir = bigvocab_dir if drafter == "eagle3-bigvocab" else tiny_model_dirs["qwen2"]
    config = {
        "eagle3-bigvocab": {},
        "model": {"drafter_type": "model", "drafter_model_name_or_path": tiny_model_dirs["llama"]},
        "lora": {"drafter_type": "model", "drafter_model_name_or_path": lora_drafter_dir},
        "ngram": {"drafter_type": "ngram"},
        "hybrid": {"hybrid_drafting": True},
    }[drafter]
    config |= {"speculative_selector": "fixed", "num_speculative_tokens": 3}
    grpo = launch(tmp_path, "grpo", trainer="grpo", model_dir=model_dir, config=GREEDY)
    tlt = launch(tmp_path, "tlt", model_dir=model_dir, config=GREEDY | config, slow_rank=1)
    assert_ranks_agree(tlt)
    assert_same_training(tlt, grpo, tmp_path, "tlt", "grpo")
    if drafter != "ngram":
        assert tlt[0]["drafter_steps"] > 0


def test_tools_with_different_turns_per_rank(tool_policy_dir, tmp_path):
    """Tools, greedy: rank 0's prompts make the policy call a tool (two generation turns), rank 1's do not (one). Drafter
    training and the prompt history happen once per rollout, so the ranks' collectives pair up: the run finishes, the
    ranks agree, and the completions are GRPOTrainer's."""
    prompts = [TOOL_PROMPT, PLAIN_PROMPT] * 8
    config = GREEDY | {"max_completion_length": 160, "max_tool_calling_iterations": 2, "hybrid_drafting": True}
    config["ddp_timeout"] = 60  # a rank left waiting for the other fails within a minute
    spec = {"model_dir": tool_policy_dir, "tools": True, "prompts": prompts, "config": config}
    grpo = launch(tmp_path, "grpo", trainer="grpo", **spec)
    tlt = launch(tmp_path, "tlt", **spec)
    assert_ranks_agree(tlt)
    assert_same_training(tlt, grpo, tmp_path, "tlt", "grpo")
    calls = [report["tool_calls"] for report in tlt]
    assert calls[0] == calls[1] and any(0 < c < 1 for c in calls[0])  # a step where one rank called the tool


def test_a_killed_run_resumes_as_the_uninterrupted_one(tiny_model_dirs, tmp_path):
    """Sampled rollouts, spot training with exact step counts, the bandit's modelled costs, hybrid drafting: a run killed
    after its step-2 checkpoint and resumed from it samples steps 3-4 as the uninterrupted run did (every rank's
    generator, bandit, prompt history and drafter state are in the checkpoint) and ends with the same policy and
    drafter."""
    config = {
        "spot_training": True, "spot_steps_per_rollout": 2, "spot_tokens_per_step": 64,
        "selector_deterministic": True, "hybrid_drafting": True, "save_strategy": "steps", "save_steps": 2,
    }  # fmt: skip
    spec = {"model_dir": tiny_model_dirs["qwen2"], "config": config, "slow_rank": 1}
    full = launch(tmp_path / "full", "full", **spec)
    launch(tmp_path / "killed", "killed", kill_after=2, **spec)
    checkpoint = tmp_path / "killed" / "checkpoint-2"
    assert sorted(p.name for p in (checkpoint / "tlt_state").iterdir()) == ["rank0.pt", "rank1.pt"]
    resumed = launch(tmp_path / "killed", "resumed", resume=str(checkpoint), **spec)
    assert_ranks_agree(full)
    assert_ranks_agree(resumed)
    for rank in (0, 1):
        assert resumed[rank]["completions"] == full[rank]["completions"][2:]
        assert resumed[rank]["policy_sha256"] == full[rank]["policy_sha256"]
        assert resumed[rank]["drafter_sha256"] == full[rank]["drafter_sha256"]


TOOL_PROMPT, PLAIN_PROMPT = "Multiply 3 by 4.", "Say hi."


@pytest.fixture(scope="module")
def tool_policy_dir(tokenizer, tmp_path_factory) -> str:
    """A tiny policy taught (greedy) to call `multiply_tool` on TOOL_PROMPT and to answer PLAIN_PROMPT at once."""
    model, tool_tokenizer = tool_calling_policy(tokenizer, {TOOL_PROMPT: TOOL_CALL, PLAIN_PROMPT: "hi<|im_end|>"})
    path = tmp_path_factory.mktemp("tool-policy")
    model.save_pretrained(path)
    tool_tokenizer.save_pretrained(path)
    return str(path)
