"""Exercise (training models that do not fit): gradient accumulation with DDP's ``no_sync``.

When the batch a step should see does not fit in memory, split it into N micro-batches and run
forward and backward on each in turn. Backward adds into ``.grad``, so after the last micro-batch
the gradients are those of the whole batch, provided each micro-batch's loss is divided by N (the
mean over the whole batch, not the sum of N means).

Under DDP every backward all-reduces the gradients: N all-reduces per optimizer step where one
is enough, since the sum of the local gradients can be reduced once, at the end. Inside
``model.no_sync()`` (a context manager) backward only accumulates locally; run every micro-batch
but the last inside it and the last one outside, where DDP all-reduces the accumulated sum. This
is what ``Trainer.train_step`` (training/trainer.py) does with ``grad_accum_steps``.
"""

import contextlib
from collections.abc import Callable

import torch
from torch.nn.parallel import DistributedDataParallel


def accumulate_gradients(model: DistributedDataParallel,
                         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                         inp: torch.Tensor, tar: torch.Tensor, n_micro: int) -> torch.Tensor:
    """Forward and backward of this rank's batch (its size a multiple of ``n_micro``) as
    ``n_micro`` micro-batches, all-reducing the gradients once; returns the mean loss over the
    batch, detached. Only gradients: the optimizer step is the caller's."""
    micro = list(zip(inp.chunk(n_micro), tar.chunk(n_micro)))
    total = torch.zeros((), device=inp.device)
    for i, (x, y) in enumerate(micro):
        last = i == len(micro) - 1
        # inside no_sync backward only adds into .grad; the last backward all-reduces the sum
        with contextlib.nullcontext() if last else model.no_sync():
            loss = loss_fn(model(x), y) / n_micro
            loss.backward()
        total += loss.detach()
    return total
