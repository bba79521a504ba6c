"""Exercise (model parallelism, harder): split a serial MLP's weights over tensor-parallel
ranks yourself, then run the tensor-parallel forward.

fc1 (hidden x dim) is column parallel: each rank keeps a contiguous block of its output
features (rows of the weight, and the matching bias entries). fc2 (dim x hidden) is row
parallel: each rank keeps the matching block of its input features (columns of the weight);
its bias is not split, every rank keeps all of it and adds it once, after the sum.
"""

import torch
import torch.nn.functional as F

from distributed.mappings import copy_to, reduce_from


def shard_mlp(fc1_weight: torch.Tensor, fc1_bias: torch.Tensor, fc2_weight: torch.Tensor,
              fc2_bias: torch.Tensor, rank: int, tp: int) -> tuple[torch.Tensor, ...]:
    """This rank's (w1, b1, w2, b2) from the serial weights, each a tensor of its own."""
    hidden = fc1_weight.shape[0]
    rows = slice(rank * hidden // tp, (rank + 1) * hidden // tp)
    return (fc1_weight[rows].clone(), fc1_bias[rows].clone(), fc2_weight[:, rows].clone(),
            fc2_bias.clone())


def tp_mlp_forward(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                   b2: torch.Tensor, group) -> torch.Tensor:
    """x (B, N, D) whole on every rank; the shards of shard_mlp. The whole output on every rank."""
    x = copy_to(x, group)
    hidden = F.gelu(F.linear(x, w1, b1))
    return reduce_from(F.linear(hidden, w2), group) + b2
