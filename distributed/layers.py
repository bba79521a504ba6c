"""Tensor- and context-parallel layers of the ViT, each made from its serial counterpart.

Tensor parallel (tp), after Megatron-LM: a block's first linear layers are split by
output features (column parallel: q, k, v, fc1), its last by input features (row
parallel: proj, fc2). Between them every rank works on its own heads or its own slice
of the MLP hidden features, with no communication; the row-parallel layer's partial
products are summed once (reduce_from). Its bias is added after that sum, once: adding
it on every rank before the sum would count it tp times.

Context parallel (cp): each rank holds a contiguous slice of the tokens. Everything but
attention is per token; attention gathers keys and values from every rank
(gather_sequence), so each rank's queries attend to the whole sequence.

Every layer here is made ``from_serial``: it keeps this rank's shard of the serial
layer's weights (a copy of its own), so the parallel model starts from exactly the serial
model's weights whatever the layout. Layer norms, the patch embedding and the head stay
whole on every rank (replicated). Parameter tags (distributed/tags.py) record which is which.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distributed.mappings import copy_to, gather_from, gather_sequence, reduce_from, split_sizes
from distributed.mesh import ParallelMesh
from distributed.tags import tag
from networks.vit import MLP, Attention, split_qkv


def _shard(t: torch.Tensor, dim: int, mesh: ParallelMesh) -> nn.Parameter:
    """This tp rank's contiguous slice of ``t`` along ``dim``, in memory of its own."""
    part = t.detach().chunk(mesh.size("tp"), dim=dim)[mesh.rank_in("tp")]
    return nn.Parameter(part.clone(memory_format=torch.contiguous_format))


class ColumnParallelLinear(nn.Module):
    """y[:, my outputs] = x W[my outputs].T + b[my outputs]; weight and bias split along dim 0.
    The input enters the tensor-parallel region through copy_to (backward: all-reduce)."""

    def __init__(self, serial: nn.Linear, mesh: ParallelMesh) -> None:
        super().__init__()
        self.group = mesh.group("tp")
        self.weight = tag(_shard(serial.weight, 0, mesh), shard_dim=0)
        self.bias = tag(_shard(serial.bias, 0, mesh), shard_dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum over tp of x[my inputs] W[:, my inputs].T, then + b (bias replicated, added once)."""

    def __init__(self, serial: nn.Linear, mesh: ParallelMesh) -> None:
        super().__init__()
        self.group = mesh.group("tp")
        self.weight = tag(_shard(serial.weight, 1, mesh), shard_dim=1)
        self.bias = tag(nn.Parameter(serial.bias.detach().clone()), shard_dim=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from(F.linear(x, self.weight), self.group) + self.bias


class DistributedMLP(nn.Module):
    """fc1 column parallel, GELU on this rank's hidden features, fc2 row parallel."""

    def __init__(self, serial: MLP, mesh: ParallelMesh) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(serial.fc1, mesh)
        self.fc2 = RowParallelLinear(serial.fc2, mesh)
        self.drop = nn.Dropout(serial.drop.p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.drop(F.gelu(self.fc1(x)))))


class DistributedAttention(nn.Module):
    """Self-attention over this rank's heads (tp) for this rank's queries (cp).

    Shapes on one rank: x (B, n, D) with n = its tokens -> qkv (B, n, 3D / tp), whole
    heads because the serial projection is head-major -> q, k, v (B, n, H / tp, head_dim)
    -> k, v gathered over cp to (B, N, H / tp, head_dim) -> attention per head
    (B, H / tp, n, head_dim) -> (B, n, D / tp) -> proj, summed over tp: (B, n, D).
    """

    def __init__(self, serial: Attention, mesh: ParallelMesh, seq_sizes: list[int]) -> None:
        super().__init__()
        self.cp_group, self.seq_sizes = mesh.group("cp"), seq_sizes
        self.head_dim = serial.head_dim
        self.qkv = ColumnParallelLinear(serial.qkv, mesh)
        self.proj = RowParallelLinear(serial.proj, mesh)
        self.dropout = serial.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = split_qkv(self.qkv(x), self.head_dim)
        k = gather_sequence(k, 1, self.cp_group, self.seq_sizes)
        v = gather_sequence(v, 1, self.cp_group, self.seq_sizes)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
        b, _, n, _ = out.shape
        return self.proj(out.transpose(1, 2).reshape(b, n, -1))


class SequenceSplit(nn.Module):
    """Context parallel entry: this rank's contiguous slice of the N tokens, (B, N, D) -> (B, n, D).

    A plain slice (backward: zeros for the other ranks' tokens), so every gradient before
    it is this rank's partial sum, summed over cp like all others.
    """

    def __init__(self, sizes: list[int], mesh: ParallelMesh) -> None:
        super().__init__()
        self.size = sizes[mesh.rank_in("cp")]
        self.start = sum(sizes[: mesh.rank_in("cp")])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, self.start : self.start + self.size]


class SequenceGather(nn.Module):
    """Context parallel exit: all-gather the per-token outputs, (B, n, F) -> (B, N, F), so every
    rank gets the whole prediction for the loss. Backward keeps this rank's slice."""

    def __init__(self, sizes: list[int], mesh: ParallelMesh) -> None:
        super().__init__()
        self.sizes, self.group = sizes, mesh.group("cp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_from(x, 1, self.group, self.sizes)


def sequence_sizes(num_tokens: int, mesh: ParallelMesh) -> list[int]:
    return split_sizes(num_tokens, mesh.size("cp"))
