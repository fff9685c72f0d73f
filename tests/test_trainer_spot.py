"""TLTGRPOTrainer with spot training: metrics, the drafter learning, checkpoints after a kill, 2 processes."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from trl_tlt.trainer import DRAFTER_DIR, ROLLOUT_STATE_NAME


HELPER = str(Path(__file__).with_name("_spot_run.py"))
sys.path.insert(0, str(Path(__file__).parent))

from _spot_run import make_trainer  # noqa: E402


def test_single_process_trains_the_drafter_between_rollouts(tiny_model_dirs, tmp_path):
    trainer = make_trainer(tiny_model_dirs["qwen2"], str(tmp_path), max_steps=3)
    start = [p.detach().clone() for p in trainer.tlt_spot.params]
    trainer.train()
    logs = [h for h in trainer.state.log_history if "tlt/drafter_steps" in h]
    assert len(logs) == 3
    for h in logs:
        assert h["tlt/drafter_steps"] == trainer.args.spot_steps_per_rollout
        assert h["tlt/spot_seconds"] > 0 and h["tlt/idle_seconds"] == 0 and h["tlt/idle_seconds_used"] == 0
        assert h["tlt/drafter_loss"] > 0
    assert trainer.tlt_spot.total_steps == 3 * trainer.args.spot_steps_per_rollout
    assert any(not torch.equal(a, b) for a, b in zip(start, trainer.tlt_spot.params, strict=True))
    # the engine drafts with the trained parameters (same objects)
    assert trainer.tlt_drafter.model is trainer.tlt_spot.drafter
    # every drafter step read the features the rollouts recorded: none ran the policy
    assert all(h["tlt/drafter_rerun_samples"] == 0 for h in logs) and trainer.tlt_spot.rerun_samples == 0
    buffered = trainer.tlt_spot.buffer.samples
    assert buffered and all(s.features is not None for s in buffered)
    assert {s.version for s in buffered} == {
        1,
        2,
    }  # the window's rollouts: the latest and the previous (one-step offset)


def test_the_training_step_s_forward_feeds_the_drafter(tiny_model_dirs, tmp_path):
    """`spot_feature_source="training_step"`: the engine records nothing; hooks on the loss forward record every
    completion's states, which equal a forward of the policy over the sequence (learning rate 0: the policy the step
    saw); the drafter trains on them beside each step, never running the policy; the previous rollout's sequences
    stay in the buffer (one update old). Mutations: states kept attached to the loss's graph (`record` without
    `detach`: the buffer holds tensors that require grad), or the phase skipped when nothing was recorded (the budget
    never counts its skips)."""
    trainer = make_trainer(
        tiny_model_dirs["qwen2"], str(tmp_path), max_steps=3, spot_feature_source="training_step", learning_rate=0.0
    )
    recorded_by_engine = []
    generate = trainer.tlt.generate

    def recording_generate(*args, **kwargs):
        out = generate(*args, **kwargs)
        recorded_by_engine.append(out.features)
        return out

    trainer.tlt.generate = recording_generate
    trainer.train()
    assert recorded_by_engine and all(features is None for features in recorded_by_engine)
    logs = [h for h in trainer.state.log_history if "tlt/drafter_steps" in h]
    assert [h["tlt/drafter_steps"] for h in logs] == [4, 4, 4] and trainer.tlt_spot.rerun_samples == 0
    buffered = trainer.tlt_spot.buffer.samples
    assert {s.version for s in buffered} == {1, 2}  # the window's two rollouts
    assert all(s.features is not None and not s.features.requires_grad for s in buffered)
    from trl_tlt.training.distillation import policy_features

    policy = trainer.accelerator.unwrap_model(trainer.model).eval()
    layers = trainer.tlt_spot.feature_layers(policy)
    for sample in buffered[:4]:
        expected = policy_features(policy, [sample], layers[:-1])[0]
        states = sample.features  # (n - 1, m, H): the auxiliary layers, then the final norm's output
        torch.testing.assert_close(states[:, -1], expected.last[:-1], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(states[:, :-1].flatten(1), expected.aux[:-1], rtol=1e-4, atol=1e-5)


def test_killed_run_resumes_with_policy_and_drafter_intact(tiny_model_dirs, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, HELPER, tiny_model_dirs["qwen2"], str(out), "500", "2"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.time() + 240
        while not (out / "checkpoint-4" / DRAFTER_DIR).is_dir():
            assert proc.poll() is None and time.time() < deadline, "training stopped before checkpoint-4"
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert_resumes_intact(last_complete_checkpoint(out), tiny_model_dirs["qwen2"], tmp_path / "resumed")


def last_complete_checkpoint(out):
    complete = sorted(
        (p for p in out.glob("checkpoint-*") if (p / DRAFTER_DIR).is_dir() and (p / "trainer_state.json").is_file()),
        key=lambda p: int(p.name.split("-")[1]),
    )
    return complete[-1]


def assert_resumes_intact(checkpoint, model_dir, output_dir):
    """Resuming from `checkpoint` restores the policy, the drafter and spot training's state exactly."""
    step = int(checkpoint.name.split("-")[1])
    assert not list(checkpoint.glob("*.tmp"))  # the drafter is renamed into place only once fully written

    seen = {}

    class Snapshot(TrainerCallback):  # after the checkpoint is loaded, before any new step
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            seen["policy"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            seen["drafter"] = {k: v.clone() for k, v in trainer.tlt_drafter.model.export_state_dict().items()}
            seen["spot_steps"] = trainer.tlt_spot.total_steps
            seen["global_step"] = state.global_step

    trainer = make_trainer(model_dir, str(output_dir), max_steps=step + 1)
    trainer.add_callback(Snapshot())
    trainer.train(resume_from_checkpoint=str(checkpoint))
    assert seen["global_step"] == step
    for name, tensor in load_file(str(checkpoint / "model.safetensors")).items():
        assert torch.equal(seen["policy"][name], tensor), name
    for name, tensor in load_file(str(checkpoint / DRAFTER_DIR / "model.safetensors")).items():
        assert torch.equal(seen["drafter"][name], tensor), name
    spot_state = torch.load(checkpoint / ROLLOUT_STATE_NAME.format(rank=0), weights_only=True)["spot"]
    assert seen["spot_steps"] == spot_state["total_steps"] == step * trainer.args.spot_steps_per_rollout
    assert trainer.state.global_step == step + 1


def wait_for_first_step(proc: subprocess.Popen, step_file: Path, timeout: float = 240) -> int:
    """Wait until the helper run by `proc` has finished a step (its STEP_FILE holds "step pid"); returns the pid."""
    deadline = time.time() + timeout
    while True:
        fields = step_file.read_text().split() if step_file.is_file() else []
        if len(fields) == 2 and int(fields[0]) >= 1:
            return int(fields[1])
        assert proc.poll() is None and time.time() < deadline, "training stopped before its first step"
        time.sleep(0.05)


def test_sigterm_stops_at_the_end_of_the_step_with_a_checkpoint(tiny_model_dirs, tmp_path):
    """A preempted job (SIGTERM mid-run, no periodic saves): the step finishes, policy and drafter are checkpointed,
    the process exits cleanly, and the checkpoint resumes intact."""
    out, step_file = tmp_path / "run", tmp_path / "step"
    proc = subprocess.Popen(
        [sys.executable, HELPER, tiny_model_dirs["qwen2"], str(out), "500"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1", "STEP_FILE": str(step_file)},
    )
    wait_for_first_step(proc, step_file)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr.decode()[-2000:]
    assert "SIGTERM: training stops after step" in stderr.decode()
    checkpoint = last_complete_checkpoint(out)
    assert 1 <= int(checkpoint.name.split("-")[1]) < 500
    assert_resumes_intact(checkpoint, tiny_model_dirs["qwen2"], tmp_path / "resumed")


@pytest.mark.slow
def test_sigterm_to_one_of_two_ranks_stops_both_at_the_same_step(tiny_model_dirs, tmp_path):
    """Under torchrun, SIGTERM to rank 1 alone: both ranks finish the same step, one checkpoint is written, both exit 0."""
    out, step_file = tmp_path / "run", tmp_path / "step-{rank}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29534"]
    proc = subprocess.Popen(
        [*cmd, HELPER, tiny_model_dirs["qwen2"], str(out), "500"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1", "STEP_FILE": str(step_file)},
    )
    os.kill(wait_for_first_step(proc, tmp_path / "step-1"), signal.SIGTERM)
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr.decode()[-3000:]
    reports = [json.loads((out / f"report-{r}.json").read_text()) for r in (0, 1)]
    checkpoint = last_complete_checkpoint(out)
    assert reports[0]["global_step"] == reports[1]["global_step"] == int(checkpoint.name.split("-")[1]) < 500
    assert stderr.decode().count("SIGTERM: training stops after step") == 2  # rank 0 saw rank 1's signal


def test_checkpoint_without_drafter_is_refused(tiny_model_dirs, tmp_path):
    trainer = make_trainer(tiny_model_dirs["qwen2"], str(tmp_path), max_steps=1, save_steps=1)
    trainer.train()
    checkpoint = tmp_path / "checkpoint-1"
    shutil.rmtree(checkpoint / DRAFTER_DIR)  # as if killed while writing it
    resumed = make_trainer(tiny_model_dirs["qwen2"], str(tmp_path), max_steps=2)
    with pytest.raises(FileNotFoundError, match="delete that checkpoint"):
        resumed.train(resume_from_checkpoint=str(checkpoint))


@pytest.mark.slow
def test_two_processes_under_torchrun(tiny_model_dirs, tmp_path):
    """gloo, one thread per process: both ranks end with the same (merged) drafter; metrics are logged."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29531"]
    result = subprocess.run(
        [*cmd, HELPER, tiny_model_dirs["qwen2"], str(tmp_path), "3"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads((tmp_path / f"report-{r}.json").read_text()) for r in (0, 1)]
    assert reports[0]["world_size"] == 2
    # Bit-identical drafters on both ranks (fails if the merge after a phase were skipped: each rank trains its own).
    assert reports[0]["drafter_sha256"] == reports[1]["drafter_sha256"]
    logs = [h for h in reports[0]["logs"] if "tlt/idle_seconds" in h]
    assert len(logs) == 3
    # several processes: no spot time is added to the step; the wait for the other rank and the merge are measured
    assert all(h["tlt/spot_seconds"] == 0 and h["tlt/idle_seconds"] > 0 for h in logs)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["multi_gpu", "fsdp2"])
def test_drop_in_under_accelerate_launch(tiny_model_dirs, tmp_path, config):
    """The same 2-process script with GRPOTrainer and with TLTGRPOTrainer, launched with the shipped accelerate config:
    every rank sees the same completions and ends with the same weights. On CPU, accelerate runs both the DDP and the
    FSDP2 config as multi-process data parallel over gloo (FSDP itself does not engage without a GPU)."""
    from trl_tlt.tooling.cli import ACCELERATE_CONFIGS

    for name, port in (("grpo", "29532"), ("tlt", "29533")):
        launch = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(ACCELERATE_CONFIGS / f"{config}.yaml"),
        ]
        launch += ["--num_processes", "2", "--mixed_precision", "no", "--main_process_port", port]
        result = subprocess.run(
            [*launch, HELPER, tiny_model_dirs["qwen2"], str(tmp_path), "2"],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1", "TRAINER": name},
        )
        assert result.returncode == 0, result.stderr[-3000:]
    from safetensors.torch import load_file

    expected = "MULTI_CPU"
    for name in ("grpo", "tlt"):  # data parallel: the ranks hold bit-identical weights
        assert (
            json.loads((tmp_path / f"{name}-0.json").read_text())["weights_sha256"]
            == json.loads((tmp_path / f"{name}-1.json").read_text())["weights_sha256"]
        )
    for rank in (0, 1):
        grpo = json.loads((tmp_path / f"grpo-{rank}.json").read_text())
        tlt = json.loads((tmp_path / f"tlt-{rank}.json").read_text())
        assert tlt["world_size"] == 2 and tlt["distributed_type"] == grpo["distributed_type"] == expected
        assert tlt["completions"] == grpo["completions"] and tlt["completions"]
    # The same training, tensor by tensor (TLT's length-grouped micro-batches round differently, so not bit for bit).
    grpo, tlt = load_file(tmp_path / "grpo-0.safetensors"), load_file(tmp_path / "tlt-0.safetensors")
    assert grpo.keys() == tlt.keys()
    for key in grpo:
        torch.testing.assert_close(tlt[key], grpo[key], rtol=1e-5, atol=1e-6, msg=key)


def test_shipped_fsdp2_config_is_fsdp2():
    """Checked on the config level (FSDP does not engage on CPU): accelerate reads the shipped file as FSDP version 2."""
    from accelerate.commands.config.config_args import ClusterConfig

    from trl_tlt.tooling.cli import ACCELERATE_CONFIGS

    config = ClusterConfig.from_yaml_file(str(ACCELERATE_CONFIGS / "fsdp2.yaml"))
    assert config.distributed_type == "FSDP" and config.fsdp_config["fsdp_version"] == 2
    assert config.fsdp_config["fsdp_state_dict_type"] == "FULL_STATE_DICT"  # TRL gathers weights for generation
