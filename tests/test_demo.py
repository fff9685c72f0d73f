"""The main job (`make demo`) end to end on a tiny policy: both trainers run under the drift scenario's reward, the
four plots are written."""

import json
from pathlib import Path

from trl_tlt.tooling import demo
from trl_tlt.tooling.workload.builds import build_checksum


def test_demo_runs_and_writes_the_plots(tiny_model_dirs, tmp_path, capsys):
    plots = tmp_path / "plots"
    history = demo.main(
        ["--policy", tiny_model_dirs["qwen2"], "--steps", "2", "--eval-every", "1", "--eval-prompts", "2",
         "--max-completion-length", "8", "--output-dir", str(tmp_path / "run"), "--plots-dir", str(plots)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert "drafter loss" in out and "median rollout time: GRPOTrainer" in out and "speculative_config" in out
    assert "steps style" in out and "acceptance length, step 0 -> 2: adaptive" in out  # the drift scenario's view
    assert [r["step"] for r in history["tlt"]] == [1, 2] and [r["step"] for r in history["grpo"]] == [1, 2]
    assert [r["step"] for r in history["acceptance"]] == [0, 1, 2]  # adaptive vs frozen, before and after each step
    assert history["tail"]["active"][0] == 64  # 8 prompts x 8 samples at the first decode step
    for name in ("acceptance.png", "tail.png", "rollout_time.png", "reward.png"):
        assert (plots / name).stat().st_size > 0
    record = json.loads((plots / "demo.json").read_text())
    assert record["summary"]["step_ratio"] > 0 and record["summary"]["acceptance_start"] > 0
    assert record["tlt"] and record["seeds"] == {"trainer": 0, "prompts": 2024, "eval_prompts": 999}
    assert record["settings"] == {"scenario": "drift", "learning_rate": 1e-4, "steps": 2}
    assert record["command"] and record["commit"] and record["machine"] and record["seconds"] > 0
    policy = Path(tiny_model_dirs["qwen2"])
    assert record["builds"] == {policy.name: build_checksum(policy)} and record["builds"][policy.name] in out
    assert (tmp_path / "run" / "drafter" / "config.json").exists()  # the exported EAGLE-3 drafter


def test_grpo_learning_rate_defaults_per_scenario_and_an_explicit_one_is_kept():
    def learning_rate(*argv):
        return demo.grpo_settings(demo.parse_args(list(argv)), tensorboard=False)[0]["learning_rate"]

    assert learning_rate() == 1e-4 and learning_rate("--scenario", "embedded") == 3e-5
    assert learning_rate("--learning-rate", "0") == 0.0 and learning_rate("--learning-rate", "2e-5") == 2e-5
