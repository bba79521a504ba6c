"""What one rank holds of a tensor: an FSDP parameter (a DTensor) is sharded over the
data-parallel ranks, any other tensor is held whole. Used by everything that reads or writes a
rank's part (sharding, clipping, LAMB, consolidation, memory reports), so none of them needs the
others.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from utils.device import this_rank_device


def is_sharded(t: Any) -> bool:
    """Whether ``t`` is a DTensor (an FSDP parameter or one of its optimizer states). A DTensor
    exists only once ``torch.distributed.tensor`` is imported (FSDP does it), so a run without
    FSDP never pays the 0.7 s that importing it takes in every process."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def tp_split_dim(t: Any) -> int | None:
    """The dimension along which a DTensor is split over the mesh dimension "tp" (torch's own
    tensor parallelism, distributed/parallelize.py), or None."""
    if not is_sharded(t):
        return None
    names = t.device_mesh.mesh_dim_names or ()
    return next((p.dim for p, name in zip(t.placements, names) if p.is_shard() and name == "tp"), None)


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` stored on this rank (an FSDP parameter's shard, else ``t``)."""
    return t.to_local() if is_sharded(t) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole of ``t`` (collective over the ranks that shard it, else ``t`` itself), where its
    shard is. FSDP's CPU offload keeps shards in host memory while the mesh's groups are NCCL's,
    which gathers device tensors only: such a shard is gathered on the mesh's device."""
    if not is_sharded(t):
        return t
    shard, kind = t.to_local(), t.device_mesh.device_type
    if shard.device.type == kind:
        return t.full_tensor()
    from torch.distributed.tensor import DTensor

    moved = DTensor.from_local(shard.to(this_rank_device(kind)), t.device_mesh, t.placements, run_check=False,
                               shape=t.shape, stride=t.stride())
    return moved.full_tensor().to(shard.device)


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


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state (ZeRO's inner one)."""
    return getattr(optimizer, "optim", optimizer)
