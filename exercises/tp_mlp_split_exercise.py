"""Exercise (model parallelism, harder): split a serial MLP's weights over tensor-parallel
ranks yourself, then run the tensor-parallel forward.

fc1 (hidden x dim) is column parallel: each rank keeps a contiguous block of its output
features (rows of the weight, and the matching bias entries). fc2 (dim x hidden) is row
parallel: each rank keeps the matching block of its input features (columns of the weight);
its bias is not split, every rank keeps all of it and adds it once, after the sum.
"""

import torch
import torch.nn.functional as F  # noqa: F401  (you will need it)

from distributed.mappings import copy_to, reduce_from  # noqa: F401  (you will need them)


def shard_mlp(fc1_weight: torch.Tensor, fc1_bias: torch.Tensor, fc2_weight: torch.Tensor,
              fc2_bias: torch.Tensor, rank: int, tp: int) -> tuple[torch.Tensor, ...]:
    """This rank's (w1, b1, w2, b2) from the serial weights, each a tensor of its own."""
    # TODO 1: the block of hidden features this rank owns (hidden // tp of them, in rank order)
    # TODO 2: w1 and b1: those rows of fc1; w2: those columns of fc2; b2: all of fc2's bias.
    #         .clone() each: a slice is a view that would keep the whole tensor alive.
    raise NotImplementedError("exercise: write shard_mlp()")


def tp_mlp_forward(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                   b2: torch.Tensor, group) -> torch.Tensor:
    """x (B, N, D) whole on every rank; the shards of shard_mlp. The whole output on every rank."""
    # TODO 3: as in the tp_mlp exercise: copy_to, fc1 + GELU, fc2, reduce_from, the bias once
    raise NotImplementedError("exercise: write tp_mlp_forward()")
