"""LAMB: Adam with a trust ratio per tensor, for large batches (You et al., 2020).

With a large batch the learning rate has to grow to keep the number of epochs, and a rate that
suits some layers makes others diverge: Adam's step is about ``lr`` in every element, whatever the
size of the weights. LAMB rescales each tensor's step so that it is a fixed fraction of that
tensor's weights:

    m, v    = Adam's moments of the gradient g (bias-corrected: m_hat, v_hat)
    u       = m_hat / (sqrt(v_hat) + eps) + weight_decay * w      (Adam's direction)
    trust   = ||w|| / ||u||   (1 when either norm is 0)
    w      <- w - lr * trust * u

so every tensor moves by ``lr`` times its own norm per step (``||trust * u|| = ||w||``): the
"layer-wise" adaptation. The norms are those of the whole tensor. When the tensor is split
over ranks, each rank holds a part, and ``norm`` (given by distributed/sharding.py) sums the
squares of the parts over the ranks that hold different ones: over dp for FSDP's shards, over
tp for tensor-parallel slices, nothing for whole tensors (DDP, ZeRO-1, pipeline stages). The
arithmetic runs on this rank's part (``local``), and the result equals the serial model's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from distributed.mesh import ParallelMesh
from distributed.shards import is_sharded, local
from distributed.tags import spec

# (parameters, this rank's parts of one tensor per parameter) -> the squared 2-norm of each whole tensor
SumSquares = Callable[[list[torch.Tensor], list[torch.Tensor]], torch.Tensor]


def local_sum_squares(params: list[torch.Tensor], parts: list[torch.Tensor]) -> torch.Tensor:
    """Squared norms of tensors this rank holds whole (one process, DDP, ZeRO-1, pipeline stages)."""
    return torch.stack([x.float().pow(2).sum() for x in parts])


def split_sum_squares(mesh: ParallelMesh) -> SumSquares:
    """Squared norms of tensors split over ranks: one all-reduce per group for all the tensors
    (tensor-parallel slices over tp; FSDP's shards over the dp dimensions that shard them)."""
    def sum_squares(params: list[torch.Tensor], parts: list[torch.Tensor]) -> torch.Tensor:
        sq = local_sum_squares(params, parts)
        home = sq.device  # the host for --cpu_offload's shards, whose groups are on the GPU (NCCL)
        sq = sq.to(mesh.collective_device(home))
        if mesh.size("tp") > 1:
            split = torch.tensor([spec(p).shard_dim is not None for p in params], device=sq.device)
            over_tp = torch.where(split, sq, torch.zeros_like(sq))
            dist.all_reduce(over_tp, group=mesh.group("tp"))
            sq = torch.where(split, over_tp, sq)
        sharded = next((p for p in params if is_sharded(p)), None)
        if sharded is not None:  # FSDP shards every parameter over the same mesh dimensions
            for i, placement in enumerate(sharded.placements):
                if placement.is_shard():
                    dist.all_reduce(sq, group=sharded.device_mesh.get_group(i))
        return sq.to(home)

    return sum_squares


class Lamb(torch.optim.Optimizer):
    # its per-tensor norms need every rank's part of a tensor: distributed/sharding.py gives it
    # the sum over the ranks that split one (sum_squares)
    norms_span_ranks = True

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0,
                 sum_squares: SumSquares = local_sum_squares) -> None:
        if lr <= 0 or eps <= 0 or weight_decay < 0:
            raise ValueError(f"LAMB needs lr > 0, eps > 0 and weight_decay >= 0, got {lr}, {eps}, "
                             f"{weight_decay}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.sum_squares = sum_squares

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 (torch's signature)
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            params = [p for p in group["params"] if p.grad is not None]
            weights, updates = [], []
            for p in params:  # Adam's direction u for every tensor (this rank's part of it)
                state = self.state[p]
                if not state:  # shaped like the parameter (a DTensor under FSDP), for checkpoints
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                w, g = local(p), local(p.grad)
                m, v = local(state["exp_avg"]), local(state["exp_avg_sq"])
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                m_hat = m / (1 - beta1 ** state["step"])  # the step is a tensor: no host sync
                v_hat = v / (1 - beta2 ** state["step"])
                u = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"]:
                    u.add_(w, alpha=group["weight_decay"])
                weights.append(w)
                updates.append(u)
            if not params:
                continue
            # the norms of the whole tensors: collectives when they are split over ranks
            w_norm = self.sum_squares(params, weights).sqrt()
            u_norm = self.sum_squares(params, updates).sqrt()
            trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
            for w, u, ratio in zip(weights, updates, trust):
                w.sub_(u * (group["lr"] * ratio).to(u.dtype))
        return loss
