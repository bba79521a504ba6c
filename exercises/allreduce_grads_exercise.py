"""Exercise (data parallelism): what DDP does to the gradients, by hand.

Every rank computes gradients on its own shard of the batch; before the optimizer step, each
gradient is summed over the ranks (all-reduce) and divided by their number, so every rank
applies the same averaged update and the replicas stay identical. DDP does the same, in
buckets, overlapped with the backward pass.
"""

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)


def average_gradients(model: torch.nn.Module, group=None) -> None:
    # TODO: for every parameter with a gradient: all-reduce (sum) it over `group`, then
    # divide by the group's size (dist.get_world_size(group)).
    raise NotImplementedError("exercise: write average_gradients()")
