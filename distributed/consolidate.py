"""Consolidated state: whole tensors with the serial model's names, from and to this rank's shards.

Checkpoints hold what the serial model would hold, so a run can continue in any layout
(or in train.py). Each parameter's tag (distributed/tags.py) says how it is split over tp;
under FSDP a parameter is also sharded over dp (a DTensor), and under ZeRO-1 the optimizer
state is spread over the dp ranks (distributed/sharding.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from distributed.mesh import ParallelMesh
from distributed.shards import full, like, local_optimizer
from distributed.tags import ParamSpec, spec
from utils.checkpoint import check_names


def take_shard(full: torch.Tensor, p_spec: ParamSpec, mesh: ParallelMesh) -> torch.Tensor:
    """This rank's slice of a full (serial) tensor, as a tensor of its own: a view would keep
    the whole tensor alive (Adam's moments loaded from a checkpoint would stay full size)."""
    tp = mesh.size("tp")
    if p_spec.shard_dim is None or tp == 1:
        return full
    return full.chunk(tp, dim=p_spec.shard_dim)[mesh.rank_in("tp")].clone(
        memory_format=torch.contiguous_format)


def gather_full(t: torch.Tensor, p_spec: ParamSpec, mesh: ParallelMesh,
                device: torch.device | None = None) -> torch.Tensor:
    """The whole tensor from every rank's shard (collective over dp for an FSDP-sharded tensor,
    over tp for a tp-sharded one). ``device``: where a tp shard is gathered, its parameter's
    (ZeRO-1 hands its consolidated state over in host memory, and NCCL gathers device tensors)."""
    t = full(t)
    tp = mesh.size("tp")
    if p_spec.shard_dim is None or tp == 1:
        return t.detach().clone()
    from distributed import mappings  # only with tensor parallelism

    sizes = [t.shape[p_spec.shard_dim]] * tp
    return mappings.all_gather_along(t.detach().to(device or t.device), p_spec.shard_dim,
                                     mesh.group("tp"), sizes)


@torch.no_grad()
def load_full_state(model: nn.Module, state: dict[str, torch.Tensor], mesh: ParallelMesh) -> None:
    """Load a consolidated (serial) state dict: each rank copies its shards."""
    own = dict(model.named_parameters())
    check_names(own, state)
    for name, p in own.items():
        shard = take_shard(state[name], spec(p), mesh).to(p.device)
        if shard.shape != p.shape:  # a DTensor's shape is that of the whole (unsharded) tensor
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(state[name].shape)}, which "
                             f"does not fit this model; was it written for another model size?")
        p.copy_(like(shard, p))


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A gathered whole tensor in host memory. Each one goes there as soon as it is gathered: on
    a GPU, keeping them all until the checkpoint is written would need a second copy of the
    whole model and Adam's two moments in device memory again: 4 + 8 bytes per parameter, 14.7 GB
    for `xl`'s 1.22 billion."""
    return t.to("cpu")


def full_state(model: nn.Module, mesh: ParallelMesh, grads: bool = False) -> dict[str, torch.Tensor]:
    """Consolidated parameters (or their gradients) keyed like the serial model, in host memory
    (collective over tp, and over dp for FSDP's shards)."""
    return {name: to_host(gather_full(p.grad if grads else p, spec(p), mesh))
            for name, p in model.named_parameters()}


def _per_element(v: Any) -> bool:
    """Optimizer state shaped like its parameter (Adam's moments), not a scalar step count."""
    return torch.is_tensor(v) and v.dim() > 0


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def full_optimizer_state(optimizer: torch.optim.Optimizer, mesh: ParallelMesh) -> dict[str, Any]:
    """The optimizer's state dict with every per-element tensor consolidated in host memory
    (collective over tp and, under FSDP, dp). Under ZeRO-1 dp rank 0 first collects every
    rank's share; the other dp ranks get an empty dict (only rank 0 writes checkpoints)."""
    if local_optimizer(optimizer) is not optimizer:  # ZeroRedundancyOptimizer
        optimizer.consolidate_state_dict(to=0)  # collective over dp; to: rank in the dp group
        if mesh.dp_rank != 0:
            return {}
    state = optimizer.state_dict()
    params = _optimizer_params(optimizer)
    state["state"] = {i: {k: to_host(gather_full(v, spec(params[i]), mesh, params[i].device))
                          if _per_element(v) else v
                          for k, v in s.items()} for i, s in state["state"].items()}
    return state


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any],
                              mesh: ParallelMesh) -> None:
    params = _optimizer_params(optimizer)
    state = dict(state)
    state["state"] = {i: {k: like(take_shard(v, spec(params[i]), mesh), params[i])
                          if _per_element(v) else v
                          for k, v in s.items()} for i, s in state["state"].items()}
    optimizer.load_state_dict(state)  # ZeRO-1: each rank keeps the state of its own share
