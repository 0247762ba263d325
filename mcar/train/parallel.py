"""How a model is trained at scale, applied from outside (torchtitan's `parallelize`): activation checkpointing,
per-block torch.compile and FSDP2 sharding, each per transformer Block. None of this edits `mcar.core.model`: blocks
are wrapped or sharded in place in `model.layers`, and state_dict keys stay those of the plain model.

Order matters (as in torchtitan): checkpoint wrapper, then compile, then fully_shard, so that each FSDP unit is
one compiled, checkpointed block.
"""
from __future__ import annotations

import torch
from torch import nn

try:  # torch >= 2.6
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
except ImportError:  # torch 2.5
    from torch.distributed._composable.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each Block's activations in the backward pass: only a block's input is kept per layer."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    for i, block in enumerate(model.layers):
        if not is_checkpointed(block):
            # non-reentrant: keyword/None arguments and a BlockMask pass through; its state_dict hooks drop the
            # wrapper's prefix, so checkpoints stay interchangeable with unwrapped models
            model.layers[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def is_checkpointed(block: nn.Module) -> bool:
    return hasattr(block, "_checkpoint_wrapped_module")


def apply_compile(model: nn.Module, dynamic: bool = False, **compile_kwargs) -> None:
    """torch.compile each Block in place: one graph reused by all layers (they share one code object).
    dynamic=False: every sequence length (causal, DiagD with its proxy rows, validation) gets a graph of its own
    with static shapes; left to dynamo, the second length recompiles every block with symbolic sizes."""
    for block in model.layers:
        block.compile(dynamic=dynamic, **compile_kwargs)


def apply_fsdp(model: nn.Module, mesh, param_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype = torch.float32) -> None:
    """FSDP2: each Block is one unit (all-gathered for its forward and backward, resharded after), then the rest
    (embeddings, final norm, output layer) as the root unit. param_dtype: the dtype blocks compute in (bf16
    halves all-gather traffic); gradients are reduced in reduce_dtype and kept in fp32 with the sharded weights."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)
