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
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distributed.mesh import ParallelMesh, hsdp_layouts, hsdp_shard
from distributed.tags import spec
from utils import compat
from utils import device as dev
from utils.config import Config

log = logging.getLogger(__name__)


def is_sharded(t: Any) -> bool:
    """Whether ``t`` is a DTensor (an FSDP parameter or one of its optimizer states). A DTensor
    exists only once ``torch.distributed.tensor`` is imported (FSDP does it), so a run without
    FSDP never pays the 0.7 s that importing it takes in every process."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` stored on this rank (an FSDP parameter's shard, else ``t``)."""
    return t.to_local() if is_sharded(t) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole of ``t`` (collective over the ranks that shard it, else ``t`` itself)."""
    return t.full_tensor() if is_sharded(t) else t


def shard_of(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a whole tensor ``value`` laid out like ``param`` (no communication):
    for each mesh dimension that shards ``param``, the chunk of this rank's coordinate, split as
    DTensor's ``Shard`` splits (``torch.chunk``: the last ranks may get less, or nothing)."""
    if not is_sharded(param):
        return value
    from torch.distributed.tensor import Shard

    coordinate = param.device_mesh.get_coordinate()
    for i, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            chunks = value.chunk(param.device_mesh.size(i), dim=placement.dim)
            value = (chunks[coordinate[i]] if coordinate[i] < len(chunks)
                     else value.narrow(placement.dim, 0, 0))
    if value.shape != param.to_local().shape:
        raise RuntimeError(f"slice {tuple(value.shape)} does not fit the local shard "
                           f"{tuple(param.to_local().shape)}")
    return value


def like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A whole tensor laid out like ``param``: sharded the same way when ``param`` is sharded
    (every rank holds ``value`` and keeps its own slice)."""
    if not is_sharded(param):
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(param.device), param.device_mesh, param.placements)


def fsdp_active(cfg: Config, mesh: ParallelMesh) -> bool:
    return cfg.data_parallel in ("fsdp", "hsdp") and mesh.dp_size > 1


def zero1_active(cfg: Config, mesh: ParallelMesh) -> bool:
    return cfg.data_parallel == "zero1" and mesh.dp_size > 1


def autocast_mode(cfg: Config, mesh: ParallelMesh) -> str:
    """bf16 under FSDP comes from its mixed-precision policy (bf16 copies of the gathered
    weights, fp32 master weights and gradient reduction), not from autocast."""
    return "none" if fsdp_active(cfg, mesh) and cfg.amp_mode == "bf16" else cfg.amp_mode


def apply_fsdp(model: nn.Module, mesh: ParallelMesh, cfg: Config) -> nn.Module:
    """``fully_shard`` each transformer block, then the root (patch embedding, norm, head).

    Blocks first: each becomes one all-gather / reduce-scatter unit, so the next block's
    gather overlaps this block's compute; the root then holds only what no block owns. The
    root is not resharded after forward: backward starts with the head at once.
    With tensor parallelism the shards are of this rank's tensor-parallel slice, over dp."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    tags = {name: spec(p) for name, p in model.named_parameters()}
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if cfg.amp_mode == "bf16" else MixedPrecisionPolicy()
    # offload: the shards live in host memory, are copied to the device for each gather, and
    # Adam steps on the CPU (page-locked host memory on a GPU, for asynchronous copies)
    offload = CPUOffloadPolicy(pin_memory=dev.cuda_available()) if cfg.cpu_offload else OffloadPolicy()
    dp_mesh = hsdp_mesh(mesh, cfg) if cfg.data_parallel == "hsdp" else mesh.device_mesh["dp"]
    backend = dist.get_backend(mesh.dp_group)
    for block in model.blocks.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=cfg.reshard_after_forward,
                    mp_policy=policy, offload_policy=offload)
        compat.fsdp_average_on_gloo(block, backend)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=policy, offload_policy=offload)
    compat.fsdp_average_on_gloo(model, backend)
    for name, p in model.named_parameters():  # fully_shard made new (DTensor) parameters
        p.mp_spec = tags[name]
    return model


def hsdp_mesh(mesh: ParallelMesh, cfg: Config) -> Any:
    """HSDP's 2-D mesh of the data ranks: (replicate, shard). Each row of ``dp_shard`` ranks (by
    default the ranks of one node, where links are fast) shards the model as FSDP does; the rows
    hold the same shards and average their gradients with an all-reduce across nodes, which
    sends each gradient once per step instead of gathering weights over the slow network."""
    from torch.distributed.device_mesh import DeviceMesh

    shard = hsdp_shard(cfg, mesh.dp_size, int(os.environ.get("LOCAL_WORLD_SIZE", mesh.dp_size)))
    ranks = torch.tensor(hsdp_layouts(dist.get_world_size(), shard)["dp_shard"])  # dp alone here
    return DeviceMesh(mesh.device_mesh.device_type, ranks, mesh_dim_names=("dp_replicate", "dp_shard"))


def build_optimizer(model: nn.Module, cfg: Config, mesh: ParallelMesh,
                    kernel: dict[str, bool]) -> torch.optim.Optimizer:
    """The optimizer ``cfg.optimizer_type`` names; under zero1 wrapped so that each dp rank keeps the
    state of its share only. ``kernel``: Adam's and AdamW's implementation (fused or foreach)."""
    name = cfg.optimizer_type
    if name == "LAMB":  # written in the project: its per-tensor norms must span the ranks' parts
        from distributed.lamb import Lamb, local_sum_squares, split_sum_squares

        whole = mesh.size("tp") == 1 and not fsdp_active(cfg, mesh)  # ZeRO-1 steps whole tensors
        optimizer_class = Lamb
        options = {"lr": cfg.lr, "betas": cfg.adam_betas, "weight_decay": cfg.weight_decay,
                   "sum_squares": local_sum_squares if whole else split_sum_squares(mesh)}
    elif name == "SGD":
        optimizer_class = torch.optim.SGD
        options = {"lr": cfg.lr, "momentum": cfg.momentum, "weight_decay": cfg.weight_decay, **kernel}
    else:
        optimizer_class = torch.optim.AdamW if name == "AdamW" else torch.optim.Adam
        options = {"lr": cfg.lr, "betas": cfg.adam_betas, **kernel}
        if name == "AdamW":
            options["weight_decay"] = cfg.weight_decay
    if zero1_active(cfg, mesh):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class,
                                       process_group=mesh.dp_group, **options)
    return optimizer_class(model.parameters(), **options)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state (ZeRO's inner one)."""
    return getattr(optimizer, "optim", optimizer)


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
