"""The embedded workload: deterministic data, a correct verifier, long-tailed solution lengths, cache keys."""

import dataclasses

import numpy as np

from trl_tlt.workload import (
    PolicyRecipe,
    TaskConfig,
    accuracy_reward,
    evaluate_policy,
    format_solution,
    make_dataset,
)


# A policy recipe small enough to build in a test (seconds).
TINY_RECIPE = PolicyRecipe(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, num_sft_examples=64
)


def test_solution_format_and_answer():
    assert format_solution(7, 13, 3) == "1: 7+13=20\n2: 20+13=33\n3: 33+13=46\n#### 46"


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
    from trl_tlt.tiny import build_tiny_model

    model = build_tiny_model(tokenizer, hidden_size=64, num_hidden_layers=1)
    stats = evaluate_policy(model, tokenizer, make_dataset(3, seed=0), num_generations=2, max_new_tokens=8)
    assert stats["num_problems"] == 3 and len(stats["lengths"]) == 6
    assert 0.0 <= stats["accuracy"] <= 1.0 and stats["length_max"] <= 8


def test_build_policy_caches_under_the_recipe_key(tmp_path, capsys):
    from trl_tlt.workload import build_draft_lm, build_policy

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

    from trl_tlt.workload import build_policy

    recipe = TINY_RECIPE
    weights = [
        load_file(build_policy(r, cache_dir=tmp_path / name, verbose=False) / "model.safetensors")
        for name, r in (("a", recipe), ("b", recipe), ("c", dataclasses.replace(recipe, seed=1)))
    ]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert not all(torch.equal(weights[0][k], weights[2][k]) for k in weights[0])
