"""Compressed gradients: DDP communication hooks that send fewer bytes, and count them.

DDP groups the gradients into buckets (``--bucket_cap_mb``) and, as soon as backward has
filled a bucket, hands it to a *communication hook*: a function ``hook(state, bucket)`` that
starts the bucket's reduction and returns a future of the averaged gradients. Without a hook
DDP all-reduces the fp32 bucket. ``--grad_compression`` installs one of torch's hooks
(``torch.distributed.algorithms.ddp_comm_hooks``) instead:

- ``bf16`` / ``fp16``: the bucket is cast to 16 bits, all-reduced, and cast back: half the
  bytes. bf16 keeps fp32's range and loses precision (8 bits of mantissa); fp16 keeps more
  precision but overflows above 65504.
- ``powersgd``: every gradient matrix G (n x m, a weight's gradient viewed as a matrix) is sent
  as two thin factors, P = G Q (n x r) and Q = G^T P (m x r), one power iteration per step
  (Vogels et al., 2019): (n + m) r numbers instead of n m. Vectors (biases, norms) and matrices
  too small to gain are all-reduced whole. The approximation is not the gradient: with *error
  feedback* (``--powersgd_error_feedback``, on by default) each rank keeps what the
  approximation left out and adds it to the next step's gradient, so no part of the gradient is
  lost for good, only delayed. 1-bit Adam and other error-compensated methods rest on the
  same idea. The first two steps are sent uncompressed (torch's hook starts compressing at its
  ``start_powerSGD_iter``, here 2, the earliest it allows with error feedback).

(DDP's ``register_comm_hook`` refuses torch's bf16 hook, by its name, unless CUDA and NCCL 2.10+
are there; gloo all-reduces bf16 as well, tested here, and DDP only sees the counting wrapper.)

Every hook here is wrapped to count the bytes each rank hands to all-reduce (the payload; a
ring all-reduce sends about twice that over the wire): the trainer logs them per step as
``grad_comm_bytes_per_step`` in metrics.jsonl.

Compression changes the gradients, so runs with it are not equal to the serial model: they
are compared with the uncompressed run on their validation loss (docs/04-communication.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from utils.config_groups import ParallelConfig

log = logging.getLogger(__name__)


@dataclass
class CountingState:
    """What the counting hook passes on to torch's hook, and the bytes counted so far."""

    hook: Any  # torch's hook: hook(inner, bucket) -> Future[Tensor]
    inner: Any  # its state: the process group, or a PowerSGDState
    bytes_sent: int = 0
    powersgd_numel: int = field(default=0)  # PowerSGDState's running count at the last bucket


# no annotations: DDP checks a hook's annotations, and `from __future__ import annotations` would
# make them strings it rejects
def counting_hook(state, bucket):
    """torch's hook for the bucket (a ``dist.GradBucket``), adding the bytes it all-reduces to
    ``state.bytes_sent``; returns torch's future of the averaged bucket."""
    buffer = bucket.buffer()
    inner = state.inner
    if isinstance(inner, powerSGD_hook.PowerSGDState):
        vanilla = inner.iter < inner.start_powerSGD_iter  # the hook sends the whole bucket then
        future = state.hook(inner, bucket)
        if vanilla:
            state.bytes_sent += buffer.numel() * buffer.element_size()
        else:  # the hook counts the elements it sends: the uncompressed tensors, P and Q
            sent = inner.total_numel_after_compression - state.powersgd_numel
            state.bytes_sent += int(sent) * buffer.element_size()
        state.powersgd_numel = inner.total_numel_after_compression
        return future
    state.bytes_sent += buffer.numel() * 2  # bf16 and fp16 send 2 bytes per gradient element
    return state.hook(inner, bucket)


def compress_gradients(ddp: DistributedDataParallel, layout: ParallelConfig, seed: int,
                       group: dist.ProcessGroup | None) -> CountingState:
    """Register the hook that ``layout.grad_compression`` names on ``ddp``; the counting state is
    kept as ``ddp.comm_state`` (read by :func:`distributed.tags.gradient_bytes`)."""
    if layout.grad_compression == "bf16":
        state = CountingState(default_hooks.bf16_compress_hook, group)
    elif layout.grad_compression == "fp16":
        state = CountingState(default_hooks.fp16_compress_hook, group)
    elif layout.grad_compression == "powersgd":
        # start_powerSGD_iter=2: the earliest torch allows with error feedback or warm start (DDP
        # rebuilds its buckets after the first step); min_compression_rate: torch's default (2)
        inner = powerSGD_hook.PowerSGDState(
            process_group=group, matrix_approximation_rank=layout.powersgd_rank, start_powerSGD_iter=2,
            use_error_feedback=layout.powersgd_error_feedback, warm_start=True,
            random_seed=seed)
        state = CountingState(powerSGD_hook.powerSGD_hook, inner)
    else:
        raise ValueError(f"unknown gradient compression {layout.grad_compression!r}")
    ddp.register_comm_hook(state, counting_hook)
    ddp.comm_state = state
    details = ""
    if layout.grad_compression == "powersgd":
        feedback = "on" if layout.powersgd_error_feedback else "off"
        details = f" (rank {layout.powersgd_rank}, error feedback {feedback})"
    log.info("gradients are all-reduced compressed: %s%s", layout.grad_compression, details)
    return state
