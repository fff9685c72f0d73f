"""Training micro-batches without the long tail's padding.

TRL's GRPOTrainer pads a whole generation batch to its longest completion, shuffles it and splits it into
`steps_per_generation` micro-batches; every forward over completions (the loss, and the old / reference log-prob
passes) then costs as if every row were as long as the tail. Two exact remedies:

- **Trim and cut.** A forward over rows whose completions end before column L needs only the first L completion
  columns: the model is causal, so dropping trailing columns changes no earlier position, and the dropped positions
  are masked in every loss. `trimmed_logps_and_entropies` sorts the rows by length, cuts them into sub-chunks
  (`length_sorted_chunks`: where a cut saves more padded positions than a forward costs), runs each at its own longest
  completion and puts the outputs back in the rows' order, padded back with zeros under the mask, so the loss sees the
  tensors it always saw. Under FSDP / ZeRO-3 (each forward gathers parameters) the ranks agree on the count of
  forwards per call (`with_count`), so they still gather in lockstep.
- **Group.** Sorting the rows of one optimizer step (the micro-batches accumulated together) by length before
  dealing them into equal-size micro-batches (`group_by_length`) leaves the loss exactly unchanged for the loss
  types whose per-micro-batch normalisation is a function of the row count only (see `REGROUPABLE_LOSS_TYPES`).

Example:
    >>> groups = group_by_length(trainer._buffered_inputs, gradient_accumulation_steps=4)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


# Loss types whose accumulated loss over one optimizer step is the same whatever rows form each micro-batch (of equal
# size): per-sequence means averaged over rows (grpo, sapo, luspo), a constant normaliser (dr_grpo), or the token
# count of the whole generation batch (dapo, cispo, vespo). bnpo divides by each micro-batch's own token count:
# regrouping changes it, so bnpo gets trim-only.
REGROUPABLE_LOSS_TYPES = ("grpo", "sapo", "luspo", "dr_grpo", "dapo", "cispo", "vespo")

# What one more forward over completions costs, in padded positions (`TLTConfig.micro_batching_split_tokens`'s default):
# on a CPU, measured (docs/trainer.md); on an accelerator, a guess: below a few thousand tokens a GPU's forward is
# launch- and memory-bound, and a cut that saves fewer positions than this would only add launches.
SPLIT_TOKENS = {"cpu": 64, "accelerator": 4096}


def regroups_micro_batches(
    args, loss_type: str, top_entropy_quantile: float, entropy_bonus: bool, aux_loss: bool
) -> bool:
    """Whether sorting an optimizer step's rows into micro-batches by length leaves the loss exactly unchanged (`args`:
    the trainer's `TLTConfig`; the rest as GRPOTrainer resolved them)."""
    return (
        args.micro_batching == "length_grouped"
        and loss_type in REGROUPABLE_LOSS_TYPES
        and top_entropy_quantile == 1.0  # its threshold is a quantile over each micro-batch
        and not entropy_bonus  # a per-micro-batch mean
        and not aux_loss  # averaged per micro-batch
        and not args.use_liger_kernel  # Liger's fused loss aggregates on its own (unverified here)
        and args.gradient_accumulation_steps > 1
        and args.steps_per_generation % args.gradient_accumulation_steps == 0  # windows = optimizer steps
    )


def split_tokens_for(device: torch.device, configured: int | None) -> int:
    """`micro_batching_split_tokens`, resolved for the policy's device."""
    if configured is not None:
        return configured
    return SPLIT_TOKENS["cpu" if device.type == "cpu" else "accelerator"]


def completion_lengths(attention_mask: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
    """(B,) one past the last attended completion column of each row (0 for a row whose completion is masked)."""
    mask = attention_mask[:, -logits_to_keep:].bool()  # (B, C)
    columns = torch.arange(1, logits_to_keep + 1, device=mask.device)
    return (mask * columns).amax(dim=1)


def length_sorted_chunks(
    lengths: list[int], prompt_width: int, max_rows: int, split_tokens: int
) -> list[tuple[int, int]]:
    """Rows sorted by completion length (`lengths`, ascending) cut into contiguous chunks `[start, end)` of at most
    `max_rows` rows, each to run at its own longest row: the cut that minimises the padded positions the forwards
    cover, `sum(rows x (prompt_width + longest))`, plus `split_tokens` per forward (what a forward costs beyond its
    tokens, in tokens: a split is made only where it saves more than that). Dynamic programming over the cut points,
    O(rows x max_rows)."""
    rows = len(lengths)
    widths = torch.tensor(lengths, dtype=torch.float64) + prompt_width
    best = torch.full((rows + 1,), float("inf"), dtype=torch.float64)
    best[0] = 0.0
    cut = [0] * (rows + 1)
    for end in range(1, rows + 1):
        starts = torch.arange(max(0, end - max_rows), end)
        # a chunk [start, end) costs its rows times its longest row's width (the last: rows are sorted)
        costs = best[starts] + (end - starts) * widths[end - 1] + split_tokens
        i = int(torch.argmin(costs))
        best[end], cut[end] = costs[i], int(starts[i])
    bounds, end = [], rows
    while end > 0:
        bounds.append((cut[end], end))
        end = cut[end]
    return bounds[::-1]


def with_count(bounds: list[tuple[int, int]], lengths: list[int], count: int) -> list[tuple[int, int]]:
    """`bounds` made exactly `count` chunks (at most one per row): the chunk whose best split saves the most padded
    completion positions split while there are fewer, the adjacent pair whose merge adds the fewest merged while there
    are more. What every rank of a sharded policy does to run the same number of forwards."""
    bounds = list(bounds)

    def tokens(start, end):  # completion positions a chunk covers (the prompt's are the same either way)
        return (end - start) * lengths[end - 1]

    while len(bounds) < count:
        options = [
            (tokens(a, b) - tokens(a, m) - tokens(m, b), i, m)
            for i, (a, b) in enumerate(bounds)
            for m in range(a + 1, b)
        ]
        _, i, m = max(options)
        a, b = bounds[i]
        bounds[i : i + 1] = [(a, m), (m, b)]
    while len(bounds) > count:
        options = [
            (tokens(bounds[i][0], bounds[i + 1][1]) - tokens(*bounds[i]) - tokens(*bounds[i + 1]), i)
            for i in range(len(bounds) - 1)
        ]
        _, i = min(options)
        bounds[i : i + 2] = [(bounds[i][0], bounds[i + 1][1])]
    return bounds


def trimmed_logps_and_entropies(
    forward: Callable[[torch.Tensor, torch.Tensor, int], tuple],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    batch_size: int | None,
    sort_rows: bool,
    split_tokens: int = 0,
    agree_count: Callable[[int, int], int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """GRPOTrainer's per-token log-probs / entropies / aux loss, each chunk of rows run at its own longest completion.

    With `sort_rows`, the rows are sorted by completion length and cut into chunks by `length_sorted_chunks` (at most
    `batch_size` rows each, a split wherever it saves more than `split_tokens` padded positions): one forward per
    chunk, in one autograd graph when gradients are on. The outputs are per position, put back in the input's row
    order: every loss and its normalisation read the tensors they always read, only the layout changes.

    Args:
        forward: `(input_ids, attention_mask, logits_to_keep) -> (logps, entropies | None, aux_loss | None)` for one
            chunk (GRPOTrainer's own method, called with `batch_size=None`).
        input_ids, attention_mask: (B, P + C): left-padded prompts, right-padded completions.
        logits_to_keep: C, the completion width.
        batch_size: Rows per forward at most (None = all rows, as in the loss).
        sort_rows: Sort rows by completion length and cut them as above (exact whenever rows do not interact: not with
            an MoE aux loss, averaged per chunk: TRL's chunks are kept then, each trimmed).
        split_tokens: What a forward costs beyond its tokens, in padded positions.
        agree_count: `(chunks, rows) -> chunks` every process runs (a sharded policy: each forward is a collective),
            None for one process or a policy whole on each.

    Returns:
        logps (B, C), entropies (B, C) or None, and the aux loss averaged over chunks (or None), in the input's row
        order; positions past a row's chunk width are 0 (masked in every use).
    """
    rows = input_ids.size(0)
    batch_size = batch_size or rows
    lengths = completion_lengths(attention_mask, logits_to_keep)
    prompt_width = input_ids.size(1) - logits_to_keep
    if sort_rows:
        order = torch.argsort(lengths, stable=True)
        sorted_lengths = [max(n, 1) for n in lengths[order].tolist()]
        bounds = length_sorted_chunks(sorted_lengths, prompt_width, batch_size, split_tokens)
        if agree_count is not None:
            bounds = with_count(bounds, sorted_lengths, agree_count(len(bounds), rows))
    else:  # TRL's chunks, in TRL's order
        order = torch.arange(rows, device=lengths.device)
        bounds = [(start, min(start + batch_size, rows)) for start in range(0, rows, batch_size)]
    logps, entropies, aux_losses = [], [], []
    for start, end in bounds:
        chunk = order[start:end]
        keep = max(int(lengths[chunk].max()), 1)
        width = prompt_width + keep
        chunk_logps, chunk_entropies, aux_loss = forward(input_ids[chunk, :width], attention_mask[chunk, :width], keep)
        logps.append(F.pad(chunk_logps, (0, logits_to_keep - keep)))
        if chunk_entropies is not None:
            entropies.append(F.pad(chunk_entropies, (0, logits_to_keep - keep)))
        if aux_loss is not None:
            aux_losses.append(aux_loss)
    inverse = torch.argsort(order)
    logps = torch.cat(logps)[inverse]
    entropies = torch.cat(entropies)[inverse] if entropies else None
    aux_loss = torch.stack(aux_losses).mean() if aux_losses else None
    return logps, entropies, aux_loss


def _concat(batches: list[dict]) -> dict:
    """Inverse of TRL's `split_tensor_dict`: row-wise tensors and lists concatenated, the rest taken once."""
    out = {}
    for key, first in batches[0].items():
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            out[key] = torch.cat([b[key] for b in batches])
        elif isinstance(first, list):
            out[key] = [row for b in batches for row in b[key]]
        else:
            out[key] = first
    return out


def _take(batch: dict, rows: torch.Tensor) -> dict:
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            out[key] = value[rows.to(value.device)]
        elif isinstance(value, list):
            out[key] = [value[i] for i in rows.tolist()]
        else:
            out[key] = value
    return out


def group_by_length(micro_batches: list[dict], gradient_accumulation_steps: int) -> list[dict]:
    """Within each run of `gradient_accumulation_steps` micro-batches (one optimizer step), deal the rows sorted by
    completion length into micro-batches of the same sizes, shortest first. The set of rows per optimizer step, the
    number of rows per micro-batch and each row's tensors are unchanged."""
    grouped = []
    for start in range(0, len(micro_batches), gradient_accumulation_steps):
        window = micro_batches[start : start + gradient_accumulation_steps]
        sizes = [len(b["completion_mask"]) for b in window]
        merged = _concat(window)
        mask = merged["completion_mask"]
        order = torch.argsort(completion_lengths(mask, mask.size(1)), stable=True)
        offsets = torch.tensor([0, *sizes]).cumsum(0).tolist()
        grouped += [_take(merged, order[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]
    return grouped
