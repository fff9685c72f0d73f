"""The embedded task: long-tailed repeated addition, its prompts, solutions in two styles, and rewards."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from datasets import Dataset


ANSWER_RE = re.compile(r"####\s*(-?\d+)")


# Mixture over the number of additions: (probability, min, max), uniform within a range.
DEFAULT_STEP_MIXTURE = ((0.62, 1, 3), (0.28, 4, 8), (0.08, 9, 18), (0.02, 19, 30))


# SFT sees mostly short problems: the skills (copy the operands, add, count lines) are the same at every length,
# and short examples give more optimizer steps per second of CPU.
SFT_STEP_MIXTURE = ((0.85, 1, 4), (0.10, 5, 12), (0.05, 13, 30))


# The drift scenario's SFT has three times the long problems: with the SFT mixture, its policy wrote too few lines
# on most long problems (GRPO's rollouts then had no long tail but the rare runaway), and a fine-tune wrote the second
# style far less accurately than the first on problems of 4 or more additions (0.11 vs 0.32).
DRIFT_STEP_MIXTURE = ((0.60, 1, 4), (0.25, 5, 12), (0.15, 13, 30))


@dataclass(frozen=True)
class TaskConfig:
    """The repeated-addition task.

    Args:
        step_mixture: Mixture over the number of additions: tuples (probability, min, max).
        max_operand: Start value and addend are drawn from 1..max_operand.
    """

    step_mixture: tuple[tuple[float, int, int], ...] = DEFAULT_STEP_MIXTURE
    max_operand: int = 99

    def sample_problem(self, rng: random.Random) -> tuple[int, int, int]:
        """(start, addend, number of additions)."""
        weights = [w for w, _, _ in self.step_mixture]
        _, low, high = rng.choices(self.step_mixture, weights=weights)[0]
        return rng.randint(1, self.max_operand), rng.randint(1, self.max_operand), rng.randint(low, high)


def format_question(start: int, addend: int, times: int, ask_steps: bool = False) -> str:
    """The prompt text; `ask_steps` asks for the "steps" style (`Step 1: 7+13=20`)."""
    return f"Start at {start}, add {addend}, {times} times" + (", in steps" if ask_steps else "")


# Solution styles: "compact" (`1: 7+13=20`, the embedded policy's) and "steps" (`Step 1: 7+13=20`, the drift
# scenario's second style: same arithmetic, different tokens).
STEP_LINE = {"compact": "{i}: {a}+{b}={c}", "steps": "Step {i}: {a}+{b}={c}"}


def format_solution(start: int, addend: int, times: int, style: str = "compact") -> str:
    lines, total = [], start
    for i in range(1, times + 1):
        lines.append(STEP_LINE[style].format(i=i, a=total, b=addend, c=total + addend))
        total += addend
    return "\n".join(lines) + f"\n#### {total}"


def solution_style(text: str) -> str:
    """The style a completion is written in: "steps" if it starts with `Step`, else "compact"."""
    return "steps" if text.startswith("Step") else "compact"


def make_dataset(
    num_problems: int,
    seed: int = 0,
    task: TaskConfig | None = None,
    with_solutions: bool = False,
    steps_style_fraction: float = 0.0,
    steps_prompt_fraction: float = 0.0,
):
    """A `datasets.Dataset` of conversational prompts with an `answer` column (and `completion` for SFT).

    A `steps_prompt_fraction` of the prompts ask for the "steps" style (their solutions are written in it); of the
    other solutions, a `steps_style_fraction` are written in the "steps" style unasked. Both are drawn from a second
    generator, so the problems do not depend on them.
    """
    task = task or TaskConfig()
    rng, style_rng = random.Random(seed), random.Random(seed + 1_000_003)
    rows = {"prompt": [], "answer": [], "num_steps": []}
    if with_solutions:
        rows["completion"] = []
    for _ in range(num_problems):
        start, addend, times = task.sample_problem(rng)
        ask_steps = steps_prompt_fraction > 0 and style_rng.random() < steps_prompt_fraction
        rows["prompt"].append([{"role": "user", "content": format_question(start, addend, times, ask_steps)}])
        rows["answer"].append(str(start + addend * times))
        rows["num_steps"].append(times)
        if with_solutions:
            steps = ask_steps or style_rng.random() < steps_style_fraction
            solution = format_solution(start, addend, times, "steps" if steps else "compact")
            rows["completion"].append([{"role": "assistant", "content": solution}])
    return Dataset.from_dict(rows)


def _completion_text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def accuracy_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 if the completion's `#### N` equals the answer, else 0.0 (GRPOTrainer `reward_funcs` form)."""
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        match = ANSWER_RE.search(_completion_text(completion))
        rewards.append(1.0 if match and match.group(1) == str(expected) else 0.0)
    return rewards


def style_reward(completions, answer, style_bonus: float = 0.5, **kwargs) -> list[float]:
    """The drift scenario's reward: 1.0 for a correct answer, times `1 + style_bonus` if it is in the "steps" style.

    A wrong answer earns nothing in either style: GRPO is paid for a style only with a right answer written in it.
    """
    accuracy = accuracy_reward(completions, answer)
    styles = [solution_style(_completion_text(c)) for c in completions]
    return [r * (1 + style_bonus * (s == "steps")) for r, s in zip(accuracy, styles, strict=True)]


def steps_style_fraction(completions, **kwargs) -> list[float]:
    """1.0 for a completion in the "steps" style (log it as a reward function with weight 0)."""
    return [float(solution_style(_completion_text(c)) == "steps") for c in completions]


def drift_rewards() -> dict:
    """The drift scenario's `GRPOConfig`/`GRPOTrainer` reward settings: trains on `style_reward`; logs the steps-style
    share and the accuracy beside it (weight 0). Use as `reward_funcs=r["reward_funcs"]`,
    `reward_weights=r["reward_weights"]`."""
    return {"reward_funcs": [style_reward, steps_style_fraction, accuracy_reward], "reward_weights": [1.0, 0.0, 0.0]}


def prompt_token_ids(tokenizer, prompts) -> list[list[int]]:
    """Token ids of conversational prompts, rendered with the chat template as `GRPOTrainer` does."""
    texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]
