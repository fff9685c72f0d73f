"""Training micro-batches without the long tail's padding.

TRL's GRPOTrainer pads a whole generation batch to its longest completion, shuffles it and splits it into
`steps_per_generation` micro-batches; every forward over completions (the loss, and the old / reference log-prob
passes) then costs as if every row were as long as the tail. Two exact remedies:

- **Trim.** A forward over rows whose completions end before column L needs only the first L completion columns:
  the model is causal, so dropping trailing columns changes no earlier position, and the dropped positions are
  masked in every loss. `trimmed_logps_and_entropies` runs each chunk of rows at its own longest completion and
  pads the outputs back (with zeros, under the mask), so the loss sees the tensors it always saw. In the no-grad
  log-prob passes, rows are sorted by length before chunking, so each chunk is short or long, not both. The number
  of forwards per call is TRL's (`ceil(rows / batch_size)`), so ZeRO-3 / FSDP ranks still gather in lockstep.
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


def completion_lengths(attention_mask: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
    """(B,) one past the last attended completion column of each row (0 for a row whose completion is masked)."""
    mask = attention_mask[:, -logits_to_keep:].bool()  # (B, C)
    columns = torch.arange(1, logits_to_keep + 1, device=mask.device)
    return (mask * columns).amax(dim=1)


def trimmed_logps_and_entropies(
    forward: Callable[[torch.Tensor, torch.Tensor, int], tuple],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    batch_size: int | None,
    sort_rows: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """GRPOTrainer's per-token log-probs / entropies / aux loss, each chunk of rows run at its own longest completion.

    Args:
        forward: `(input_ids, attention_mask, logits_to_keep) -> (logps, entropies | None, aux_loss | None)` for one
            chunk (GRPOTrainer's own method, called with `batch_size=None`).
        input_ids, attention_mask: (B, P + C): left-padded prompts, right-padded completions.
        logits_to_keep: C, the completion width.
        batch_size: Rows per forward (None = all rows in one forward, as in the loss).
        sort_rows: Sort rows by completion length before chunking (exact whenever rows do not interact: the log-prob
            passes; not with an aux loss, which is averaged per chunk).

    Returns:
        logps (B, C), entropies (B, C) or None, and the aux loss averaged over chunks (or None), in the input's row
        order; positions past a row's chunk width are 0 (masked in every use).
    """
    rows = input_ids.size(0)
    batch_size = batch_size or rows
    lengths = completion_lengths(attention_mask, logits_to_keep)
    order = torch.argsort(lengths, stable=True) if sort_rows else torch.arange(rows, device=lengths.device)
    prompt_width = input_ids.size(1) - logits_to_keep
    logps, entropies, aux_losses = [], [], []
    for start in range(0, rows, batch_size):
        chunk = order[start : start + batch_size]
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
