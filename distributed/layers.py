"""Tensor- and context-parallel layers of the ViT.

Tensor parallel (tp), after Megatron-LM: a block's first linear layers are split by
output features (column parallel: q, k, v, fc1), its last by input features (row
parallel: proj, fc2). Between them every rank works on its own heads or its own slice
of the MLP hidden features, with no communication; the row-parallel layer's partial
products are summed once (reduce_from). Its bias is added after that sum, once: adding
it on every rank before the sum would count it tp times.

Context parallel (cp): each rank holds a contiguous slice of the tokens. Everything but
attention is per token; attention gathers keys and values from every rank
(gather_sequence), so each rank's queries attend to the whole sequence.

Layer norms, the patch embedding and the head stay whole on every rank (replicated).
Parameter tags (distributed/helpers.py) record which is which.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distributed.helpers import tag
from distributed.mappings import copy_to, gather_from, gather_sequence, reduce_from, split_sizes
from utils.comm import Comm


class ColumnParallelLinear(nn.Module):
    """y[:, my outputs] = x W[my outputs].T + b[my outputs]; weight and bias split along dim 0.

    ``copy_input=False`` when the caller already applied copy_to (attention shares one
    copy_to between q, k and v so that backward does one all-reduce, not three).
    """

    def __init__(self, in_features: int, out_features: int, comm: Comm, copy_input: bool = True) -> None:
        super().__init__()
        self.comm, self.copy_input = comm, copy_input
        local = out_features // comm.tp_size
        self.weight = tag(nn.Parameter(torch.empty(local, in_features)), shard_dim=0)
        self.bias = tag(nn.Parameter(torch.empty(local)), shard_dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = copy_to(x, self.comm.tp_group)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum over tp of x[my inputs] W[:, my inputs].T, then + b (bias replicated, added once)."""

    def __init__(self, in_features: int, out_features: int, comm: Comm) -> None:
        super().__init__()
        self.comm = comm
        local = in_features // comm.tp_size
        self.weight = tag(nn.Parameter(torch.empty(out_features, local)), shard_dim=1)
        self.bias = tag(nn.Parameter(torch.empty(out_features)), shard_dim=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from(F.linear(x, self.weight), self.comm.tp_group) + self.bias


class DistributedMLP(nn.Module):
    """fc1 column parallel, GELU on this rank's hidden features, fc2 row parallel."""

    def __init__(self, dim: int, hidden: int, comm: Comm, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(dim, hidden, comm)
        self.fc2 = RowParallelLinear(hidden, dim, comm)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.drop(F.gelu(self.fc1(x)))))


class DistributedAttention(nn.Module):
    """Self-attention over this rank's heads (tp) for this rank's queries (cp).

    Shapes on one rank: x (B, n, D) with n = its tokens -> q, k, v (B, n, D / tp) ->
    k, v gathered over cp to (B, N, D / tp) -> heads (B, H / tp, ., head_dim) ->
    attention (B, H / tp, n, head_dim) -> (B, n, D / tp) -> proj, summed over tp: (B, n, D).
    """

    def __init__(self, dim: int, num_heads: int, comm: Comm, seq_sizes: list[int],
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.comm, self.seq_sizes = comm, seq_sizes
        self.head_dim = dim // num_heads
        self.q = ColumnParallelLinear(dim, dim, comm, copy_input=False)
        self.k = ColumnParallelLinear(dim, dim, comm, copy_input=False)
        self.v = ColumnParallelLinear(dim, dim, comm, copy_input=False)
        self.proj = RowParallelLinear(dim, dim, comm)
        self.dropout = dropout

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape  # (B, n, heads * head_dim) -> (B, heads, n, head_dim)
        return x.view(b, n, -1, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to(x, self.comm.tp_group)
        q = self.q(x)
        k = gather_sequence(self.k(x), 1, self.comm.cp_group, self.seq_sizes)
        v = gather_sequence(self.v(x), 1, self.comm.cp_group, self.seq_sizes)
        q, k, v = (self._split_heads(t) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
        b, _, n, _ = out.shape
        return self.proj(out.transpose(1, 2).reshape(b, n, -1))


class SequenceSplit(nn.Module):
    """Context parallel entry and exit: this rank's contiguous slice of the N tokens.

    ``local`` is a plain slice (backward: zeros for the other ranks' tokens), so every
    gradient before it is this rank's partial sum, summed over cp like all others.
    ``gather`` all-gathers the per-token outputs; backward keeps this rank's slice.
    """

    def __init__(self, num_tokens: int, comm: Comm) -> None:
        super().__init__()
        self.comm = comm
        self.sizes = split_sizes(num_tokens, comm.cp_size)
        self.start = sum(self.sizes[: comm.cp_rank])

    def local(self, x: torch.Tensor) -> torch.Tensor:
        if self.comm.cp_size == 1:
            return x
        return x[:, self.start : self.start + self.sizes[self.comm.cp_rank]]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return gather_from(x, 1, self.comm.cp_group, self.sizes)
