"""Exercise (communication): a DDP communication hook that sends the gradients in bf16.

DDP calls ``hook(state, bucket)`` once per gradient bucket, as soon as backward has filled it,
and expects a future whose value is the averaged bucket. Here ``state`` is the process group.
Sending bf16 halves the bytes: cast the bucket to bf16, divide by the number of ranks (before
the sum, so that the sum stays in range), all-reduce asynchronously, and when it completes
copy the result back into the fp32 bucket (``bucket.buffer()``) and return it.
"""

import torch
import torch.distributed as dist


def bf16_hook(group, bucket):  # no annotations: DDP checks a hook's annotations
    buffer = bucket.buffer()  # all of the bucket's gradients, flat, fp32
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    work = dist.all_reduce(compressed, group=group, async_op=True)

    def decompress(fut):
        buffer.copy_(fut.value()[0])  # back to fp32, in place: DDP reads the bucket's buffer
        return buffer

    return work.get_future().then(decompress)
