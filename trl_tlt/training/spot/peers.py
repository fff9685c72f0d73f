"""`Peers`: spot training's own process group (gloo), and every collective it runs on it, none ever a wait forever."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


class Peers:
    """The ranks' drafters' process group: a dedicated gloo group, so the drafter never touches the policy's. Its
    timeout (the trainer's `ddp_timeout`) bounds every wait: a rank that died or hangs becomes an error naming this rank
    and the phase.

    Example:
        >>> peers = Peers(dist.new_group(backend="gloo"))
        >>> peers.all_reduce(torch.ones(1), "the merge of the ranks' drafters")
    """

    def __init__(self, group):
        self.group = group

    @contextlib.contextmanager
    def answering(self, phase: str):
        """A collective with the other ranks: if one of them died or hangs, an error naming this rank and `phase`."""
        try:
            yield
        except RuntimeError as error:  # gloo: connection closed by a dead peer, or timed out
            raise RuntimeError(
                f"Spot training, {phase}: rank {dist.get_rank()} got no answer from the other ranks ({error}). One of "
                "them died or hangs (the wait is bounded by `ddp_timeout`). Resume from the last checkpoint (its "
                "drafter/ folder holds the drafter)."
            ) from error

    def all_reduce(self, tensor: torch.Tensor, phase: str, async_op: bool = False):
        """Sum `tensor` (a host tensor) over the ranks, in place; `async_op`: return the work to wait on."""
        with self.answering(phase):
            return dist.all_reduce(tensor, group=self.group, async_op=async_op)

    @torch.no_grad()
    def average(self, params: list[torch.Tensor], weight: float) -> None:
        """Each parameter replaced by the sum over ranks of `weight` x that rank's (weights summing to 1)."""
        flat = torch.cat([p.detach().float().cpu().reshape(-1) for p in params]) * weight
        self.all_reduce(flat, "the merge of the ranks' drafters")
        for p, merged in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.copy_(merged.view_as(p))

    @torch.no_grad()
    def broadcast_from_first(self, params: list[torch.Tensor]) -> None:
        """Every rank's parameters made the first rank's."""
        for p in params:
            buf = p.detach().cpu().clone()
            with self.answering("the first rank's broadcast of the initial drafter"):
                dist.broadcast(buf, src=dist.get_global_rank(self.group, 0), group=self.group)
            p.copy_(buf.to(p.device))
