"""Gradient clipping by the global norm, in every layout.

Clipping scales all gradients by ``min(1, max_norm / (norm + 1e-6))``, where ``norm`` is the
2-norm of every gradient of the whole model taken as one vector (the formula of
``torch.nn.utils.clip_grad_norm_``). One process holding the whole model computes it alone;
once the model is split, each rank holds only some of the gradients, and the norm is a sum
of squares over ranks in which every element must count exactly once:

- data parallel (DDP, ZeRO-1): after backward every rank holds the same, whole gradients:
  no sum (summing would count each gradient dp times);
- FSDP: each rank holds a different shard of every gradient: sum over dp (HSDP: over the
  ranks of a sharding group only; the groups hold the same shards);
- tensor parallel: split weights (``ParamSpec.shard_dim``) are different slices on each tp
  rank: sum over tp; replicated ones (layer norms, row-parallel biases) are equal on every
  tp rank: counted once;
- context parallel: gradients are summed over cp in backward, so every cp rank holds them
  whole: no sum;
- pipeline parallel: each stage holds its own blocks: sum over pp.
- expert parallel: each rank of an ep block holds its own experts (``ParamSpec.expert``),
  averaged over their replicas: sum over the block.

Every rank then has the same norm and the same scale, and the result is the serial model's.

The sums over ranks run on the process group's device (the trainer's): with FSDP's CPU offload
the gradient shards sit in pinned host memory, and an NCCL group has no backend for a CPU
tensor. The partial norms travel to the group's device for the collective, and the scale
comes back to each gradient's device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from distributed.mesh import ParallelMesh
from distributed.shards import is_sharded, local, tp_split_dim
from distributed.tags import spec


def _sum_over(t: torch.Tensor, group: object, device: torch.device) -> torch.Tensor:
    """``t`` summed over ``group``'s ranks, on ``device`` (a host tensor is copied there first)."""
    t = t.to(device)
    dist.all_reduce(t, group=group)
    return t


def global_grad_norm(params: list[nn.Parameter], mesh: ParallelMesh) -> torch.Tensor:
    """The 2-norm of the whole model's gradient (collective over the mesh's groups as above), on
    the device of the mesh's process groups (of the gradients without one)."""
    grads = [p for p in params if p.grad is not None]
    device = local(grads[0].grad).device if grads else torch.device("cpu")
    on = mesh.collective_device(device)
    split, replicated = torch.zeros((), device=device), torch.zeros((), device=device)
    experts = torch.zeros((), device=device)
    for p in grads:
        sq = local(p.grad).float().pow(2).sum()  # an FSDP gradient: this rank's shard
        if spec(p).expert:
            experts += sq
        elif (spec(p).shard_dim is not None or tp_split_dim(p.grad) is not None) and mesh.size("tp") > 1:
            split += sq
        else:
            replicated += sq
    if mesh.size("tp") > 1:
        split = _sum_over(split, mesh.group("tp"), on)
    if mesh.expert_parallel > 1:
        experts = _sum_over(experts, mesh.group("ep"), on)
    total = split.to(on) + replicated.to(on) + experts.to(on)
    sharded = next((p.grad for p in grads if is_sharded(p.grad) and tp_split_dim(p.grad) is None
                    and any(pl.is_shard() for pl in p.grad.placements)), None)
    if sharded is not None:  # FSDP: over the mesh dimensions that shard (HSDP: not the replicas)
        for i, placement in enumerate(sharded.placements):
            if placement.is_shard():
                total = _sum_over(total, sharded.device_mesh.get_group(i), on)
    if mesh.size("pp") > 1:
        total = _sum_over(total, mesh.group("pp"), on)
    return total.sqrt()


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, mesh: ParallelMesh) -> torch.Tensor:
    """Scale the gradients so that their global norm is at most ``max_norm``; returns the norm
    before clipping (a device tensor: no host sync)."""
    norm = global_grad_norm(params, mesh)
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    scales = {scale.device: scale}  # one copy per device (offloaded shards: one to the host)
    for p in params:
        if p.grad is not None:
            g = local(p.grad)
            if g.device not in scales:
                scales[g.device] = scale.to(g.device)
            g.mul_(scales[g.device])  # on the device: no host sync to decide whether to clip
    return norm
