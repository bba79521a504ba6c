"""Tensor- and context-parallel layers, each made from its serial counterpart, where a backbone's
plan puts them (networks/backbone.py: ``tp_plan``; distributed/parallelize.py applies it).

Tensor parallel (tp), after Megatron-LM: a block's first linear layers are split by
output features (column parallel, "colwise": the ViT's q, k, v and fc1), its last by input
features (row parallel, "rowwise": proj, fc2). Between them every rank works on its own heads or
its own slice of the MLP hidden features, with no communication; the row-parallel layer's partial
products are summed once (reduce_from). Its bias is added after that sum, once: adding
it on every rank before the sum would count it tp times.

Context parallel (cp): each rank holds a contiguous slice of the tokens. Everything but
attention is per token; attention gathers keys and values from every rank
(gather_sequence), so each rank's queries attend to the whole sequence.

Sequence parallel (sp, with tp), after Megatron-LM's second paper (Korthikanti et al. 2022):
outside the tensor-parallel regions (layer norms, dropout, residual adds) every tp rank would
hold the same activations; with sp each holds a slice of the tokens instead. A column-parallel
layer all-gathers the tokens first (backward: reduce-scatter), a row-parallel layer
reduce-scatters its partial sums (backward: all-gather): the same bytes as the all-reduce they
replace (an all-reduce is a reduce-scatter then an all-gather), tp times less activation
memory between them. The replicated parameters then see only their rank's tokens: their
gradients are summed over tp (distributed/tags.py).

Every layer here is made ``from_serial``: it keeps this rank's shard of the serial
layer's weights (a copy of its own), so the parallel model starts from exactly the serial
model's weights whatever the layout. The layers outside the plan (the ViT's layer norms, patch
embedding and head) stay whole on every rank (replicated). Parameter tags (distributed/tags.py)
record which is which.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distributed.mappings import (
    all_gather_along,
    copy_to,
    gather_from,
    gather_sequence,
    reduce_from,
    reduce_scatter_along,
    reduce_scatter_to,
    split_sizes,
)
from distributed.mesh import ParallelMesh
from distributed.tags import tag
from networks.backbone import AttentionCore


def _shard(t: torch.Tensor, dim: int, mesh: ParallelMesh) -> nn.Parameter:
    """This tp rank's contiguous slice of ``t`` along ``dim``, in memory of its own."""
    part = t.detach().chunk(mesh.size("tp"), dim=dim)[mesh.rank_in("tp")]
    return nn.Parameter(part.clone(memory_format=torch.contiguous_format))


class _GatherThenLinear(torch.autograd.Function):
    """Sequence parallel entry of a column-parallel layer: all-gather the tokens over tp, then
    the linear layer. It keeps only this rank's tokens for backward and gathers them again
    there (as Megatron-LM does): autograd's F.linear would keep the gathered input, tp times
    larger, and sequence parallelism would save little. Under autocast the product runs in
    autocast's dtype (``ctx.dtype``); backward casts as autocast did."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sizes):
        out = F.linear(all_gather_along(x, 1, group, sizes), weight, bias)  # (B, N, out / tp)
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.sizes, ctx.dtype = group, sizes, out.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        full = all_gather_along(x, 1, ctx.group, ctx.sizes).to(ctx.dtype)  # (B, N, in), again
        grad = grad.to(ctx.dtype)
        flat_grad = grad.reshape(-1, grad.shape[-1])
        grad_weight = (flat_grad.T @ full.reshape(-1, full.shape[-1])).to(weight.dtype)
        grad_bias = flat_grad.sum(0).to(weight.dtype)
        grad_full = grad @ weight.to(ctx.dtype)  # (B, N, in): this rank's features' part of it
        # summed over tp (every rank's features contributed), each rank keeps its own tokens
        grad_x = reduce_scatter_along(grad_full, 1, ctx.group, ctx.sizes).to(x.dtype)
        return grad_x, grad_weight, grad_bias, None, None


@torch.compiler.disable  # a collective inside: compiled graphs stop here (distributed/mappings.py)
def gather_then_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, group,
                       sizes: list[int]) -> torch.Tensor:
    return _GatherThenLinear.apply(x, weight, bias, group, sizes)


class ColumnParallelLinear(nn.Module):
    """y[:, my outputs] = x W[my outputs].T + b[my outputs]; weight and bias split along dim 0.
    The input enters the tensor-parallel region through copy_to (backward: all-reduce), or
    with sequence parallelism (``seq_sizes``: every tp rank's number of tokens) by an
    all-gather of the tokens (backward: reduce-scatter)."""

    def __init__(self, serial: nn.Linear, mesh: ParallelMesh, seq_sizes: list[int] | None = None) -> None:
        super().__init__()
        self.group, self.seq_sizes = mesh.group("tp"), seq_sizes
        self.weight = tag(_shard(serial.weight, 0, mesh), shard_dim=0)
        self.bias = tag(_shard(serial.bias, 0, mesh), shard_dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.seq_sizes is not None:
            return gather_then_linear(x, self.weight, self.bias, self.group, self.seq_sizes)
        return F.linear(copy_to(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum over tp of x[my inputs] W[:, my inputs].T, then + b (bias replicated, added once).
    With sequence parallelism the sum is a reduce-scatter: each rank keeps its own tokens."""

    def __init__(self, serial: nn.Linear, mesh: ParallelMesh, seq_sizes: list[int] | None = None) -> None:
        super().__init__()
        self.group, self.seq_sizes = mesh.group("tp"), seq_sizes
        self.weight = tag(_shard(serial.weight, 1, mesh), shard_dim=1)
        self.bias = tag(nn.Parameter(serial.bias.detach().clone()), shard_dim=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.seq_sizes is not None:
            return reduce_scatter_to(F.linear(x, self.weight), 1, self.group, self.seq_sizes) + self.bias
        return reduce_from(F.linear(x, self.weight), self.group) + self.bias


class ContextParallelAttention(AttentionCore):
    """Attention of this rank's queries (cp) to the keys and values of every rank's tokens.

    Shapes on one rank: q, k, v (B, n, h, head_dim) with n = its tokens and h its heads (all of
    them, or with tp its own: the ViT's projection is head-major, so a column-parallel slice
    holds whole heads) -> k, v gathered over cp to (B, N, h, head_dim) -> attention -> (B, n,
    h * head_dim). Backward sums every rank's gradients of the gathered keys and values."""

    def __init__(self, serial: AttentionCore, mesh: ParallelMesh, seq_sizes: list[int]) -> None:
        super().__init__(serial.dropout)
        self.cp_group, self.seq_sizes = mesh.group("cp"), seq_sizes

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k = gather_sequence(k, 1, self.cp_group, self.seq_sizes)
        v = gather_sequence(v, 1, self.cp_group, self.seq_sizes)
        return super().forward(q, k, v)


class SequenceSplit(nn.Module):
    """Context (``dim`` cp) or sequence (tp) parallel entry: this rank's contiguous slice of
    the tokens, (B, N, D) -> (B, n, D).

    A plain slice (backward: zeros for the other ranks' tokens), so every gradient before
    it is this rank's partial sum, summed over cp (and tp) like all others.
    """

    def __init__(self, sizes: list[int], mesh: ParallelMesh, dim: str = "cp") -> None:
        super().__init__()
        self.size = sizes[mesh.rank_in(dim)]
        self.start = sum(sizes[: mesh.rank_in(dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, self.start : self.start + self.size]


class SequenceGather(nn.Module):
    """Context (or sequence) parallel exit: all-gather the per-token outputs, (B, n, F) -> (B, N, F),
    so every rank gets the whole prediction for the loss. Backward keeps this rank's slice."""

    def __init__(self, sizes: list[int], mesh: ParallelMesh, dim: str = "cp") -> None:
        super().__init__()
        self.sizes, self.group = sizes, mesh.group(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_from(x, 1, self.group, self.sizes)


def sequence_sizes(num_tokens: int, mesh: ParallelMesh) -> list[int]:
    """Every cp rank's number of tokens."""
    return split_sizes(num_tokens, mesh.size("cp"))


def tp_sequence_sizes(num_tokens: int, mesh: ParallelMesh) -> list[int]:
    """Sequence parallel: every tp rank's number of tokens of this rank's cp slice."""
    return split_sizes(sequence_sizes(num_tokens, mesh)[mesh.rank_in("cp")], mesh.size("tp"))
