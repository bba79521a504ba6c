"""Exercise (data parallelism): what DDP does to the gradients, by hand.

Every rank computes gradients on its own shard of the batch; before the optimizer step, each
gradient is summed over the ranks (all-reduce) and divided by their number, so every rank
applies the same averaged update and the replicas stay identical. DDP does the same, in
buckets, overlapped with the backward pass.
"""

import torch
import torch.distributed as dist


def average_gradients(model: torch.nn.Module, group=None) -> None:
    world = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
            p.grad /= world
