"""Collectives that autograd understands: the glue between tensor- or context-parallel layers.

Each function takes its process group explicitly. ``group=None`` or a group of one rank
makes every function the identity (forward and backward), so a layer written with them
also runs on one process without a process group.

| function         | forward                      | backward                              |
|------------------|------------------------------|---------------------------------------|
| copy_to          | identity                     | all-reduce (sum)                      |
| reduce_from      | all-reduce (sum)             | identity                              |
| scatter_to       | keep this rank's slice       | all-gather the slices                 |
| gather_from      | all-gather the slices        | keep this rank's slice                |
| gather_sequence  | all-gather the slices        | reduce-scatter: sum, keep own slice   |
| reduce_scatter_to| reduce-scatter               | all-gather the slices                 |
| all_to_all       | rows i..j to each rank       | the reverse all-to-all                |

Slices may be uneven: ``sizes`` lists every rank's length along ``dim`` (default: as even
as possible, the first ``n % ranks`` ranks one longer, see :func:`split_sizes`).

The collectives run inside ``torch.autograd.Function``; torch.compile cannot trace those,
so the public functions are excluded from compiled graphs (``torch.compiler.disable``):
the compiler compiles the pieces between them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def split_sizes(n: int, parts: int) -> list[int]:
    """``n`` items over ``parts`` ranks as evenly as possible: 10 over 4 -> [3, 3, 2, 2]."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def _world(group) -> int:
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _rank(group) -> int:
    return dist.get_rank(group) if _world(group) > 1 else 0


def _sizes(x: torch.Tensor, dim: int, group, sizes: list[int] | None, total: bool) -> list[int]:
    """Per-rank lengths along ``dim``; ``total`` says whether ``x`` is the whole tensor."""
    world = _world(group)
    if sizes is None:
        if not total:  # local slices: they are even by default, so the whole is world x local
            return [x.shape[dim]] * world
        return split_sizes(x.shape[dim], world)
    if len(sizes) != world:
        raise ValueError(f"{len(sizes)} slice sizes given for a group of {world} ranks")
    return list(sizes)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if _world(group) == 1:
        return x
    x = x.contiguous().clone()  # never change the caller's tensor in place
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def _split(x: torch.Tensor, dim: int, group, sizes: list[int]) -> torch.Tensor:
    if _world(group) == 1:
        return x
    rank = _rank(group)
    return x.narrow(dim, sum(sizes[:rank]), sizes[rank]).contiguous()


def all_gather_along(x: torch.Tensor, dim: int, group, sizes: list[int]) -> torch.Tensor:
    """Concatenate every rank's slice along ``dim``. gloo and NCCL all-gather equal shapes
    only, so uneven slices are padded to the longest and trimmed after."""
    world = _world(group)
    if world == 1:
        return x
    x = x.contiguous()
    longest = max(sizes)
    if x.shape[dim] < longest:
        pad_shape = list(x.shape)
        pad_shape[dim] = longest - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)


# backends with a reduce-scatter (dist.reduce_scatter_tensor) in every supported torch; gloo's
# is an all-reduce inside, NCCL's sends each rank only its slice's sum: half an all-reduce's bytes
REDUCE_SCATTER_BACKENDS = ("nccl", "gloo")


def _backend(x: torch.Tensor, group) -> str:
    """The backend of ``group`` for ``x``'s device ('cpu:gloo,cuda:nccl' names one per device)."""
    backends = str(dist.get_backend(group))
    for entry in backends.split(","):
        device, _, name = entry.rpartition(":")
        if not device or device == x.device.type:
            return name
    return backends


def reduce_scatter_along(x: torch.Tensor, dim: int, group, sizes: list[int]) -> torch.Tensor:
    """Sum over ranks, keep this rank's slice along ``dim``. A reduce-scatter takes equal slices
    laid out along dim 0: ``dim`` goes first and uneven slices are padded to the longest. A
    backend without one (not in REDUCE_SCATTER_BACKENDS) all-reduces and slices: the same result
    for about twice the bytes."""
    world = _world(group)
    if world == 1:
        return x
    if _backend(x, group) not in REDUCE_SCATTER_BACKENDS:
        return _split(_all_reduce(x, group), dim, group, sizes)
    longest, first = max(sizes), x.movedim(dim, 0)  # (L, ...), L = sum(sizes)
    if len(set(sizes)) > 1:
        first = torch.cat([torch.cat([p, p.new_zeros((longest - len(p), *p.shape[1:]))])
                           for p in first.split(sizes)])  # (world x longest, ...)
    out = x.new_empty((longest, *first.shape[1:]))
    dist.reduce_scatter_tensor(out, first.contiguous(), op=dist.ReduceOp.SUM, group=group)
    return out[:sizes[_rank(group)]].movedim(0, dim).contiguous()


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, sizes):
        ctx.dim, ctx.group, ctx.sizes = dim, group, sizes
        return _split(x, dim, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, ctx.dim, ctx.group, ctx.sizes), None, None, None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, sizes):
        ctx.dim, ctx.group, ctx.sizes = dim, group, sizes
        return all_gather_along(x, dim, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.group, ctx.sizes), None, None, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, sizes):
        ctx.dim, ctx.group, ctx.sizes = dim, group, sizes
        return all_gather_along(x, dim, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_along(grad, ctx.dim, ctx.group, ctx.sizes), None, None, None


class _ReduceScatterTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, sizes):
        ctx.dim, ctx.group, ctx.sizes = dim, group, sizes
        return reduce_scatter_along(x, dim, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, ctx.dim, ctx.group, ctx.sizes), None, None, None


def _all_to_all(x: torch.Tensor, group, out_splits: list[int] | None,
                in_splits: list[int] | None) -> torch.Tensor:
    rows = sum(out_splits) if out_splits is not None else x.shape[0]
    out = x.new_empty((rows, *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return _all_to_all(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        # the gradient of what a rank received goes back to the rank that sent it: the same
        # collective with the splits swapped
        return _all_to_all(grad, ctx.group, ctx.in_splits, ctx.out_splits), None, None, None


@torch.compiler.disable
def copy_to(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a tensor-parallel region. Forward: identity. Backward: all-reduce (sum) the
    gradient, because every rank's slice of the following layer contributed a part of it."""
    return _CopyTo.apply(x, group) if _world(group) > 1 else x


@torch.compiler.disable
def reduce_from(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a tensor-parallel region. Forward: all-reduce (sum) the partial results.
    Backward: identity (every rank needs the whole gradient of the sum)."""
    return _ReduceFrom.apply(x, group) if _world(group) > 1 else x


@torch.compiler.disable
def scatter_to(x: torch.Tensor, dim: int, group, sizes: list[int] | None = None) -> torch.Tensor:
    """Forward: keep this rank's slice of ``x`` along ``dim``. Backward: all-gather the
    slices' gradients into the gradient of the whole."""
    if _world(group) == 1:
        return x
    return _ScatterTo.apply(x, dim, group, _sizes(x, dim, group, sizes, total=True))


@torch.compiler.disable
def gather_from(x: torch.Tensor, dim: int, group, sizes: list[int] | None = None) -> torch.Tensor:
    """Forward: all-gather every rank's slice along ``dim``. Backward: keep this rank's slice
    of the gradient (each rank holds the same whole gradient, so no sum is needed)."""
    if _world(group) == 1:
        return x
    return _GatherFrom.apply(x, dim, group, _sizes(x, dim, group, sizes, total=False))


@torch.compiler.disable
def gather_sequence(x: torch.Tensor, dim: int, group, sizes: list[int] | None = None) -> torch.Tensor:
    """Context-parallel K and V. Forward: all-gather every rank's tokens along ``dim``.
    Backward: every rank's queries produced a gradient for all keys and values, so the
    gradients are summed over ranks and each keeps its own tokens' part (reduce-scatter)."""
    if _world(group) == 1:
        return x
    return _GatherSequence.apply(x, dim, group, _sizes(x, dim, group, sizes, total=False))


@torch.compiler.disable
def reduce_scatter_to(x: torch.Tensor, dim: int, group, sizes: list[int] | None = None) -> torch.Tensor:
    """Sequence parallel exit of a row-parallel layer. Forward: sum the partial results over the
    ranks and keep this rank's slice of the tokens (the all-reduce of tensor parallelism, cut in
    half: its reduce-scatter part). Backward: every rank needs the gradient of all the tokens it
    summed, so the slices' gradients are all-gathered."""
    if _world(group) == 1:
        return x
    return _ReduceScatterTo.apply(x, dim, group, _sizes(x, dim, group, sizes, total=True))


@torch.compiler.disable
def all_to_all(x: torch.Tensor, group, out_splits: list[int] | None = None,
               in_splits: list[int] | None = None) -> torch.Tensor:
    """Expert parallelism's exchange. Forward: rank r sends rows ``in_splits[s]`` of ``x`` (in
    order) to each rank s, and receives ``out_splits[s]`` rows from each s, stacked in rank
    order (no splits: equal parts). Backward: the reverse all-to-all, each row's gradient back
    to the rank it came from. (torch has the same, with autograd, as
    ``torch.distributed.nn.functional.all_to_all_single``.)"""
    if _world(group) == 1:
        return x
    return _AllToAll.apply(x, group, out_splits, in_splits)
