"""An asynchronous pipeline: 1F1B with no flush between steps (PipeDream), on the stages that
distributed/pipeline.py cuts.

The flushed schedules (distributed/pipeline.py) finish every micro-batch's backward before the
optimizer steps, so the pipeline fills and drains every step: the bubble. Here the micro-batches
of a step follow those of the step before without a pause. Stage s of p keeps d = p - 1 - s
micro-batches in flight beyond the one it works on (1F1B's warm-up, once per run), then, for
every micro-batch v it receives, runs its forward F(v) and the backward B(v - d) of the oldest
one in flight, and steps its optimizer as soon as it has the backward of a step's last
micro-batch. By the time B(v - d) runs, the stage's weights may have changed since F(v - d)
did. Which weights the backward uses is the mode (``weight_stashing``):

- ``none``: the stage's newest weights: the gradient of a function the forward did not
  compute, the mistake stashing prevents;
- ``stash`` (PipeDream's weight stashing): the version the micro-batch's forward used, kept
  until its backward. Stage s holds p - s versions, and its update uses a gradient p - 1 - s
  steps old (with one micro-batch per step);
- ``vertical`` (vertical sync): every stage uses the version the first stage used for that
  micro-batch: one consistent model, p - 1 updates old (one micro-batch per step); every stage
  keeps p versions, the later ones because their newest weights are ahead of what arrives;
- ``2bw`` (PipeDream-2BW): every micro-batch of step n uses the version the first stage had
  when the step began, so W(n + 1) = W(n) - lr grad f(W(n - 1)) with two versions on every
  stage (given at least p - 1 micro-batches per step).

Which version the first stage uses for a micro-batch follows from its number alone (the schedule
is fixed: :meth:`StageEngine.version_of`), so every stage works it out itself (PipeDream sends it
along with the activations) and knows exactly which versions a micro-batch still to come needs.

Each stage keeps the input of every micro-batch in flight and recomputes its forward in backward
at the weights the mode names (activation recomputation). A weight version is then a plain copy,
made when the optimizer is about to overwrite weights that a micro-batch in flight (or, with
vertical sync and 2BW, one still to come) needs, and nothing autograd saved can go stale. The
last stage runs each backward right after its forward and keeps the graph instead.

A checkpoint drains the pipeline first (:meth:`StageEngine.drain`: the backward and update of
every micro-batch in flight): it holds one version of the weights, like every other checkpoint,
and the run continues, as a resumed one starts, with an empty pipeline.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from distributed.pipeline import Pipeline
from utils.config_groups import WEIGHT_STASHING, ParallelConfig

Weights = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Flight:
    """A micro-batch between its forward and its backward on this stage."""

    number: int  # micro-batches are numbered from the start of the run
    version: int  # of this stage's weights its forward used
    last_of_step: bool  # its backward completes the step's gradient: the stage updates then
    inp: torch.Tensor | None  # the stage's input, for the recomputed forward
    loss: torch.Tensor | None = None  # the last stage: the loss, its graph kept until backward
    leaves: Weights = field(default_factory=dict)  # ... and the weights that graph was built on


class PeerLinks:
    """Messages between neighbouring stages of the pipeline's process group: activations forward,
    their gradients back, one group of messages per micro-batch between two neighbours: the
    earlier stage sends an activation and receives the gradient its next backward needs, the
    later stage receives that activation and sends the gradient of its own last backward, kept
    until then. On NCCL a pair of ranks shares one stream and a send waits for its receive: a
    send posted alone before the other direction's receive would wait for ever, and a gradient
    left unreceived between steps would block validation's plain sends and receives. A drain
    sends the kept gradients at once (:meth:`release`)."""

    ACTIVATION, GRADIENT = 1, 2  # message tags (validation's forward uses 0)

    def __init__(self, group: Any, peers: list[int], pp_rank: int, device: torch.device) -> None:
        self.group, self.device = group, device
        self.prev = peers[pp_rank - 1] if pp_rank > 0 else None
        self.next = peers[pp_rank + 1] if pp_rank < len(peers) - 1 else None
        self.kept: torch.Tensor | None = None  # the gradient for the previous stage, not yet sent
        self.pending: list[Any] = []  # sends not waited for

    def exchange(self, out: torch.Tensor | None, shape: tuple[int, ...] | None) -> torch.Tensor | None:
        """With the next stage: send ``out`` (if any: not on the last stage), and receive a gradient
        of ``shape`` (if any: when a backward follows), in one group."""
        ops = [] if out is None else [  # fp32 whatever the compute dtype
            dist.P2POp(dist.isend, out.float().contiguous(), self.next, self.group, self.ACTIVATION)]
        grad = None if shape is None else torch.empty(shape, device=self.device)
        if grad is not None:
            ops.append(dist.P2POp(dist.irecv, grad, self.next, self.group, self.GRADIENT))
        self._run(ops, wait=grad is not None)
        return grad

    def recv_activation(self, shape: tuple[int, ...]) -> torch.Tensor:
        """With the previous stage: receive an activation, and send the gradient kept for it."""
        x = torch.empty(shape, device=self.device)
        ops = [dist.P2POp(dist.irecv, x, self.prev, self.group, self.ACTIVATION)]
        if self.kept is not None:
            ops.append(dist.P2POp(dist.isend, self.kept, self.prev, self.group, self.GRADIENT))
            self.kept = None
        self._run(ops, wait=True)
        return x

    def send_gradient(self, grad: torch.Tensor) -> None:
        self.kept = grad.float().contiguous()  # sent with the next activation's receive

    def release(self) -> None:
        """Send the kept gradient now (a drain: no activation comes from the previous stage)."""
        if self.kept is not None:
            self._run([dist.P2POp(dist.isend, self.kept, self.prev, self.group, self.GRADIENT)], wait=False)
            self.kept = None

    def flush(self) -> None:
        self.release()
        for work in self.pending:
            work.wait()
        self.pending = []

    def _run(self, ops: list[Any], wait: bool) -> None:
        if not ops:
            return
        works = dist.batch_isend_irecv(ops)
        if wait:
            for work in works:
                work.wait()
        else:
            self.pending += works


class StageEngine:
    """One stage of the asynchronous pipeline: its micro-batches in flight, its weight versions,
    its forward and backward. ``links`` carries the messages (:class:`PeerLinks`, or a test's
    queues in one process); ``update`` steps the stage's optimizer on the gradients the
    backward accumulated in its parameters' ``.grad`` (and clears them)."""

    def __init__(self, module: nn.Module, stage: int, n_stages: int, mode: str, microbatches: int,
                 loss_fn: LossFn, links: Any, update: Callable[[], None]) -> None:
        if mode not in WEIGHT_STASHING:
            raise ValueError(f"weight_stashing is {mode!r}; choose one of {', '.join(WEIGHT_STASHING)}")
        self.module, self.stage, self.mode, self.microbatches = module, stage, mode, microbatches
        self.n_stages = n_stages
        self.first, self.last = stage == 0, stage == n_stages - 1
        self.depth = n_stages - 1 - stage  # micro-batches in flight beyond the newest (1F1B's warm-up)
        self.loss_fn, self.links, self.update = loss_fn, links, update
        self.params: Weights = dict(module.named_parameters())  # the newest weights, updated in place
        self.version = 0  # updates applied so far
        self.stash: dict[int, Weights] = {}  # older versions still needed, by version
        self.flights: deque[Flight] = deque()
        self.number = 0  # micro-batches forwarded
        self.start = (0, 0)  # (micro-batch, version) where the pipeline last started empty
        self.most_versions = 1  # the most weight versions held at once (the newest counts)
        self.events: list | None = None  # (kind, stage, micro-batch, start, end) when recording
        self.shape: tuple[int, ...] = ()  # a micro-batch's tokens at a stage boundary

    # ------------------------------------------------------------------ a step ---
    def step(self, inputs: list[torch.Tensor | None], targets: list[torch.Tensor | None],
             shape: tuple[int, ...]) -> list[torch.Tensor]:
        """Every micro-batch of one step through this stage: its forward, then the backward of
        the oldest in flight once more than ``depth`` are. ``shape``: a micro-batch's activation
        at a stage boundary. Returns the micro-batches' losses (the last stage's, else none)."""
        self.begin_step(shape)
        losses = [self.micro_batch(x, target, j, len(inputs))
                  for j, (x, target) in enumerate(zip(inputs, targets))]
        return [loss for loss in losses if loss is not None]

    def begin_step(self, shape: tuple[int, ...]) -> None:
        self.shape = shape

    def micro_batch(self, x: torch.Tensor | None, target: torch.Tensor | None, j: int,
                    m: int) -> torch.Tensor | None:
        """Micro-batch j of m of this step: its forward, then the oldest one's backward once more
        than ``depth`` are in flight; its loss on the last stage."""
        loss, out = self.forward(x, target, last_of_step=j == m - 1)
        backward = len(self.flights) > self.depth
        grad = self.links.exchange(out, self.shape if backward and not self.last else None)
        if backward:
            self.backward(grad)
        return loss

    # --------------------------------------------------------- forward, backward ---
    def run(self, weights: Weights, x: torch.Tensor) -> torch.Tensor:
        """The stage's forward with these weights in place of its own (same module, same code)."""
        return functional_call(self.module, weights, (x,))

    def forward(self, x: torch.Tensor | None, target: torch.Tensor | None,
                last_of_step: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The micro-batch's forward at the weights the mode names: (its loss on the last stage,
        else None; its output for the next stage, else None)."""
        # the first stage's own copy: the data loader reuses the batch's memory after the step
        x = x.detach().clone() if self.first else self.links.recv_activation(self.shape)
        start = time.perf_counter()  # (waiting for the activation is not the forward's work)
        version = self.version_of(self.number) if self.mode in ("vertical", "2bw") else self.version
        flight = Flight(self.number, version, last_of_step, x)
        self.number += 1
        out = None
        if self.last:  # the backward follows at once: keep the graph (no update in between)
            flight.leaves = self._leaves(version)
            with torch.enable_grad():
                flight.loss = self.loss_fn(self.run(flight.leaves, x.requires_grad_(not self.first)),
                                           target)
        else:
            with torch.no_grad():
                out = self.run(self.weights(version), x)
        self.flights.append(flight)
        self.forget()
        self._count()
        self._record("F", flight.number, start)
        return (None if flight.loss is None else flight.loss.detach()), out

    def backward(self, grad_out: torch.Tensor | None) -> None:
        """The oldest micro-batch's backward, given the gradient of its output (None on the last
        stage), at the weights the mode names; the update when it completes a step's gradient."""
        start = time.perf_counter()
        f = self.flights.popleft()
        # each micro-batch's loss is its mean: dividing by their number makes the step's gradient
        # that of the whole batch's mean
        if f.loss is not None:
            leaves, out, grad_out, x = f.leaves, f.loss / self.microbatches, None, f.inp
        else:
            version = self.version if self.mode == "none" else f.version
            leaves = self._leaves(version)
            with torch.enable_grad():
                x = f.inp.requires_grad_(not self.first)
                out = self.run(leaves, x)
        # the gradients of the stage's input and of the weights it ran with, into their .grad:
        # the parameters' own when they were the version, else the stashed copies'
        torch.autograd.backward(out, grad_out, inputs=([] if self.first else [x]) + list(leaves.values()))
        if not self.first:
            self.links.send_gradient(x.grad)
        if leaves is not self.params:
            for p, w in zip(self.params.values(), leaves.values()):
                p.grad = w.grad if p.grad is None else p.grad.add_(w.grad)
        self.forget()  # this micro-batch's version may be needed no longer
        if f.last_of_step:
            self.apply_update()
        self._record("B", f.number, start)

    def _leaves(self, version: int) -> Weights:
        """Weights autograd can differentiate: the parameters themselves when they are the version,
        else the stashed copies as new parameters (sharing their memory)."""
        if version == self.version:
            return self.params
        return {n: nn.Parameter(w) for n, w in self.stash[version].items()}

    def drain(self) -> None:
        """The backward (and update) of every micro-batch in flight: afterwards every stage holds
        one version, all updates applied, and the next micro-batch starts a new warm-up."""
        self.links.release()  # the previous stage's drain needs it
        while self.flights:
            self.backward(None if self.last else self.links.exchange(None, self.shape))
            self.links.release()
        self.links.flush()
        self.stash.clear()
        self.start = (self.number, self.version)

    # ------------------------------------------------------------------ weights ---
    def version_of(self, number: int) -> int:
        """The first stage's weight version when micro-batch ``number`` enters it (vertical sync,
        2BW). The first stage keeps p - 1 micro-batches in flight beyond the newest, so micro-batch
        j (counted from where the pipeline started empty) enters after the backward of j - p, that
        is after the updates of the steps whose last micro-batch is j - p or earlier. 2BW takes the
        version at its step's first micro-batch."""
        j, m = number - self.start[0], self.microbatches
        if self.mode == "2bw":
            j -= j % m
        return self.start[1] + max(0, (j - self.n_stages + 1) // m)

    def weights(self, version: int) -> Weights:
        return self.params if version == self.version else self.stash[version]

    def needed(self, version: int) -> bool:
        """Whether a forward or backward still to run uses this version of the weights."""
        if self.mode == "none":  # every forward and backward uses the newest
            return False
        if any(f.version == version for f in self.flights):
            return True
        # vertical sync and 2BW: what comes next uses the first stage's version for it, or a newer one
        return self.mode in ("vertical", "2bw") and version >= self.version_of(self.number)

    def apply_update(self) -> None:
        """The optimizer's step; the newest weights are copied first if anything still needs them."""
        if self.needed(self.version):
            self.stash[self.version] = {n: p.detach().clone() for n, p in self.params.items()}
        self.update()
        self.version += 1
        self._count()

    def forget(self) -> None:
        for version in [v for v in self.stash if not self.needed(v)]:
            del self.stash[version]

    def _count(self) -> None:
        self.most_versions = max(self.most_versions, 1 + len(self.stash))

    def _record(self, kind: str, number: int, start: float) -> None:
        if self.events is not None:
            self.events.append((kind, self.stage, number, start, time.perf_counter()))


class AsyncPipeline(Pipeline):
    """distributed/pipeline.py's Pipeline (the Trainer's model: parameters, validation's forward,
    checkpoints' gathers) with this module's schedule in place of torch's: one stage per rank.
    ``update`` (set by the step variant before training) steps the optimizer."""

    def start_schedule(self, layout: ParallelConfig, loss_fn: LossFn) -> None:
        self.microbatches = layout.num_microbatches
        self.update: Callable[[], None] = lambda: None
        self.unshared: list[tuple[torch.Tensor, Any]] = []  # losses on their way to every stage
        links = PeerLinks(self.group, self.peers, self.pp_rank, self.device)
        self.engine = StageEngine(self.chunks[0], self.stage_ids[0], self.n_stages, layout.weight_stashing,
                                  layout.num_microbatches, loss_fn, links, lambda: self.update())
        self.stages = []

    def step(self, inp: torch.Tensor, tar: torch.Tensor, share: bool = True) -> torch.Tensor:
        """One step's micro-batches into the pipeline (and older ones' backwards out of it).

        The last stage computes the step's mean loss; an all-reduce brings it to every stage
        without waiting for it: waiting would hold the first stage at the end of every step until
        the last had run the step's forwards, a fill of the pipeline per step. With ``share`` the
        stage waits for every loss on its way and returns their sum (the losses of the steps since
        the last share), else zero: the sum over a run's steps is the same, and so is what the
        loop adds up when it reads it (the step variant shares before every such read)."""
        m = self.microbatches
        inputs = list(inp.chunk(m)) if self.is_first else [None] * m
        targets = list(tar.chunk(m)) if self.is_last else [None] * m
        # a micro-batch's tokens at a stage boundary, (b / m, N, D): every stage knows the batch's
        # shape (the stages that do not read it keep it on the host)
        shape = (inp.shape[0] // m, *self.token_shape)
        losses = self.engine.step(inputs, targets, shape)
        loss = torch.stack(losses).mean() if self.is_last else torch.zeros((), device=self.device)
        self.unshared.append((loss, dist.all_reduce(loss, group=self.group, async_op=True)))
        return self.shared_loss() if share else torch.zeros((), device=self.device)

    def shared_loss(self) -> torch.Tensor:
        """The sum of the losses not yet shared, once every stage has them."""
        total = torch.zeros((), device=self.device)
        for loss, work in self.unshared:
            work.wait()
            total += loss
        self.unshared = []
        return total

    def drain(self) -> None:
        """Every micro-batch in flight through its backward and update (before a checkpoint)."""
        self.engine.drain()

    def record_timeline(self, events: list[tuple[str, int, int, float, float]]) -> None:
        """Every forward ("F") and backward ("B") this stage runs, numbered by micro-batch from
        the start of the run, as (kind, stage, micro-batch, start, end)."""
        self.engine.events = events
