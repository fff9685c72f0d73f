"""Drafter training by distillation toward the policy's next-token distribution (EAGLE-3 head or small LM).

The loss is the forward KL from the policy's distribution to the drafter's, computed by liger-kernel's chunked
fused-linear JSD loss (beta = 0): neither side's vocabulary-sized logits are ever materialized for the whole
sequence. Only completion tokens count. The EAGLE-3 head trains with the training-time test (TTT): `ttt_length`
unrolled draft steps, step j weighted by `step_weights[j]`, over packed rows whose samples never attend across
each other. An optional SmoothL1 term regresses the drafter's normed output onto the policy's last hidden state
(as the TLT reference does with EAGLE-1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss
from transformers import PretrainedConfig, PreTrainedModel

from ..drafters.eagle3 import Eagle3Model, shift_left


@dataclass
class DrafterSample:
    """One rollout: `token_ids` = prompt + completion; only the completion's tokens are trained on.

    `features`: the policy's hidden states the rollout's forwards computed at every position but the last,
    (len(token_ids) - 1, m, H): the drafter's m - 1 auxiliary layers, then the last layer (`FeatureRecorder`). None:
    drafter training runs the policy over the sample (`policy_features`). `version`: the policy's optimizer steps
    when they were computed (None: no features recorded).
    """

    token_ids: list[int]
    prompt_length: int
    features: torch.Tensor | None = field(default=None, repr=False)
    version: int | None = None


@dataclass
class PolicyView:
    """What drafter training reads of the policy.

    `head_weight` (V, H): its LM head (the policy's distribution from the last hidden states a rollout recorded; a
    sharded policy's whole copy, `PolicyWeights.output_embedding`). `config`: its config (the layers features are
    recorded at). `model`: the policy, run over samples whose rollout recorded no features; None for a policy sharded
    across processes, whose forward is a collective the other ranks would not join then: such samples are dropped.
    """

    head_weight: torch.Tensor
    config: PretrainedConfig
    model: PreTrainedModel | None = None

    @classmethod
    def of(cls, policy: PreTrainedModel | PolicyView) -> PolicyView:
        """A whole policy's view (one already made is returned as it is)."""
        if isinstance(policy, PolicyView):
            return policy
        return cls(policy.get_output_embeddings().weight, policy.config, policy)


@dataclass
class Features:
    """The policy's view of one sample: aux hidden states (N, 3H; None for LM drafters) and last (normed) hidden
    states (N, H)."""

    sample: DrafterSample
    aux: torch.Tensor | None
    last: torch.Tensor


@dataclass
class DistillConfig:
    """Drafter-training settings.

    Args:
        ttt_length: Unrolled draft steps of the EAGLE-3 training-time test.
        step_weights: Weight of each TTT step (default 0.8 ** j, as SpecForge).
        hidden_loss_weight: Weight of the SmoothL1 regression onto the policy's last hidden state (0 = off).
        max_tokens_per_batch: Packed tokens per optimizer step.
        chunk_size: Rows per chunk of the fused-linear loss.
    """

    ttt_length: int = 4
    step_weights: list[float] | None = None
    hidden_loss_weight: float = 0.0
    max_tokens_per_batch: int = 4096
    chunk_size: int = 1024
    weights: list[float] = field(init=False)

    def __post_init__(self):
        if self.ttt_length < 1:
            raise ValueError(f"`ttt_length` must be >= 1, got {self.ttt_length}.")
        self.weights = list(self.step_weights or [0.8**j for j in range(self.ttt_length)])
        if len(self.weights) != self.ttt_length:
            raise ValueError(f"`step_weights` needs {self.ttt_length} entries (ttt_length), got {len(self.weights)}.")


@torch.no_grad()
def policy_features(
    policy: PreTrainedModel, samples: list[DrafterSample], aux_layer_ids: list[int], batch_size: int = 16
) -> list[Features]:
    """One forward of the policy per batch of samples (right-padded); hidden states stay on the policy's device."""
    out: list[Features] = []
    device = policy.device
    for begin in range(0, len(samples), batch_size):
        batch = samples[begin : begin + batch_size]
        width = max(len(s.token_ids) for s in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, s in enumerate(batch):
            ids[i, : len(s.token_ids)] = torch.tensor(s.token_ids)
            mask[i, : len(s.token_ids)] = 1
        decoder = policy.get_decoder()  # the transformer body: no vocabulary-sized logits (also through peft)
        result = decoder(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
        aux = torch.cat([result.hidden_states[i] for i in aux_layer_ids], dim=-1) if aux_layer_ids else None
        for i, s in enumerate(batch):
            n = len(s.token_ids)
            out.append(
                Features(s, None if aux is None else aux[i, :n].clone(), result.last_hidden_state[i, :n].clone())
            )
    return out


def recorded_features(sample: DrafterSample, with_aux: bool, device) -> Features:
    """`Features` from what the rollout recorded (`sample.features`), on `device`. The last position's state, never
    computed (its token was the last sampled), is zeros: no loss reads it (`pack`'s and `lm_distill_loss`'s masks end
    at the token before)."""
    states = sample.features.to(device)
    last = torch.cat([states[:, -1], states.new_zeros((1, states.size(-1)))])
    return Features(sample, states[:, :-1].flatten(1) if with_aux else None, last)


def sample_features(
    policy: PreTrainedModel, drafter, samples: list[DrafterSample], batch_size: int = 16
) -> list[Features]:
    """The policy's view of `samples` for `drafter` (an `Eagle3Model` reads its auxiliary layers, a small LM none):
    what their rollout recorded, and a forward of the policy, `batch_size` samples at a time, over the others (vLLM's
    rollouts, a dataset's own completions)."""
    is_eagle = isinstance(drafter, Eagle3Model)
    device = policy.get_output_embeddings().weight.device
    missing = [s for s in samples if s.features is None]
    computed = iter(policy_features(policy, missing, drafter.aux_layer_ids if is_eagle else [], batch_size))
    return [recorded_features(s, is_eagle, device) if s.features is not None else next(computed) for s in samples]


@dataclass
class PackedBatch:
    """Drafter index t of a sample pairs the policy's state at position t with token t+1 (length N-1).

    `teacher[t]` is the policy's last hidden state at position t+1 (its distribution over token t+2), and
    `loss_mask[t]` marks indices whose predicted token t+2 is a completion token that exists.
    """

    input_ids: torch.Tensor  # (B, T)
    aux: torch.Tensor  # (B, T, 3H)
    teacher: torch.Tensor  # (B, T, H)
    position_ids: torch.Tensor  # (B, T)
    seq_ids: torch.Tensor  # (B, T), 0 = padding
    loss_mask: torch.Tensor  # (B, T) bool


def pack(features: list[Features], max_tokens: int, pad_to_multiple_of: int = 1) -> list[PackedBatch]:
    """First-fit packing of samples into rows of at most `max_tokens` (longer samples get a row of their own), each
    row padded to a multiple of `pad_to_multiple_of` (padding: `seq_ids` 0, attended by nothing else, in no loss)."""
    rows: list[list[Features]] = []
    sizes: list[int] = []
    for f in sorted(features, key=lambda f: -len(f.sample.token_ids)):
        n = len(f.sample.token_ids) - 1
        for i, size in enumerate(sizes):
            if size + n <= max_tokens:
                rows[i].append(f)
                sizes[i] += n
                break
        else:
            rows.append([f])
            sizes.append(n)
    # One row per batch: rows are already up to max_tokens long.
    return [_pack_row(row, pad_to_multiple_of) for row in rows]


def _pack_row(row: list[Features], pad_to_multiple_of: int = 1) -> PackedBatch:
    ids, aux, teacher, pos, seq, mask = [], [], [], [], [], []
    for sid, f in enumerate(row, start=1):
        tokens, n, p = f.sample.token_ids, len(f.sample.token_ids) - 1, f.sample.prompt_length
        ids.append(torch.tensor(tokens[1:]))
        aux.append(f.aux[:n])
        teacher.append(f.last[1:])
        pos.append(torch.arange(n))
        seq.append(torch.full((n,), sid))
        t = torch.arange(n)
        mask.append((t >= p - 2) & (t <= n - 2))  # predicted token t+2 is a completion token, inside the sample
    padding = -sum(map(len, ids)) % pad_to_multiple_of
    if padding:
        ids.append(torch.zeros(padding, dtype=torch.long))
        aux.append(aux[0].new_zeros((padding, aux[0].size(-1))))
        teacher.append(teacher[0].new_zeros((padding, teacher[0].size(-1))))
        pos.append(torch.zeros(padding, dtype=torch.long))
        seq.append(torch.zeros(padding, dtype=torch.long))
        mask.append(torch.zeros(padding, dtype=torch.bool))
    device = aux[0].device
    return PackedBatch(
        input_ids=torch.cat(ids)[None].to(device),
        aux=torch.cat(aux)[None],
        teacher=torch.cat(teacher)[None],
        position_ids=torch.cat(pos)[None].to(device),
        seq_ids=torch.cat(seq)[None].to(device),
        loss_mask=torch.cat(mask)[None].to(device),
    )


def distill_kl(
    student_in: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_in: torch.Tensor,
    teacher_weight: torch.Tensor,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """Mean over rows of KL(policy || drafter), chunked and fused with both LM heads (liger-kernel)."""
    loss_fn = LigerFusedLinearJSDLoss(
        weight_hard_loss=0.0,
        weight_soft_loss=1.0,
        beta=0.0,  # generalized JSD at beta 0 = forward KL(teacher || student)
        compiled=student_in.is_cuda,
        chunk_size=chunk_size,
    )
    labels = torch.zeros(student_in.size(0), dtype=torch.long, device=student_in.device)
    return loss_fn(student_in, student_weight, teacher_in.to(student_in.dtype), teacher_weight, labels)


@torch.no_grad()
def top1_ids(hidden: torch.Tensor, weight: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """The most likely token of each row of `hidden` (..., H) under the LM head `weight` (V, H), chunked over rows."""
    rows = hidden.reshape(-1, hidden.size(-1))
    ids = [(chunk.to(weight.dtype) @ weight.t()).argmax(-1) for chunk in rows.split(chunk_size)]
    return torch.cat(ids).reshape(hidden.shape[:-1]) if ids else rows.new_zeros(hidden.shape[:-1], dtype=torch.long)


@torch.no_grad()
def top1_agreement(student_in, student_weight, teacher_in, teacher_weight, chunk_size: int = 1024) -> float:
    """Fraction of rows where drafter and policy agree on the most likely token (chunked)."""
    hits = top1_ids(student_in, student_weight, chunk_size) == top1_ids(teacher_in, teacher_weight, chunk_size)
    return int(hits.sum()) / max(student_in.size(0), 1)


def eagle3_loss(
    head: Eagle3Model,
    policy_head_weight: torch.Tensor,
    batch: PackedBatch,
    config: DistillConfig,
    agreement: bool = True,
    loss: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """TTT distillation loss of one packed batch; returns the loss and per-step metrics (`kl_j`, and with `agreement`
    the top-1 agreement `acc_j`: the policy's top token once per position, the drafter's per step). `loss=False`:
    the agreement alone (an evaluation), the loss 0."""
    teacher_weight = policy_head_weight.detach()[head.draft_ids]
    fused = head.fc(batch.aux.to(head.fc.weight.dtype))
    outputs = head.ttt_forward(batch.input_ids, fused, batch.position_ids, batch.seq_ids, config.ttt_length)
    total = fused.new_zeros(())
    metrics: dict[str, float] = {}
    policy_top = top1_ids(batch.teacher, teacher_weight, config.chunk_size) if agreement else None
    for j, prenorm in enumerate(outputs):
        same = shift_left(batch.seq_ids, j, -1) == batch.seq_ids
        mask = shift_left(batch.loss_mask, j, False) & same & (batch.seq_ids > 0)
        if not mask.any():
            continue
        student = head.norm(prenorm)[mask]
        if agreement:
            hits = (
                top1_ids(student.detach(), head.lm_head.weight, config.chunk_size)
                == shift_left(policy_top, j, -1)[mask]
            )
            metrics[f"acc_{j}"] = float(hits.float().mean())
        if not loss:
            continue
        teacher = shift_left(batch.teacher, j, 0.0)[mask]
        kl = distill_kl(student, head.lm_head.weight, teacher, teacher_weight, config.chunk_size)
        total = total + config.weights[j] * kl
        metrics[f"kl_{j}"] = float(kl.detach())
        if config.hidden_loss_weight:
            total = total + config.hidden_loss_weight * F.smooth_l1_loss(student, teacher.to(student.dtype))
    return total, metrics


def lm_distill_loss(
    drafter: PreTrainedModel, policy_head_weight: torch.Tensor, features: list[Features], chunk_size: int = 1024
) -> tuple[torch.Tensor, dict[str, float]]:
    """Small-LM drafter (full or PEFT-LoRA): next-token distillation on completion tokens, one padded batch."""
    width = max(len(f.sample.token_ids) for f in features)
    device = drafter.device
    ids = torch.zeros((len(features), width), dtype=torch.long, device=device)
    attn = torch.zeros_like(ids)
    for i, f in enumerate(features):
        ids[i, : len(f.sample.token_ids)] = torch.tensor(f.sample.token_ids, device=device)
        attn[i, : len(f.sample.token_ids)] = 1
    hidden = drafter(input_ids=ids, attention_mask=attn, output_hidden_states=True, logits_to_keep=1).hidden_states[-1]
    students, teachers = [], []
    for i, f in enumerate(features):
        n, p = len(f.sample.token_ids), f.sample.prompt_length
        students.append(hidden[i, p - 1 : n - 1])  # position t predicts token t+1, a completion token
        teachers.append(f.last[p - 1 : n - 1])
    vocab = policy_head_weight.size(0)
    student_weight = drafter.get_output_embeddings().weight[:vocab]
    student, teacher = torch.cat(students), torch.cat(teachers)
    loss = distill_kl(student, student_weight, teacher, policy_head_weight.detach(), chunk_size)
    acc = top1_agreement(student.detach(), student_weight, teacher, policy_head_weight)
    return loss, {"kl_0": float(loss.detach()), "acc_0": acc}
