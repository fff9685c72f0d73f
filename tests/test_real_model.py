"""The real-regime pieces of trl_tlt.tooling.real_model that need no download: the SFT solutions' style, the entropy
measurement, and the cache of the build (the model itself needs the `real-model` extra: scripts/bench/)."""

import math
import random
import re

import pytest
import torch

from trl_tlt.tooling.real_model import (
    CLOSINGS,
    LINE_STYLES,
    RealRegimeRecipe,
    answer_reward,
    completion_entropy,
    real_model_prompts,
    real_model_solution,
)


def test_solutions_add_correctly_one_line_per_addition_and_branch_in_wording():
    rows = real_model_prompts(40, seed=3)
    rng = random.Random(0)
    styles = set()
    for row in rows:
        text = real_model_solution(row, rng)
        lines = [line for line in text.split("\n") if line]
        additions = [line for line in lines if str(row["addend"]) in line and any(ch.isdigit() for ch in line)]
        assert len(lines) >= row["times"] + 1
        assert re.findall(r"-?\d+", lines[-1])[-1] == str(row["answer"])  # the closing states the answer last
        assert answer_reward([text], [row["answer"]], [row["first"]]) == [1.0]
        assert additions  # every problem's additions are written out
        for template in LINE_STYLES:
            prefix = template.split("{")[0]
            if any(line.startswith(prefix) for line in lines) and prefix:
                styles.add(template)
    assert len(styles) >= 2  # the wording branches across lines and solutions
    assert len({real_model_solution(rows[0], random.Random(s)) for s in range(20)}) > 1
    assert len(CLOSINGS) > 1


def test_completion_entropy_is_that_of_the_policys_next_token_distribution():
    """A policy whose logits are the same everywhere: the entropy is that distribution's; uniform logits give ln V."""

    class Fixed(torch.nn.Module):
        def __init__(self, logits):
            super().__init__()
            self.logits_row = logits

        def forward(self, input_ids):
            return type("Out", (), {"logits": self.logits_row.expand(*input_ids.shape, -1)})()

    vocab = 7
    assert completion_entropy(Fixed(torch.zeros(vocab)), [[1, 2]], [[3, 4, 5]]) == pytest.approx(math.log(vocab))
    logits = torch.tensor([2.0, 0.0, -1.0, -3.0, 0.5, 0.0, 1.0])
    p = torch.softmax(logits.double(), -1)
    expected = float(-(p * p.log()).sum())
    assert completion_entropy(Fixed(logits), [[1], [2, 3]], [[4, 5], []]) == pytest.approx(expected)
    with pytest.raises(ValueError, match="prompt of at least one token"):
        completion_entropy(Fixed(logits), [[]], [[3, 4, 5]])


def test_the_recipe_is_its_cache_key():
    assert RealRegimeRecipe().key() == RealRegimeRecipe().key()
    assert RealRegimeRecipe().key() != RealRegimeRecipe(num_examples=128).key()
    assert RealRegimeRecipe().key() != RealRegimeRecipe(line_styles=LINE_STYLES[:2]).key()  # the wording too
