"""What the engine does for a policy whose parameters are sharded across processes (FSDP1, FSDP2, DeepSpeed ZeRO-3).

Such a policy gathers its parameters inside every forward: each forward is a collective, so every rank must run as
many forwards as the others, in the same order. transformers' `generate` keeps them in step with `synced_gpus` (a rank
whose rows are done keeps forwarding until every rank is done); the engine does the same, with the same protocol:

    prefill                       # one forward on every rank
    loop:
        any_left = all_reduce_sum(1.0 if this rank has rows else 0.0)     # generate's `_has_unfinished_sequences`
        if any_left == 0: stop
        this rank has rows ? one decode step (one policy forward) : one placeholder forward (outputs ignored)

Speculation stays per rank (each rank drafts, verifies and accepts its own rows exactly as alone); only the count of
policy forwards is agreed. Drafters never run a policy collective: the weights a drafter shares with the policy (an
EAGLE-3 head reads its input embedding; drafter training its LM head) are copied whole while the prefill has them
gathered (`PolicyWeights`), once per `generate` call.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import PreTrainedModel


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def policy_is_sharded(model: torch.nn.Module) -> bool:
    """Whether `model`'s forwards run collectives with the other processes, transformers' rule for `synced_gpus`: a
    module managed by FSDP2 (`fully_shard`) or FSDP1 (`FullyShardedDataParallel`), or ZeRO-3 parameters (`ds_id`),
    gathered or not: within TRL's `ds3_gather_for_generation` context DeepSpeed's root hook still synchronises the
    first forwards after each gather (a broadcast), so the ranks' forward counts must agree there too."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    if any(isinstance(module, FSDPModule | FullyShardedDataParallel) for module in model.modules()):
        return True
    return any(hasattr(p, "ds_id") for p in model.parameters())  # duck-typed: deepspeed need not be importable


def agreed_count(count: int, rows: int, device: torch.device) -> int:
    """What every process of the default group runs when each wants `count` forwards over its `rows` rows: the most any
    wants, at most the fewest rows any has (a forward needs a row). A collective: every rank calls it alike."""
    counts = torch.tensor([count, -rows], device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    return min(int(counts[0]), -int(counts[1]))


def is_fsdp1(model: torch.nn.Module) -> bool:
    """Whether `model` holds FSDP1 units (`FullyShardedDataParallel`, flat parameters)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(module, FullyShardedDataParallel) for module in model.modules())


def needs_lockstep(model: torch.nn.Module) -> bool:
    """transformers' rule for `synced_gpus`, on what the engine runs: a sharded policy and more than one process."""
    return _world_size() > 1 and policy_is_sharded(model)


@contextlib.contextmanager
def whole_parameters(*params: torch.nn.Parameter):
    """Within it, `params` are whole: ZeRO-3 partitioned ones gathered (DeepSpeed's `GatheredParameters`, a collective
    every rank enters alike, e.g. at construction), the others as they are."""
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned):
        yield


class Lockstep:
    """generate's `synced_gpus` protocol on the default process group (see the module docstring)."""

    def __init__(self, model: PreTrainedModel, pad_token_id: int):
        self.model, self.pad_token_id = model, pad_token_id
        self.placeholder_forwards = 0

    def any_rank_unfinished(self, this_rank_unfinished: bool) -> bool:
        flag = torch.tensor(1.0 if this_rank_unfinished else 0.0, device=self.model.device)
        dist.all_reduce(flag, op=dist.ReduceOp.SUM)
        return flag.item() > 0.0

    @torch.no_grad()
    def placeholder_forward(self) -> None:
        """A forward whose outputs are ignored, for the collectives a finished rank owes the others: the whole model,
        as a decode step runs it (every sharded module gathers its parameters in the same order)."""
        ids = torch.full((1, 1), self.pad_token_id, dtype=torch.long, device=self.model.device)
        self.model(input_ids=ids, use_cache=False, logits_to_keep=1)
        self.placeholder_forwards += 1


@dataclass
class PolicyWeights:
    """Whole copies of the policy weights its drafter shares, for a policy whose own are shards between forwards.

    `input_embedding` (V, H) is what an EAGLE-3 head embeds tokens with; `output_embedding` (V, H) the LM head drafter
    training builds the policy's distribution with (the same tensor when the policy ties them); None where nothing
    reads it. A copy of V x H (two if untied) per rank, taken only where something reads it, and let go once read.
    """

    input_embedding: torch.Tensor | None = None
    output_embedding: torch.Tensor | None = None


WEIGHT_NAMES = ("input_embedding", "output_embedding")  # the `PolicyWeights` fields


def _embedding_modules(model: PreTrainedModel, names) -> dict[str, torch.nn.Module]:
    modules = {"input_embedding": model.get_input_embeddings(), "output_embedding": model.get_output_embeddings()}
    if any(modules[name] is None for name in names):
        raise ValueError(
            f"{type(model).__name__} has no input or output embedding module (`get_input_embeddings` / "
            "`get_output_embeddings`): the engine cannot copy the weights its drafter shares from a sharded policy."
        )
    return {name: modules[name] for name in names}


def whole_policy_weights(model: PreTrainedModel, names=WEIGHT_NAMES) -> PolicyWeights:
    """Whole copies of the weights `names` of a policy sharded across processes, taken between its forwards: an FSDP2
    shard all-gathered (`DTensor.full_tensor`), a ZeRO-3 partition gathered (`GatheredParameters`). A collective in
    both: every rank calls it at the same point, with the same `names`. A policy whole on each rank: its own weights."""
    from torch.distributed.tensor import DTensor

    if is_fsdp1(model):
        raise NotImplementedError(
            "Drafter training on the training step's features needs the policy's embedding and LM head whole, which "
            "trl-tlt gathers under FSDP2 and ZeRO-3, not FSDP1's flat parameters. Use FSDP2 (`fsdp_version: 2`, the "
            "shipped `fsdp2` accelerate config), or spot_feature_source='rollout' (trl-tlt's engine), or "
            "spot_training=False."
        )
    copies: dict[str, torch.Tensor] = {}
    whole: dict[int, torch.Tensor] = {}  # by parameter: a tied LM head is copied once
    for name, module in _embedding_modules(model, names).items():
        weight = module.weight
        if id(weight) not in whole:
            if isinstance(weight, DTensor):
                whole[id(weight)] = weight.detach().full_tensor()
            elif hasattr(weight, "ds_id"):
                with whole_parameters(weight):
                    whole[id(weight)] = weight.detach().clone()
            else:
                whole[id(weight)] = weight.detach()
        copies[name] = whole[id(weight)]
    return PolicyWeights(**copies)


@contextlib.contextmanager
def copying_policy_weights(model: PreTrainedModel, names=WEIGHT_NAMES):
    """Within it, the model's next forward fills the yielded dict with whole copies of its embedding weights `names`
    (`PolicyWeights` fields), taken in forward pre-hooks: after the hooks of FSDP and ZeRO-3, which gather a
    module's parameters before it runs, in every backend."""
    copies: dict[str, torch.Tensor] = {}
    modules = _embedding_modules(model, names)

    def copy(name):
        def hook(module, args):
            if name not in copies:
                weight = module.weight.detach()
                tied = next((w for w in copies.values() if torch.equal(w, weight)), None)  # one copy serves both
                copies[name] = tied if tied is not None else weight.clone()

        return hook

    handles = [module.register_forward_pre_hook(copy(name)) for name, module in modules.items()]
    try:
        yield copies
    finally:
        for handle in handles:
            handle.remove()
