"""`TLTConfig`: `GRPOConfig` plus the fields of TLT's speculative rollouts."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig


DRAFTER_TYPES = ("eagle3", "model", "ngram", "none")
SELECTORS = ("bandit", "fixed")


@dataclass
class TLTConfig(GRPOConfig):
    r"""
    Configuration class for [`TLTGRPOTrainer`]: every [`~trl.GRPOConfig`] argument, plus the following.

    Parameters:
        drafter_type (`str`, *optional*, defaults to `"eagle3"`):
            Drafter of the speculative rollouts: `"eagle3"` (an EAGLE-3 head on the policy's hidden states),
            `"model"` (a small causal LM sharing the tokenizer, see `drafter_model_name_or_path`), `"ngram"`
            (model-free lookup over the prompt and the sibling completions of the same prompt), `"none"` (the
            engine without speculation).
        drafter_model_name_or_path (`str` or `None`, *optional*, defaults to `None`):
            With `drafter_type="eagle3"`: a warm-start EAGLE-3 checkpoint (from `scripts/train_drafter.py` or
            `save_drafter`); `None` = a new head for the policy (untrained until spot training lands, so warm-start
            it). With `drafter_type="model"`: path or Hub id of the drafter LM (required).
        num_speculative_tokens (`int`, *optional*, defaults to `4`):
            Draft length k with `speculative_selector="fixed"`; the largest k the bandit may choose otherwise.
        speculative_selector (`str`, *optional*, defaults to `"bandit"`):
            `"bandit"`: choose per decode step, per active-batch-size bucket, whether and how far to speculate
            (epsilon-greedy, maximises tokens per second). `"fixed"`: speculate `num_speculative_tokens` at every
            batch size.
        selector_epsilon (`float`, *optional*, defaults to `0.1`):
            Exploration probability of the bandit.
        spot_training (`bool`, *optional*, defaults to `False`):
            Train the drafter online in the rollout's idle time. Reserved: needs a trainable drafter, not
            available in this version.
    """

    drafter_type: str = field(
        default="eagle3",
        metadata={
            "help": "Drafter: 'eagle3' (EAGLE-3 head), 'model' (small LM, see drafter_model_name_or_path), 'ngram' "
            "or 'none'.",
            "choices": list(DRAFTER_TYPES),
        },
    )
    drafter_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Warm-start EAGLE-3 checkpoint (eagle3; None = new head) or the drafter LM (model)."},
    )
    num_speculative_tokens: int = field(
        default=4, metadata={"help": "Draft length k (fixed selector), or the largest k the bandit may choose."}
    )
    speculative_selector: str = field(
        default="bandit",
        metadata={
            "help": "'bandit': adaptive per batch-size bucket; 'fixed': always num_speculative_tokens.",
            "choices": list(SELECTORS),
        },
    )
    selector_epsilon: float = field(default=0.1, metadata={"help": "Exploration probability of the bandit selector."})
    spot_training: bool = field(
        default=False, metadata={"help": "Train the drafter online in idle time (not available in this version)."}
    )

    def __post_init__(self):
        super().__post_init__()
        if self.drafter_type not in DRAFTER_TYPES:
            raise ValueError(f"`drafter_type` must be one of {DRAFTER_TYPES}, got {self.drafter_type!r}.")
        if self.drafter_type == "model" and not self.drafter_model_name_or_path:
            raise ValueError(
                "`drafter_type='model'` needs `drafter_model_name_or_path` (a small LM with the same tokenizer)."
            )
        if self.speculative_selector not in SELECTORS:
            raise ValueError(f"`speculative_selector` must be one of {SELECTORS}, got {self.speculative_selector!r}.")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"`num_speculative_tokens` must be >= 1, got {self.num_speculative_tokens}.")
        if not 0 <= self.selector_epsilon <= 1:
            raise ValueError(f"`selector_epsilon` must be in [0, 1], got {self.selector_epsilon}.")
        if self.spot_training:
            raise ValueError(
                "`spot_training=True` needs a trainable drafter, which this version does not ship; set spot_training=False."
            )
