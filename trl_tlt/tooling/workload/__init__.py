"""The embedded workload: long-tailed repeated addition, a verifiable reasoning task with a policy built offline.

A problem asks to add a number to a start value n times; the solution writes one numbered line per addition,
then states the answer after `####`::

    user:      Start at 7, add 13, 4 times
    assistant: 1: 7+13=20
               2: 20+13=33
               3: 33+13=46
               4: 46+13=59
               #### 59

The number of additions is heavy-tailed (most problems need 1-3, a few up to 30), so solution lengths are
long-tailed like reasoning RL: a few rollouts run 10-20x longer than the median. The reward is 1 for a correct
final answer. The policy is a Qwen2-architecture model (8 decoder layers, ~2.2M parameters) trained by SFT on
generated solutions (`train_sft`), cached on disk under a key derived from the recipe. The drift scenario
(`build_drift_policy`, the demo's) trains a policy of the same shape from scratch on solutions in two styles.

Run `python -m trl_tlt.tooling.workload` to build (or load) the policy and print its length distribution and accuracy.
"""

from .builds import (
    DrafterRecipe,
    DriftRecipe,
    PolicyRecipe,
    build_draft_lm,
    build_drift_policy,
    build_eagle3_drafter,
    build_policy,
    build_policy_tokenizer,
    default_cache_dir,
    encode_sft_example,
    recipe_key,
    sft_dataset,
    train_sft,
)
from .evaluate import evaluate_policy, main, plot_lengths
from .task import (
    ANSWER_RE,
    DEFAULT_STEP_MIXTURE,
    DRIFT_STEP_MIXTURE,
    SFT_STEP_MIXTURE,
    STEP_LINE,
    TaskConfig,
    accuracy_reward,
    drift_rewards,
    format_question,
    format_solution,
    make_dataset,
    prompt_token_ids,
    solution_style,
    steps_style_fraction,
    style_reward,
)


__all__ = [
    "ANSWER_RE",
    "DEFAULT_STEP_MIXTURE",
    "DRIFT_STEP_MIXTURE",
    "DrafterRecipe",
    "DriftRecipe",
    "PolicyRecipe",
    "SFT_STEP_MIXTURE",
    "STEP_LINE",
    "TaskConfig",
    "accuracy_reward",
    "build_draft_lm",
    "build_drift_policy",
    "build_eagle3_drafter",
    "build_policy",
    "build_policy_tokenizer",
    "default_cache_dir",
    "drift_rewards",
    "encode_sft_example",
    "evaluate_policy",
    "format_question",
    "format_solution",
    "main",
    "make_dataset",
    "plot_lengths",
    "prompt_token_ids",
    "recipe_key",
    "sft_dataset",
    "solution_style",
    "steps_style_fraction",
    "style_reward",
    "train_sft",
]
