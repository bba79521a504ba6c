"""Exercise (model parallelism): the collectives of a tensor-parallel MLP.

fc1 is split by output features (column parallel) and fc2 by input features (row
parallel), so between them each rank works on its own slice of the hidden features with no
communication. Two collectives remain (distributed/mappings.py):
- before fc1, `copy_to`: identity forward; in backward the gradient of x is the sum of every
  rank's partial gradient, so it is all-reduced;
- after fc2, `reduce_from`: every rank holds a partial product, summed by an all-reduce;
  identity backward. fc2's bias is added after that sum, once: added on every rank before it,
  it would be counted tp times.
"""

import torch
import torch.nn.functional as F

from distributed.mappings import copy_to, reduce_from


def tp_mlp_forward(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                   b2: torch.Tensor, group) -> torch.Tensor:
    """x (B, N, D) whole on every rank; w1 (H/tp, D), b1 (H/tp,), w2 (D, H/tp) this rank's
    shards; b2 (D,) whole. Returns the whole MLP output (B, N, D) on every rank."""
    x = copy_to(x, group)
    hidden = F.gelu(F.linear(x, w1, b1))
    return reduce_from(F.linear(hidden, w2), group) + b2
