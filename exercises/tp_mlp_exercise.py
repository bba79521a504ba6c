"""Exercise (model parallelism): the collectives of a tensor-parallel MLP.

fc1 is split by output features (column parallel) and fc2 by input features (row
parallel), so between them each rank works on its own slice of the hidden features with no
communication. Two collectives remain; see distributed/mappings.py for what `copy_to` and
`reduce_from` do in forward and in backward, and decide where each belongs. Mind fc2's bias:
where must it be added so that it counts once, not tp times?
"""

import torch
import torch.nn.functional as F  # noqa: F401  (you will need it)

from distributed.mappings import copy_to, reduce_from  # noqa: F401  (you will need them)


def tp_mlp_forward(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                   b2: torch.Tensor, group) -> torch.Tensor:
    """x (B, N, D) whole on every rank; w1 (H/tp, D), b1 (H/tp,), w2 (D, H/tp) this rank's
    shards; b2 (D,) whole. Returns the whole MLP output (B, N, D) on every rank."""
    # TODO 1: enter the tensor-parallel region (which mapping makes the gradient of x whole?)
    # TODO 2: fc1 with this rank's shard, then GELU
    # TODO 3: fc2 with this rank's shard, combine the ranks' partial products, add the bias once
    raise NotImplementedError("exercise: write tp_mlp_forward()")
