"""Sharded data parallelism: ZeRO-1 and FSDP2, and switching gradient reduction off for
gradient accumulation.

What each data-parallel rank holds, for P parameters trained with Adam in fp32 (the ZeRO
paper counts 16 bytes per parameter for mixed precision: fp16 weights and gradients, fp32
master weights and two moments):

- ``ddp``: everything, 4 P (weights) + 4 P (gradients) + 8 P (Adam's two moments).
- ``zero1`` (ZeRO stage 1, ``ZeroRedundancyOptimizer``): the moments of 1/N of the
  parameters. Gradients are still all-reduced by DDP; after its local step each rank
  broadcasts the parameters it updated.
- ``fsdp`` (ZeRO stage 3, FSDP2 ``fully_shard``): 1/N of the weights, gradients and moments.
  Before a block's forward (and again before its backward, with ``reshard_after_forward``)
  its weights are all-gathered; after its backward the gradients are reduce-scattered, each
  rank keeping the sum for its own slice.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distributed.mesh import ParallelMesh, device_mesh, hsdp_layouts, hsdp_shard
from distributed.tags import spec
from utils import compat
from utils import device as dev
from utils.config_groups import ParallelConfig

log = logging.getLogger(__name__)


def fsdp_active(layout: ParallelConfig, mesh: ParallelMesh) -> bool:
    return layout.sharded and mesh.dp_size > 1


def zero1_active(layout: ParallelConfig, mesh: ParallelMesh) -> bool:
    return layout.zero1 and mesh.dp_size > 1


def apply_fsdp(model: nn.Module, mesh: ParallelMesh, layout: ParallelConfig, amp_mode: str,
               cpu_offload: bool) -> nn.Module:
    """``fully_shard`` each of the model's units (the ViT's transformer blocks), then the root
    (the stem and the tail: the ViT's patch embedding, norm and head).

    Units first: each becomes one all-gather / reduce-scatter unit, so the next unit's gather
    overlaps this unit's compute; the root then holds only what no unit owns. The root is not
    resharded after forward: backward starts with the tail at once.
    With tensor parallelism the shards are of this rank's tensor-parallel slice, over dp."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    tags = {name: spec(p) for name, p in model.named_parameters()}
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if amp_mode == "bf16" else MixedPrecisionPolicy()
    # offload: the shards live in host memory, are copied to the device for each gather, and
    # Adam steps on the CPU (page-locked host memory on a GPU, for asynchronous copies)
    offload = CPUOffloadPolicy(pin_memory=dev.cuda_available()) if cpu_offload else OffloadPolicy()
    dp_mesh = hsdp_mesh(mesh, layout) if layout.hsdp else mesh.device_mesh["dp"]
    backend = dist.get_backend(mesh.dp_group)
    for unit in model.units().values():
        fully_shard(unit, mesh=dp_mesh, reshard_after_forward=layout.reshard_after_forward,
                    mp_policy=policy, offload_policy=offload)
        compat.fsdp_average_on_gloo(unit, backend)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=policy, offload_policy=offload)
    compat.fsdp_average_on_gloo(model, backend)
    for name, p in model.named_parameters():  # fully_shard made new (DTensor) parameters
        p.mp_spec = tags[name]
    return model


def hsdp_mesh(mesh: ParallelMesh, layout: ParallelConfig) -> Any:
    """HSDP's 2-D mesh of the data ranks: (replicate, shard). Each row of ``dp_shard`` ranks (by
    default the ranks of one node, where links are fast) shards the model as FSDP does; the rows
    hold the same shards and average their gradients with an all-reduce across nodes, which
    sends each gradient once per step instead of gathering weights over the slow network."""
    shard = hsdp_shard(layout, mesh.dp_size, int(os.environ.get("LOCAL_WORLD_SIZE", mesh.dp_size)))
    ranks = torch.tensor(hsdp_layouts(dist.get_world_size(), shard)["dp_shard"])  # dp alone here
    return device_mesh(mesh.device_mesh.device_type, ranks, ("dp_replicate", "dp_shard"))


def build_optimizer(model: nn.Module, optimizer_class: type[torch.optim.Optimizer], options: dict[str, Any],
                    layout: ParallelConfig, mesh: ParallelMesh) -> torch.optim.Optimizer:
    """The optimizer (class and settings from training/schedule.py:optimizer_choice) for this rank's
    part of the model: under zero1 wrapped so that each dp rank keeps the state of its share only;
    LAMB's per-tensor norms summed over the ranks that split a tensor (tp slices, FSDP shards)."""
    if getattr(optimizer_class, "norms_span_ranks", False):  # LAMB (distributed/lamb.py)
        from distributed.lamb import local_sum_squares, split_sum_squares

        whole = mesh.size("tp") == 1 and not fsdp_active(layout, mesh)  # ZeRO-1 steps whole tensors
        options = {**options, "sum_squares": local_sum_squares if whole else split_sum_squares(mesh)}
    if layout.tp_impl == "torch" and mesh.size("tp") > 1:
        # torch's tensor parallelism leaves the norms plain tensors beside DTensor weights, and the
        # foreach and fused kernels take one kind at a time: the single-tensor loop, same numbers
        options = {k: False if k in ("foreach", "fused") else v for k, v in options.items()}
    if getattr(optimizer_class, "averages_momentum", False):  # 1-bit Adam: DDP's hook, then its own average
        from distributed import onebit_adam

        optimizer = optimizer_class(model.parameters(), group=mesh.dp_group, **options)
        onebit_adam.register(model, optimizer, mesh.dp_group)
        return optimizer
    if zero1_active(layout, mesh):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class,
                                       process_group=mesh.dp_group, **options)
    return optimizer_class(model.parameters(), **options)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """With ``enabled`` False, backward only accumulates local gradients: no all-reduce (DDP's
    ``no_sync``), no reduce-scatter (FSDP keeps unsharded gradients until the last micro-batch),
    no summing hooks. The micro-batch run with sync enabled then reduces the accumulated sum."""
    if enabled:
        yield
        return
    if hasattr(model, "no_sync"):  # DDP
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:  # per-parameter summing hooks (distributed/tags.py), or nothing to synchronise
        holder = getattr(model, "grad_sum_switch", None)
        if holder is not None:
            holder["on"] = False
        try:
            yield
        finally:
            if holder is not None:
                holder["on"] = True
