"""How a drafter step runs its arithmetic on the drafter's device: bf16 autocast where asked, denormals flushed on a
CPU."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def flushing_denormals(device: torch.device):
    """A drafter step on CPU with denormals flushed to zero (a new head's cold start leaves them in its float32
    products: its steps ran twice as slow). PyTorch's default, off, is restored after: the policy is untouched."""
    if device.type != "cpu":
        yield
        return
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def autocast(device: torch.device, dtype: torch.dtype | None):
    """`torch.autocast` in `dtype` on `device` (None: float32 throughout, no autocast)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)
