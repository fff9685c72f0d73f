"""Long-tail rollout simulator: where a GRPO step's time goes on a cluster, with and without speculative decoding.

The model is event-driven at sequence completions and works with expected token rates (a "fluid" model):

- a rollout *instance* is one data-parallel generation engine (`gpus_per_instance` accelerators, e.g. a
  tensor-parallel group) holding `sequences_per_instance` sequences of a step (whole GRPO groups);
- with continuous batching, finished sequences leave the batch; between two completions the active batch size B is
  constant and every active sequence advances one token every `Backend.token_seconds(B)` seconds. With a static
  batch (`transformers.generate`, the stock `GRPOTrainer`'s path) finished rows keep computing until the longest
  one ends;
- speculative decoding divides the time per token at batch size B by a speed-up s(B) (acceptance length included),
  at batch sizes up to a threshold;
- the step waits for the slowest instance, then runs the other phases (scoring, reference/old log-probs, training)
  in `other_seconds`. Instances that finish early idle until then: TLT's spot trainer harvests that idle time in
  whole drafter steps (a step cut by the end of the rollout is lost).

One step of 512 instances x 2,048 sequences is a sort and a matrix-vector product: seconds for hundreds of steps.
`scripts/bench/simulate.py` calibrates it on our CPU measurements and on the TLT paper's setup (docs/scale.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class CostTable:
    """A positive function of the active batch size, given at some batch sizes.

    Interpolated linearly in log(batch size) / log(value); constant below the first point; beyond the last point the
    last segment's log-log slope continues (a single point: constant).

    Example:
        >>> decode = CostTable((1, 64, 256), (0.010, 0.012, 0.030))  # seconds per decode step
        >>> float(decode(16))
    """

    batch_sizes: tuple[float, ...]
    values: tuple[float, ...]

    def __post_init__(self):
        if len(self.batch_sizes) != len(self.values) or not self.batch_sizes:
            raise ValueError("`batch_sizes` and `values` must be non-empty and of the same length.")
        if list(self.batch_sizes) != sorted(set(self.batch_sizes)) or self.batch_sizes[0] <= 0:
            raise ValueError(f"`batch_sizes` must be positive and strictly increasing, got {self.batch_sizes}.")
        if min(self.values) <= 0:
            raise ValueError(f"`values` must be positive, got {self.values}.")

    def __call__(self, batch_size) -> np.ndarray:
        b = np.log(np.maximum(np.asarray(batch_size, dtype=float), 1e-9))
        xs, ys = np.log(self.batch_sizes), np.log(self.values)
        out = np.interp(b, xs, ys)
        if len(xs) > 1:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            out = np.where(b > xs[-1], ys[-1] + slope * (b - xs[-1]), out)
        return np.exp(out)


@dataclass(frozen=True)
class Backend:
    """How an instance decodes.

    Args:
        name: Label in the results.
        decode: Seconds per decode step (one token for every active sequence) without speculation.
        speedup: Speculative decoding's speed-up in tokens per second over `decode` at each batch size (None: none).
        threshold: Speculate only at active batch sizes <= threshold.
        static: Finished sequences keep their batch slot (the batch size stays at its initial value).
        context: Extra seconds per decode step per token already generated (a step cost growing with the cache);
            None: the step cost does not depend on the position.
    """

    name: str
    decode: CostTable
    speedup: CostTable | None = None
    threshold: int = 32
    static: bool = False
    context: CostTable | None = None

    def token_seconds(self, batch_size) -> np.ndarray:
        b = np.asarray(batch_size, dtype=float)
        seconds = self.decode(b)
        if self.speedup is not None:
            seconds = np.where(b <= self.threshold, seconds / self.speedup(b), seconds)
        return seconds


def speculative_speedup(
    decode: CostTable, draft: CostTable, acceptance_length: float, k: int, max_batch: int = 4096
) -> CostTable:
    """Speed-up of speculation from costs: a verify step of B sequences x (k + 1) tokens costs like a decode step of
    B (k + 1) tokens, k drafter steps cost `draft(B)` each, and a verify step emits `acceptance_length` tokens per
    sequence: s(B) = acceptance_length x decode(B) / (decode(B (k + 1)) + k draft(B))."""
    if k < 1 or acceptance_length < 1:
        raise ValueError(f"Need k >= 1 and acceptance_length >= 1, got k={k}, acceptance_length={acceptance_length}.")
    sizes = 2.0 ** np.arange(int(np.log2(max_batch)) + 1)
    values = acceptance_length * decode(sizes) / (decode(sizes * (k + 1)) + k * draft(sizes))
    return CostTable(tuple(sizes), tuple(float(v) for v in values))


@dataclass
class TraceLengths:
    """Response lengths drawn as whole GRPO groups from a recorded trace (list of groups of lengths)."""

    groups: list[list[int]]

    def __post_init__(self):
        sizes = {len(g) for g in self.groups}
        if not self.groups or len(sizes) != 1:
            raise ValueError("`groups` must be a non-empty list of equally sized groups of lengths.")

    @property
    def group_size(self) -> int:
        return len(self.groups[0])

    def sample(self, rng: np.random.Generator, num_groups: int) -> np.ndarray:
        table = np.asarray(self.groups, dtype=float)
        return table[rng.integers(0, len(table), size=num_groups)]


@dataclass
class LogNormalLengths:
    """Heavy-tailed response lengths: log L = log(median) + prompt effect + sample effect, clipped to `max_tokens`.

    Args:
        median: Median response length in tokens.
        sigma: Standard deviation of log L over all responses.
        prompt_share: Share of the variance of log L that is between prompts (GRPO groups share a prompt).
        max_tokens: Maximum response length (responses are clipped to it, as by `max_completion_length`).
        group_size: Responses per prompt.
    """

    median: float
    sigma: float
    max_tokens: int
    group_size: int = 8
    prompt_share: float = 0.3

    def sample(self, rng: np.random.Generator, num_groups: int) -> np.ndarray:
        between = self.sigma * np.sqrt(self.prompt_share)
        within = self.sigma * np.sqrt(1.0 - self.prompt_share)
        z = between * rng.standard_normal((num_groups, 1)) + within * rng.standard_normal(
            (num_groups, self.group_size)
        )
        return np.clip(np.round(self.median * np.exp(z)), 1, self.max_tokens)


@dataclass
class Cluster:
    """The generation side of a synchronous GRPO step.

    Args:
        num_instances: Data-parallel generation engines.
        groups_per_instance: GRPO groups (prompts) per engine per step.
        gpus_per_instance: Accelerators per engine (tensor parallelism), for accelerator-seconds.
        other_seconds: Everything in the step after the rollout (rewards, log-prob passes, policy update).
        drafter_step_seconds: One drafter optimizer step of the spot trainer (harvest granularity).
    """

    num_instances: int
    groups_per_instance: int
    gpus_per_instance: int = 1
    other_seconds: float = 0.0
    drafter_step_seconds: float = 0.1


def rollout_seconds(backend: Backend, lengths: np.ndarray) -> np.ndarray:
    """Rollout time of each instance. `lengths`: (instances, sequences) response lengths in tokens."""
    lengths = np.sort(np.asarray(lengths, dtype=float), axis=1)
    n = lengths.shape[1]
    if backend.static:  # one segment: the full batch until the longest sequence ends
        lengths, active = lengths[:, -1:], np.array([n])
    else:  # segments between consecutive completions, each at its own active batch size
        active = np.arange(n, 0, -1)
    steps = np.diff(lengths, axis=1, prepend=0.0)
    seconds = steps @ backend.token_seconds(active)
    if backend.context is not None:  # sum over the segment's positions t of context(B) * t
        seconds += np.diff(lengths**2 / 2, axis=1, prepend=0.0) @ backend.context(active)
    return seconds


@dataclass
class StepResult:
    """Per-step outcome of one backend (arrays over simulated steps)."""

    rollout: np.ndarray
    step: np.ndarray
    idle_gpu_seconds: np.ndarray
    harvested_gpu_seconds: np.ndarray
    drafter_steps: np.ndarray
    instance_rollouts: list[np.ndarray] = field(default_factory=list, repr=False)

    def summary(self) -> dict:
        idle = float(self.idle_gpu_seconds.sum())
        return {
            "median_step_seconds": float(np.median(self.step)),
            "median_rollout_seconds": float(np.median(self.rollout)),
            "rollout_share": float(np.median(self.rollout / self.step)),
            "idle_gpu_seconds_per_step": float(np.mean(self.idle_gpu_seconds)),
            "harvested_share_of_idle": float(self.harvested_gpu_seconds.sum() / idle) if idle > 0 else None,
            "drafter_steps_per_rl_step": float(np.mean(self.drafter_steps)),
        }


def simulate(
    cluster: Cluster,
    lengths,
    backends: list[Backend],
    num_steps: int = 20,
    seed: int = 0,
    keep_instances: bool = False,
) -> dict[str, StepResult]:
    """Simulate `num_steps` GRPO steps; every backend sees the same sampled lengths (common random numbers)."""
    if cluster.num_instances < 1 or cluster.groups_per_instance < 1:
        raise ValueError("`num_instances` and `groups_per_instance` must be >= 1.")
    rng = np.random.default_rng(seed)
    draws = [
        lengths.sample(rng, cluster.num_instances * cluster.groups_per_instance).reshape(cluster.num_instances, -1)
        for _ in range(num_steps)
    ]
    results = {}
    for backend in backends:
        per_step = [rollout_seconds(backend, draw) for draw in draws]
        rollout = np.array([r.max() for r in per_step])
        idle = [r.max() - r for r in per_step]  # per instance
        whole = [np.floor(i / cluster.drafter_step_seconds) for i in idle]
        results[backend.name] = StepResult(
            rollout=rollout,
            step=rollout + cluster.other_seconds,
            idle_gpu_seconds=np.array([i.sum() for i in idle]) * cluster.gpus_per_instance,
            harvested_gpu_seconds=np.array([w.sum() for w in whole])
            * cluster.drafter_step_seconds
            * cluster.gpus_per_instance,
            drafter_steps=np.array([w.sum() for w in whole]),
            instance_rollouts=per_step if keep_instances else [],
        )
    return results
