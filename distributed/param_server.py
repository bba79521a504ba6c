"""A parameter server over point-to-point messages (gloo), without torch.distributed.rpc.

Rank 0 holds the weights; ranks 1 .. n are trainers. A trainer receives the weights with their
version (the number of updates that made them), computes a gradient on its next batch and sends
it back with that version; the server applies each gradient as it arrives, from whichever
trainer sent it first (a receive from any rank), and answers that trainer alone with the new
weights and version. Nobody waits for anybody else: a slow trainer delays only its own updates.

The price is staleness: the versions the server made between the weights a gradient was
computed at and its update. Every update the server applies finds the n - 1 other trainers
busy with weights it has just made older, so over N updates the staleness adds up to exactly
(n - 1) N, counting what the gradients still in flight at the end had gathered (the server
answers those with STOP, unused): a mean of about n - 1 however fast each trainer is, and a
slow trainer's gradients are the stale ones.

Messages: a header (float64: the version, and the batch's loss on the way in), then the flat
weights or gradient (all parameters in one fp32 vector, torch.nn.utils.parameters_to_vector's
order). A version of -1 tells a trainer to stop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

HEADER, PAYLOAD = 1, 2  # message tags
STOP = -1


@dataclass(frozen=True)
class Update:
    """One gradient the server received: whose, the version it was computed at, how many versions
    old it was then, the loss of its batch, when (seconds since the server began), and whether it
    was applied (the last one of each trainer, arriving after the run's updates, is not)."""

    trainer: int
    version: int
    staleness: int
    loss: float
    seconds: float
    applied: bool = True


def serve(weights: torch.Tensor, apply: Callable[[torch.Tensor], torch.Tensor], trainers: list[int],
          updates: int, done: list[Update] | None = None,
          after: Callable[[int, list[Update]], None] | None = None) -> list[Update]:
    """The server: send ``weights`` (version 0) to every trainer, then apply ``updates`` gradients
    in the order they arrive (``apply(gradient)`` returns the new flat weights), answering each
    sender with the new weights; once they are all applied, answer each trainer's next gradient
    with STOP (unused). Returns the log of every gradient received, in order. A resumed server is
    given the log it checkpointed (``done``): the versions go on from there. ``after(applied,
    log)`` follows each update (the checkpoints)."""
    log: list[Update] = list(done or [])
    applied, running = len(log), len(trainers)  # a checkpoint's log holds applied updates only
    start = time.perf_counter() - (log[-1].seconds if log else 0.0)
    for rank in trainers:
        _send(weights, applied, rank)
    header, grad = torch.empty(2, dtype=torch.float64), torch.empty_like(weights)
    while running:
        src = dist.recv(header, tag=HEADER)  # any trainer: the first to finish
        dist.recv(grad, src=src, tag=PAYLOAD)
        version, loss = int(header[0]), float(header[1])
        if applied < updates:
            weights = apply(grad)
        seconds = time.perf_counter() - start
        log.append(Update(src, version, applied - version, loss, seconds, applied < updates))
        applied = min(applied + 1, updates)
        if after is not None and log[-1].applied:
            after(applied, log)
        if log[-1].applied and applied < updates:
            _send(weights, applied, src)
        else:
            dist.send(torch.tensor([STOP, 0.0], dtype=torch.float64), src, tag=HEADER)
            running -= 1
    return log


def work(weights: torch.Tensor, gradient: Callable[[torch.Tensor], tuple[torch.Tensor, float]],
         server: int = 0) -> int:
    """A trainer: receive the weights into ``weights``, send ``gradient(weights)`` (the flat
    gradient and the batch's loss) with their version, until the server says stop. Returns the
    gradients sent."""
    sent = 0
    version = _recv(weights, server)
    while version != STOP:
        grad, loss = gradient(weights)
        dist.send(torch.tensor([version, loss], dtype=torch.float64), server, tag=HEADER)
        dist.send(grad, server, tag=PAYLOAD)
        sent += 1
        version = _recv(weights, server)
    return sent


def _send(weights: torch.Tensor, version: int, dst: int) -> None:
    dist.send(torch.tensor([version, 0.0], dtype=torch.float64), dst, tag=HEADER)
    dist.send(weights, dst, tag=PAYLOAD)


def _recv(weights: torch.Tensor, src: int) -> int:
    header = torch.empty(2, dtype=torch.float64)
    dist.recv(header, src=src, tag=HEADER)
    version = int(header[0])
    if version != STOP:
        dist.recv(weights, src=src, tag=PAYLOAD)
    return version
