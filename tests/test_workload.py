"""The embedded workload: deterministic data, a correct verifier, long-tailed solution lengths, cache keys."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trl_tlt.tooling.workload import (
    DrafterRecipe,
    DriftRecipe,
    PolicyRecipe,
    TaskConfig,
    accuracy_reward,
    drift_rewards,
    evaluate_policy,
    format_solution,
    make_dataset,
    solution_style,
    steps_style_fraction,
    style_reward,
)
from trl_tlt.tooling.workload.builds import build_checksum


# A policy recipe small enough to build in a test (seconds).
TINY_RECIPE = PolicyRecipe(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, num_sft_examples=64
)


def test_solution_format_and_answer():
    assert format_solution(7, 13, 3) == "1: 7+13=20\n2: 20+13=33\n3: 33+13=46\n#### 46"


def test_the_drift_scenarios_second_style_and_its_reward():
    steps = format_solution(7, 13, 2, style="steps")
    # Same arithmetic tokens as the compact style; only the line prefix differs.
    assert steps == "Step 1: 7+13=20\nStep 2: 20+13=33\n#### 33"
    assert solution_style(steps) == "steps" and solution_style(format_solution(7, 13, 2)) == "compact"
    wrong_steps = steps.replace("#### 33", "#### 34")
    completions = [steps, format_solution(7, 13, 2), wrong_steps, "#### 1", [{"role": "assistant", "content": steps}]]
    # The style counts only when the answer is right: a wrong answer earns nothing in either style.
    assert style_reward(completions, ["33"] * 5) == [1.5, 1.0, 0.0, 0.0, 1.5]
    assert steps_style_fraction(completions) == [1.0, 0.0, 1.0, 0.0, 1.0]
    rewards = drift_rewards()  # trains on style_reward only; the others are logged beside it
    assert rewards["reward_funcs"][0] is style_reward and rewards["reward_weights"] == [1.0, 0.0, 0.0]


def test_a_style_mix_changes_the_solutions_not_the_problems():
    plain = make_dataset(400, seed=5, with_solutions=True)
    mixed = make_dataset(400, seed=5, with_solutions=True, steps_style_fraction=0.3)
    assert plain["prompt"] == mixed["prompt"] and plain["answer"] == mixed["answer"]
    styles = [solution_style(c[0]["content"]) for c in mixed["completion"]]
    assert 0.22 < styles.count("steps") / len(styles) < 0.38
    assert {solution_style(c[0]["content"]) for c in plain["completion"]} == {"compact"}
    for row in mixed:
        assert accuracy_reward([row["completion"]], [row["answer"]]) == [1.0]
    asked = make_dataset(400, seed=5, with_solutions=True, steps_prompt_fraction=0.5)
    for row in asked:  # a prompt that asks for the steps style is answered in it
        assert row["prompt"][0]["content"].endswith(", in steps") == (
            solution_style(row["completion"][0]["content"]) == "steps"
        )
    assert plain["answer"] == asked["answer"]
    assert DriftRecipe().key() != DriftRecipe(steps_style_fraction=0.5).key()
    # The head's recipe keys the head, not the start policy: changing it does not retrain the policy.
    assert DriftRecipe().key() == DriftRecipe(drafter=DrafterRecipe(epochs=1)).key()


def test_dataset_is_deterministic_and_answers_are_right():
    a, b = make_dataset(50, seed=3, with_solutions=True), make_dataset(50, seed=3, with_solutions=True)
    assert a.to_dict() == b.to_dict()
    assert make_dataset(50, seed=4).to_dict() != make_dataset(50, seed=3).to_dict()
    for row in a:
        assert accuracy_reward([row["completion"]], [row["answer"]]) == [1.0]


def test_reward_function():
    completions = ["1: 1+2=3\n#### 3", "#### 4", "no answer", [{"role": "assistant", "content": "x\n#### 12"}]]
    assert accuracy_reward(completions, ["3", "3", "3", "12"]) == [1.0, 0.0, 0.0, 1.0]


def test_task_lengths_are_long_tailed():
    lengths = np.array([len(format_solution(1, 1, n)) for n in make_dataset(4000, seed=0)["num_steps"]])
    median = np.median(lengths)
    assert np.percentile(lengths, 99) / median >= 5
    assert lengths.max() / median >= 10


def test_recipe_key_tracks_every_field():
    recipe = PolicyRecipe()
    assert recipe.key() == PolicyRecipe().key()
    assert dataclasses.replace(recipe, seed=1).key() != recipe.key()
    assert dataclasses.replace(recipe, task=TaskConfig(max_operand=9)).key() != recipe.key()


def test_evaluate_policy_plumbing(tokenizer):
    from trl_tlt.tooling.tiny import build_tiny_model

    model = build_tiny_model(tokenizer, hidden_size=64, num_hidden_layers=1)
    stats = evaluate_policy(model, tokenizer, make_dataset(3, seed=0), num_generations=2, max_new_tokens=8)
    assert stats["num_problems"] == 3 and len(stats["lengths"]) == 6
    assert stats["length_max"] <= 8
    cells = stats["accuracy_by_style"]  # every sample in one (style, length) cell, weighted back to the accuracy
    assert set(cells) <= {f"{style}, {size}" for style in ("compact", "steps") for size in ("short", "long")}
    assert sum(n for _, n in cells.values()) == 6
    assert abs(sum(a * n for a, n in cells.values()) / 6 - stats["accuracy"]) < 1e-9


def test_build_policy_caches_under_the_recipe_key(tmp_path, capsys):
    from trl_tlt.tooling.workload import build_draft_lm, build_policy

    recipe = TINY_RECIPE
    path = build_policy(recipe, cache_dir=tmp_path)
    assert path.name == f"policy-{recipe.key()}" and (path / "config.json").exists()
    assert not list(tmp_path.glob("*.tmp"))  # built in a temporary folder, renamed when complete
    capsys.readouterr()
    assert build_policy(recipe, cache_dir=tmp_path) == path
    assert "training" not in capsys.readouterr().out  # the second call reuses the cache
    draft = build_draft_lm(recipe, cache_dir=tmp_path)
    assert draft.name == f"draft-lm-{recipe.key()}-L1"
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(draft).num_hidden_layers == 1


def test_build_policy_is_deterministic_for_a_seed(tmp_path):
    import torch
    from safetensors.torch import load_file

    from trl_tlt.tooling.workload import build_policy

    recipe = TINY_RECIPE
    weights = [
        load_file(build_policy(r, cache_dir=tmp_path / name, verbose=False) / "model.safetensors")
        for name, r in (("a", recipe), ("b", recipe), ("c", dataclasses.replace(recipe, seed=1)))
    ]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert not all(torch.equal(weights[0][k], weights[2][k]) for k in weights[0])


@pytest.mark.slow
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "unpinned-negative-control"])
def test_two_fresh_processes_build_bit_identical_policies_and_heads(tmp_path, pinned):
    """Two processes as two fresh clones would run them, with other thread counts and hash seeds in their
    environments: the same policy and head, tensor for tensor (`BUILD_THREADS`). Negative control: with the build's
    threads left to the environment, the 1- and 3-thread heads differ."""
    helper = str(Path(__file__).with_name("_build_run.py"))
    runs = [
        subprocess.Popen(
            [sys.executable, helper, str(tmp_path / f"threads{threads}"), *([] if pinned else ["--unpinned"])],
            env={**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONHASHSEED": str(threads)},
            stdout=subprocess.PIPE,
            text=True,
        )
        for threads in (1, 3)
    ]
    one, three = (json.loads(run.communicate(timeout=600)[0].splitlines()[-1]) for run in runs)
    assert all(run.returncode == 0 for run in runs)
    if pinned:
        assert one == three
    else:
        assert one["drafter"] != three["drafter"]


def test_build_drift_policy_caches_the_start_policy_and_its_drafter(tmp_path):
    from trl_tlt.tooling.workload import build_drift_policy

    base = dataclasses.replace(TINY_RECIPE, num_hidden_layers=3)  # an exportable EAGLE-3 head needs 3 layers
    recipe = DriftRecipe(
        policy=base, num_examples=64, drafter=DrafterRecipe(num_prompts=4, num_eval_prompts=2, epochs=1)
    )
    policy, drafter = build_drift_policy(recipe, cache_dir=tmp_path, verbose=False)
    assert (
        policy.name == f"drift-{recipe.key()}"
        and drafter.name == f"eagle3-drift-{recipe.key()}-{recipe.drafter.key()}"
    )
    assert (policy / "config.json").exists() and (drafter / "config.json").exists()
    assert not (tmp_path / f"policy-{base.key()}").exists()  # one SFT from scratch: the embedded policy is not built
    saved = json.loads((policy / "recipe.json").read_text())
    assert saved["num_examples"] == 64 and saved["drafter"] is None
    assert not list(tmp_path.glob("*.tmp"))
    assert build_drift_policy(recipe, cache_dir=tmp_path, verbose=False) == (policy, drafter)


def test_the_shipped_build_is_taken_checked_and_rebuilt_on_request(tmp_path, monkeypatch, capsys, tiny_model_dirs):
    """#64: the drift scenario's builds ship with the package: a cold cache takes them (no SFT), checked against their
    checksums; a shipped copy that does not match is built from code instead; `rebuild=True` builds from code and says
    whether the result equals the shipped build. The builds here are stand-ins (a saved tiny model), the builders
    recorded. Mutations caught: skip the checksum check (the tampered copy is used), ignore `rebuild`."""
    from safetensors.torch import load_file, save_file

    from trl_tlt.tooling.workload import build_drift_policy
    from trl_tlt.tooling.workload import builds as builds_module

    recipe = DriftRecipe()
    names = [f"drift-{recipe.key()}", f"eagle3-drift-{recipe.key()}-{recipe.drafter.key()}"]
    shipped = tmp_path / "shipped"
    for name in names:
        shutil.copytree(tiny_model_dirs["qwen2"], shipped / name)
    checksums = {name: build_checksum(shipped / name) for name in names}
    (shipped / "checksums.json").write_text(json.dumps(checksums))
    monkeypatch.setattr(builds_module, "SHIPPED_DIR", shipped)
    monkeypatch.setattr(builds_module, "SHIPPED_CHECKSUMS", shipped / "checksums.json")
    built = []

    def build_from_code(path, *args, **kwargs):  # as the SFT and the warm start would: the same tensors
        built.append(path.name)
        shutil.copytree(tiny_model_dirs["qwen2"], path)
        return path

    monkeypatch.setattr(builds_module, "_build_sft_model", build_from_code)
    monkeypatch.setattr(
        builds_module, "_warm_start_eagle3", lambda policy, name, *a, **k: policy.parent / name
        if (policy.parent / name).exists() else build_from_code(policy.parent / name)
    )  # fmt: skip

    taken = build_drift_policy(recipe, cache_dir=tmp_path / "cold", verbose=False)
    assert not built and [p.name for p in taken] == names
    assert {p.name: build_checksum(p) for p in taken} == checksums

    weights = shipped / names[0] / "model.safetensors"
    tensors = load_file(weights)
    save_file({key: value + 1.0 for key, value in tensors.items()}, weights)
    build_drift_policy(recipe, cache_dir=tmp_path / "tampered", verbose=False)
    assert built == [names[0]] and "does not match its checksum" in capsys.readouterr().out
    save_file(tensors, weights)

    build_drift_policy(recipe, cache_dir=tmp_path / "cold", verbose=False, rebuild=True)
    assert built == [names[0], *names]
    assert capsys.readouterr().out.count("equals the shipped build") == 2


def test_the_shipped_drift_builds_match_their_checksums_and_the_default_recipe():
    """What `make demo` takes without building: the default recipe's two builds, each equal to its recorded checksum."""
    from trl_tlt.tooling.workload import builds as builds_module

    recipe = DriftRecipe()
    names = [f"drift-{recipe.key()}", f"eagle3-drift-{recipe.key()}-{recipe.drafter.key()}"]
    checksums = json.loads(builds_module.SHIPPED_CHECKSUMS.read_text())
    assert sorted(checksums) == sorted(names)
    for name in names:
        assert build_checksum(builds_module.SHIPPED_DIR / name) == checksums[name], name
