"""Parameter tags, and what is driven by them: sharding, consolidation, gradient sync.

Every parameter of a model-parallel ViT carries a :class:`ParamSpec` (attribute
``mp_spec``): along which dimension it is split over the tensor-parallel group (or None
when every tp rank holds all of it), and over which groups its gradient must be summed.

Which gradients need a sum, and why:

- tp-sharded weights (column- and row-parallel): each rank owns its slice; its gradient
  is complete, no reduction.
- replicated under tp (layer norms, row-parallel biases, patch embedding, head): every
  tp rank sees identical inputs and, thanks to copy_to / reduce_from, identical output
  gradients, so the gradients are already equal and complete. Summing them over tp (an
  SC23 bug) would multiply them by tp.
- under cp every parameter is replicated while each rank sees only its part of the
  tokens: each gradient is a partial sum over tokens and must be summed over cp.
- over dp, DDP averages as usual.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distributed.mappings import _all_gather
from utils.comm import Comm


@dataclass(frozen=True)
class ParamSpec:
    shard_dim: int | None = None  # split over the tp group along this dim; None = replicated
    grad_sum: tuple[str, ...] = ()  # groups whose ranks' gradients are summed


def tag(p: nn.Parameter, shard_dim: int | None = None, grad_sum: tuple[str, ...] = ()) -> nn.Parameter:
    p.mp_spec = ParamSpec(shard_dim, grad_sum)
    return p


def spec(p: torch.Tensor) -> ParamSpec:
    return getattr(p, "mp_spec", ParamSpec())


def tag_model(model: nn.Module, comm: Comm) -> None:
    """Complete every parameter's tag: untagged ones are replicated; with cp > 1 every
    gradient is summed over cp (see the module docstring)."""
    grad_sum = ("cp",) if comm.cp_size > 1 else ()
    for p in model.parameters():
        tag(p, spec(p).shard_dim, grad_sum)


def take_shard(full: torch.Tensor, p_spec: ParamSpec, comm: Comm) -> torch.Tensor:
    """This rank's slice of a full (serial) tensor, as a tensor of its own: a view would keep
    the whole tensor alive (Adam's moments loaded from a checkpoint would stay full size)."""
    if p_spec.shard_dim is None or comm.tp_size == 1:
        return full
    return full.chunk(comm.tp_size, dim=p_spec.shard_dim)[comm.tp_rank].clone(
        memory_format=torch.contiguous_format)


def gather_full(t: torch.Tensor, p_spec: ParamSpec, comm: Comm) -> torch.Tensor:
    """The whole tensor from every tp rank's shard (collective over tp for sharded ones)."""
    if p_spec.shard_dim is None or comm.tp_size == 1:
        return t.detach().clone()
    sizes = [t.shape[p_spec.shard_dim]] * comm.tp_size
    return _all_gather(t.detach(), p_spec.shard_dim, comm.tp_group, sizes)


@torch.no_grad()
def load_full_state(model: nn.Module, state: dict[str, torch.Tensor], comm: Comm) -> None:
    """Load a consolidated (serial) state dict: each rank copies its shards."""
    own = dict(model.named_parameters())
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit this model (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}); was it written for another model size?")
    for name, p in own.items():
        shard = take_shard(state[name], spec(p), comm).to(p.device)
        if shard.shape != p.shape:
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(state[name].shape)}, which "
                             f"does not fit this model; was it written for another model size?")
        p.copy_(shard)


def full_state(model: nn.Module, comm: Comm, grads: bool = False) -> dict[str, torch.Tensor]:
    """Consolidated parameters (or their gradients) keyed like the serial model (collective over tp)."""
    return {name: gather_full(p.grad if grads else p, spec(p), comm)
            for name, p in model.named_parameters()}


def install_grad_sum_hooks(model: nn.Module, comm: Comm) -> None:
    """Sum every tagged gradient over its groups as soon as it is accumulated in backward.
    Used when there is no DDP (dp = 1 or --noddp); with DDP the comm hook does it."""
    for p in model.parameters():
        groups = [comm.group(n) for n in spec(p).grad_sum if comm.size(n) > 1]
        if groups:
            p.register_post_accumulate_grad_hook(_make_sum_hook(groups))


def _make_sum_hook(groups):
    def hook(p: torch.Tensor) -> None:
        for g in groups:
            dist.all_reduce(p.grad, group=g)

    return hook


def ddp_comm_hook(comm: Comm):
    """DDP communication hook: first sum the bucket's tagged gradients over their groups
    (cp), then average the bucket over dp as DDP would by default."""

    # no annotations: DDP inspects them, and `from __future__ import annotations` makes them strings
    def hook(state, bucket):
        buffer = bucket.buffer()
        sums = {spec(p).grad_sum for p in bucket.parameters()}
        # tag_model gives every parameter the same groups, so one collective per bucket does
        assert len(sums) == 1, f"a DDP bucket mixes gradient groups {sums}"
        for name in sums.pop():
            if comm.size(name) > 1:
                dist.all_reduce(buffer, group=comm.group(name))
        buffer.div_(comm.dp_size)
        work = dist.all_reduce(buffer, group=comm.dp_group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    return hook


def wrap_for_training(model: nn.Module, comm: Comm, device: torch.device, use_ddp: bool = True,
                      ddp_options: dict | None = None) -> nn.Module:
    """Gradient synchronisation for a model-parallel model, as its parameter tags ask:
    DDP over the dp group with :func:`ddp_comm_hook` when dp > 1, else per-parameter hooks."""
    if comm.dp_size > 1 and use_ddp:
        ids = [device.index] if device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=ids, process_group=comm.dp_group,
                                      **(ddp_options or {}))
        ddp.register_comm_hook(None, ddp_comm_hook(comm))
        return ddp
    install_grad_sum_hooks(model, comm)
    return model
