"""Parameter tags, and the gradient synchronisation they drive.

Every parameter of a model-parallel ViT carries a :class:`ParamSpec` (attribute
``mp_spec``): along which dimension it is split over the tensor-parallel group (or None
when every tp rank holds all of it), and over which mesh dimensions its gradient must be
summed. Checkpoint consolidation (distributed/consolidate.py) reads the same tags.

Which gradients need a sum, and why:

- tp-sharded weights (column- and row-parallel): each rank owns its slice; its gradient
  is complete, no reduction.
- replicated under tp (layer norms, row-parallel biases, patch embedding, head): every
  tp rank sees identical inputs and, thanks to copy_to / reduce_from, identical output
  gradients, so the gradients are already equal and complete. Summing them over tp (an
  SC23 bug) would multiply them by tp.
- under cp every parameter is replicated while each rank sees only its part of the
  tokens: each gradient is a partial sum over tokens and must be summed over cp.
- with sequence parallelism the replicated parameters (norms, biases of row-parallel layers,
  patch embedding, head) see only this tp rank's tokens too: summed over tp. The tp-sharded
  weights see every token of their features (the column-parallel layer gathers them, the
  row-parallel one's backward all-gathers the gradient): complete, no sum.
- over dp, DDP averages as usual.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distributed.mesh import ParallelMesh
from distributed.shards import is_sharded
from utils import compat
from utils.config_groups import ParallelConfig


@dataclass(frozen=True)
class ParamSpec:
    shard_dim: int | None = None  # split over the tp group along this dim; None = replicated
    grad_sum: tuple[str, ...] = ()  # mesh dimensions whose ranks' gradients are summed
    expert: bool = False  # an expert of this rank's ep block: averaged over "ep_replicas", not dp


def tag(p: nn.Parameter, shard_dim: int | None = None, grad_sum: tuple[str, ...] = (),
        expert: bool = False) -> nn.Parameter:
    p.mp_spec = ParamSpec(shard_dim, grad_sum, expert)
    return p


def spec(p: torch.Tensor) -> ParamSpec:
    return getattr(p, "mp_spec", ParamSpec())


def tag_model(model: nn.Module, mesh: ParallelMesh, sequence_parallel: bool = False) -> None:
    """Complete every parameter's tag: untagged ones are replicated; with cp > 1 every
    gradient is summed over cp, with sequence parallelism the replicated ones over tp too
    (see the module docstring)."""
    cp = ("cp",) if mesh.size("cp") > 1 else ()
    for p in model.parameters():
        shard_dim = spec(p).shard_dim
        # (a DTensor of torch's tensor parallelism: its gradient comes complete from DTensor's backward)
        tp = ("tp",) if sequence_parallel and shard_dim is None and not is_sharded(p) else ()
        tag(p, shard_dim, tp + cp, spec(p).expert)


def needs_grad_sum(model: nn.Module) -> bool:
    return any(spec(p).grad_sum or spec(p).expert for p in model.parameters())


def install_grad_sum_hooks(model: nn.Module, mesh: ParallelMesh) -> None:
    """Sum every tagged gradient over its dimensions as soon as it is accumulated in backward.
    Used when there is no DDP (dp = 1 or --noddp); with DDP the comm hook does it.
    ``model.grad_sum_switch["on"]`` turns them off for gradient accumulation's first
    micro-batches (distributed/sharding.py): the last one's hook then sums the accumulated total."""
    switch = {"on": True}
    model.grad_sum_switch = switch
    for p in model.parameters():
        groups = [mesh.group(n) for n in spec(p).grad_sum if mesh.size(n) > 1]
        if groups:
            p.register_post_accumulate_grad_hook(_make_sum_hook(groups, switch))


def _make_sum_hook(groups, switch: dict[str, bool]):
    def hook(p: torch.Tensor) -> None:
        if not switch["on"]:
            return
        for g in groups:
            dist.all_reduce(p.grad, group=g)

    return hook


def ddp_comm_hook(mesh: ParallelMesh):
    """DDP communication hook: first sum the bucket's tagged gradients over their dimensions
    (cp), then average the bucket over dp as DDP would by default."""

    # no annotations: DDP inspects them, and `from __future__ import annotations` makes them strings
    def hook(state, bucket):
        buffer = bucket.buffer()
        # the bucket's gradients (views of its buffer) by the dimensions they are summed over:
        # all the same under cp (one collective for the bucket); with sequence parallelism the
        # replicated ones also over tp (one more collective for their part of the bucket)
        sums: dict[tuple[str, ...], list[torch.Tensor]] = {}
        experts: list[torch.Tensor] = []  # expert parallel: averaged over the expert replicas
        others: list[torch.Tensor] = []
        offset = 0
        for p in bucket.parameters():  # the buffer holds their gradients in this order
            view = buffer[offset:offset + p.numel()]
            offset += p.numel()
            sums.setdefault(spec(p).grad_sum, []).append(view)
            (experts if spec(p).expert else others).append(view)
        for dims, views in sums.items():
            for name in dims:
                if mesh.size(name) > 1:
                    _all_reduce_views(views if len(sums) > 1 else [buffer], mesh.group(name))
        buffer.div_(mesh.dp_size)  # the mean over every dp rank's samples
        if not experts:
            work = dist.all_reduce(buffer, group=mesh.dp_group, async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0])
        # an expert's gradient already holds the tokens of its whole ep block (the all-to-all's
        # backward brought them): summed over the blocks, the ranks holding the same experts
        _all_reduce_views(experts, mesh.group("ep_replicas"))
        if others:
            _all_reduce_views(others, mesh.dp_group)
        done = torch.futures.Future()
        done.set_result(buffer)
        return done

    return hook


def _all_reduce_views(views: list[torch.Tensor], group) -> None:
    """Sum tensors (views into a DDP bucket) over ``group`` in one collective, in place."""
    if group is None or dist.get_world_size(group) == 1:
        return
    flat = torch.cat(views) if len(views) > 1 else views[0]
    dist.all_reduce(flat, group=group)
    if len(views) > 1:
        start = 0
        for v in views:  # back into the bucket, where DDP reads the result
            v.copy_(flat[start:start + v.numel()])
            start += v.numel()


def wrap_data_parallel(model: nn.Module, mesh: ParallelMesh, device: torch.device,
                       layout: ParallelConfig | None = None, seed: int = 0) -> nn.Module:
    """Gradient synchronisation as the parameter tags ask: DDP over the dp group when dp > 1
    (with :func:`ddp_comm_hook` when some gradients are also summed over another dimension),
    else per-parameter hooks (nothing at all for a serial model on one rank)."""
    use_ddp = layout is None or not layout.noddp
    if mesh.dp_size > 1 and use_ddp:
        ids = [device.index] if device.type == "cuda" else None
        options = {} if layout is None else {
            "bucket_cap_mb": layout.bucket_cap_mb,
            **compat.ddp_buffer_sync(not layout.disable_broadcast_buffers),
            "gradient_as_bucket_view": True,
        }
        fake = dist.get_backend() == "fake"  # a dry run (scripts/dry_run.py): tensors without data
        if any(spec(p).expert for p in model.parameters()) or fake:
            options["init_sync"] = False  # no broadcast from rank 0: the ranks hold different experts
        ddp = DistributedDataParallel(model, device_ids=ids, process_group=mesh.dp_group, **options)
        if needs_grad_sum(model) or fake and layout is not None and layout.grad_compression == "none":
            # (DDP's own C++ all-reduce cannot run on fake tensors; the hook is the same average)
            ddp.register_comm_hook(None, ddp_comm_hook(mesh))
        elif layout is not None and layout.grad_compression != "none":  # imported only when compressing
            from distributed.compression import compress_gradients

            compress_gradients(ddp, layout, seed, mesh.dp_group)
        return ddp
    install_grad_sum_hooks(model, mesh)
    return model


def gradient_bytes(model: nn.Module, steps: int) -> int | None:
    """Bytes of gradients this rank handed to DDP's all-reduce over the last ``steps`` optimizer
    steps (None without DDP): counted by the compression hook when there is one
    (distributed/compression.py), else every gradient once per step in fp32 (DDP reduces every
    bucket once per step; accumulation's no_sync steps send nothing)."""
    if not isinstance(model, DistributedDataParallel):
        return None
    state = getattr(model, "comm_state", None)
    if state is not None:
        sent, state.bytes_sent = state.bytes_sent, 0
        return sent
    return steps * sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (or the model itself)."""
    return model.module if isinstance(model, DistributedDataParallel) else model
