"""The `tlt/` metrics a rollout and a spot phase log (each key defined in docs/trainer.md and docs/vllm.md)."""

from __future__ import annotations

from ..drafters import PromptHistory
from ..engine.speculation import BanditSpeculation, SpeculationPolicy, batch_size_bucket, dominant_bucket
from ..engine.stats import GenerationStats
from ..training.spot import SpotStats, SpotTrainer


def rollout_metrics(
    stats: GenerationStats, history: PromptHistory | None, speculation: SpeculationPolicy | None = None
) -> dict[str, float]:
    """One generation turn of trl-tlt's engine (`speculation`: the policy that chose its arms)."""
    steps = max(len(stats.active_batch_sizes), 1)
    speculated = sum(1 for k in stats.num_speculative_tokens if k > 0)
    metrics = {
        "tlt/mean_acceptance_length": stats.mean_acceptance_length,
        "tlt/draft_acceptance_rate": stats.draft_acceptance_rate,
        "tlt/spec_step_fraction": speculated / steps,
        "tlt/tree_step_fraction": stats.num_tree_steps / steps,
        "tlt/num_decode_steps": float(len(stats.active_batch_sizes)),
        "tlt/rollout_seconds": stats.total_s,
        "tlt/rollout_tokens_per_second": stats.num_emitted_tokens / max(stats.total_s, 1e-9),
        "tlt/mean_active_batch_size": sum(stats.active_batch_sizes) / steps,
    }
    if stats.lockstep:  # a sharded policy: the forwards this rank ran for the others, its own rows done
        forwards = 1 + stats.num_target_forwards + stats.num_placeholder_forwards
        metrics["tlt/placeholder_forward_share"] = stats.num_placeholder_forwards / forwards
    if stats.num_accepted_tokens:  # which source each accepted draft token came from (shares)
        for source, count in stats.num_accepted_tokens_by_source.items():
            metrics[f"tlt/accepted_from_{source}"] = count / stats.num_accepted_tokens
    if history is not None:
        metrics["tlt/history_tokens"] = float(history.num_tokens)
    # per power-of-two bucket of the active batch size: the k chosen (mean) and the tokens per second
    buckets: dict[int, list] = {}
    for size, k, tokens, seconds in zip(
        stats.active_batch_sizes, stats.num_speculative_tokens, stats.step_emitted_tokens, stats.step_seconds
    ):
        buckets.setdefault(batch_size_bucket(size), []).append((k, tokens, seconds))
    for bucket, rows in buckets.items():
        metrics[f"tlt/k_bucket_{bucket}"] = sum(k for k, _, _ in rows) / len(rows)
        metrics[f"tlt/tokens_per_second_bucket_{bucket}"] = sum(t for _, t, _ in rows) / max(
            sum(s for _, _, s in rows), 1e-9
        )
    if isinstance(speculation, BanditSpeculation) and buckets:
        # the bandit's measured cost of a k-token step over a plain one, at the bucket most of the turn's steps ran in
        bucket = dominant_bucket(stats.active_batch_sizes)
        metrics["tlt/verify_cost_bucket"] = float(bucket)
        for k, cost in sorted(speculation.step_costs(bucket).items()):
            metrics[f"tlt/verify_cost_k{k}"] = cost
    return metrics


def spot_metrics(stats: SpotStats, spot: SpotTrainer, in_idle_time: bool | None = None) -> dict[str, float]:
    """One spot phase (over all ranks after the merge); `in_idle_time`: it ran in idle time (default: with several
    processes; a vLLM server's wait, whatever their number)."""
    summary = stats.summary
    one_process = spot.group is None
    idle = not one_process if in_idle_time is None else in_idle_time
    metrics = {
        "tlt/drafter_steps": summary["steps"],
        "tlt/idle_seconds": summary["idle_seconds"],
        "tlt/idle_seconds_used": summary["seconds_used"] if idle else 0.0,
        "tlt/spot_seconds": 0.0 if idle else stats.seconds_used,
        "tlt/drafter_resets": summary["resets"],
        "tlt/drafter_rerun_samples": float(spot.rerun_samples),
        "tlt/drafter_dropped_samples": float(spot.dropped_samples),
    }
    if summary["loss"] is not None:
        metrics["tlt/drafter_loss"] = summary["loss"]
    if summary["eval_acceptance_length"] is not None:
        metrics["tlt/drafter_eval_acceptance_length"] = summary["eval_acceptance_length"]
    if one_process and not idle:
        metrics["tlt/spot_budget_share"] = 0.0 if stats.skipped else spot.budget.share
    if stats.expected_speedup is not None:
        metrics["tlt/drafter_expected_speedup"] = stats.expected_speedup
    if stats.draft_vocab_coverage is not None:
        metrics["tlt/draft_vocab_coverage"] = stats.draft_vocab_coverage
        metrics["tlt/draft_vocab_revisions"] = float(spot.vocab.num_revisions)
    return metrics


def vllm_rollout_metrics(
    seconds: float, num_tokens: int, stats: dict[str, float] | None, faults: tuple[int, int] | None = None
) -> dict[str, float]:
    """One generation turn of vLLM; `faults`: (regenerated rollouts, drafter re-pushes) where vLLM colocate speculates
    with a drafter."""
    metrics = {"tlt/rollout_seconds": seconds, "tlt/rollout_tokens_per_second": num_tokens / max(seconds, 1e-9)}
    if stats is not None:
        metrics["tlt/mean_acceptance_length"] = stats["mean_acceptance_length"]
        metrics["tlt/draft_acceptance_rate"] = stats["draft_acceptance_rate"]
    if faults is not None:
        metrics["tlt/vllm_spec_faults"], metrics["tlt/drafter_repushes"] = faults
    return metrics
