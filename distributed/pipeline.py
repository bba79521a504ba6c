"""Pipeline parallelism: the serial model cut into stages, run by torch.distributed.pipelining.

Each rank of a pipeline (pp) group holds a contiguous stage of the model's units (the ViT's
transformer blocks): the first stage also the stem (the ViT's patch embedding), the last the
tail (its norm and head). Stage s passes its output h (the ViT's tokens, (B, N, D)) to stage
s + 1 point to point, and in backward the gradient of h comes back; weights and their
gradients never travel between stages.

The local batch is split into ``num_microbatches`` micro-batches so that the stages can
work at the same time on different micro-batches. The schedule says in which order each
stage runs the forward (F) and backward (B) of its micro-batches:

- ``gpipe``: every forward, then every backward. Simple; each stage keeps the activations of
  all m micro-batches until their backward.
- ``1f1b``: after a warm-up of (stages - 1 - stage index) forwards, each stage alternates one
  forward and one backward, so at most p micro-batches are in flight: activation memory
  ~ p, not m. The idle time (the bubble) is the same as GPipe's, a fraction
  (p - 1) / (m + p - 1) of the step.
- ``interleaved_1f1b``: each rank holds ``stages_per_rank`` (v) smaller stages (rank r holds
  stages r, r + p, r + 2p, ...), so the pipeline fills v times faster: bubble
  (p - 1) / (v m + p - 1), at the price of v times more point-to-point messages.
- ``zero_bubble`` (interleaved, torch's ``ScheduleInterleavedZeroBubble``): each backward is
  split into the gradient of the stage's input (which the previous stage waits for) and of
  its weights (which nobody waits for), and the weight parts fill the idle slots.

All schedules flush at the end of every step (every micro-batch's backward is done before
the optimizer steps), so every micro-batch sees the same weights, as in the serial model.
``async_1f1b`` does not: distributed/async_pipeline.py runs it on the same stages.

Stages are cut by hand from the serial model (``Backbone.cut``), not traced, so the
parameters keep the serial names: checkpoints are consolidated and load into any layout.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distributed.env import all_reduce_sum
from distributed.mesh import ParallelMesh
from distributed.sharding import fsdp_active
from distributed.tags import unwrap
from networks.backbone import Backbone
from utils import device as dev
from utils.config_groups import INTERLEAVED, ParallelConfig

log = logging.getLogger(__name__)

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
             "interleaved_1f1b": "ScheduleInterleaved1F1B", "zero_bubble": "ScheduleInterleavedZeroBubble"}


def split_blocks(depth: int, n_stages: int) -> list[range]:
    """Contiguous block indices per stage, as equal as possible; when the blocks do not divide,
    the stages in the middle get one more (the first holds the embedding, the last the head)."""
    base, extra = divmod(depth, n_stages)
    middle = sorted(range(n_stages), key=lambda s: abs(s - (n_stages - 1) / 2))[:extra]
    ranges, start = [], 0
    for s in range(n_stages):
        n = base + (s in middle)
        ranges.append(range(start, start + n))
        start += n
    return ranges


def balanced_split(costs: list[float], n_stages: int) -> list[range]:
    """Contiguous items per stage, at least one each, such that the costliest stage costs as
    little as it can (a pipeline runs at the pace of its slowest stage). Dynamic programming:
    best[s][i] is the smallest possible largest cost of the first i items on s stages."""
    n = len(costs)
    if not 1 <= n_stages <= n:
        raise ValueError(f"{n} items do not fill {n_stages} stages of at least one each")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]  # where the last stage of that best starts
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):  # the s-th stage takes items j .. i - 1
                worst = max(best[s - 1][j], prefix[i] - prefix[j])
                if worst < best[s][i]:
                    best[s][i], cut[s][i] = worst, j
    ranges, end = [], n
    for s in range(n_stages, 0, -1):
        ranges.insert(0, range(cut[s][end], end))
        end = cut[s][end]
    return ranges


def rank_stages(pp_rank: int, pp: int, per_rank: int) -> list[int]:
    """The stages one rank holds: r, r + p, r + 2p, ... (the loop order interleaving expects)."""
    return [pp_rank + k * pp for k in range(per_rank)]


def describe_split(ranges: list[range], pp: int, labels: tuple[str, str], prefix: int = 0) -> str:
    """One line for the log: each stage's units and parts (``labels``: the stem's and the tail's
    names, ``Backbone.LABELS``)."""
    parts = []
    for s, r in enumerate(ranges):
        what = [f"blocks {r.start}-{r.stop - 1}" if len(r) > 1 else f"block {r.start}"]
        if s == 0 and prefix:
            frozen = f"blocks 0-{prefix - 1}" if prefix > 1 else "block 0"
            what.insert(0, f"(frozen, without autograd: {labels[0]} + {frozen})")
        elif s == 0:
            what.insert(0, labels[0])
        if s == len(ranges) - 1:
            what.append(labels[1])
        parts.append(f"stage {s} (rank {s % pp} of the pipeline): {' + '.join(what)}")
    return "; ".join(parts)


class Pipeline:
    """This rank's stages and the schedule that runs them. Stands in for the model in the
    Trainer: ``parameters()`` / ``named_parameters()`` are those of all its stages (serial
    names), ``step`` trains on a batch, ``forward`` predicts (on the last stage).

    ``prefix``: on the first stage's rank, the frozen embedding and first blocks (training/freezing.py),
    which run before the schedule without autograd: the first stage then takes their output
    tokens, and ``step`` is given those (a frozen prefix is off the schedule, as in PipeTransformer)."""

    def __init__(self, chunks: list[nn.Module], stage_ids: list[int], n_stages: int,
                 mesh: ParallelMesh, device: torch.device, layout: ParallelConfig,
                 token_shape: tuple[int, ...],
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 prefix: nn.Module | None = None) -> None:
        self.chunks, self.stage_ids, self.n_stages = chunks, stage_ids, n_stages
        self.prefix = prefix
        self.group, self.pp, self.pp_rank = mesh.group("pp"), mesh.size("pp"), mesh.rank_in("pp")
        self.peers = dist.get_process_group_ranks(self.group)  # global rank of each pp rank
        self.device = device
        # FSDP reduce-scatters each stage's gradients itself (torch's stage does it once, after
        # the last micro-batch). DDP is not used: its reducer inside torch's pipeline stages
        # failed an internal check (every gradient counted twice when it rebuilds its buckets)
        # intermittently with 1F1B and always with zero-bubble, so the stage averages its
        # gradients once the schedule has flushed (no overlap with the last backward).
        self.dp_group = mesh.dp_group
        self.average_over_dp = mesh.dp_size > 1 and not fsdp_active(layout, mesh) and not layout.noddp
        self.is_first, self.is_last = 0 in stage_ids, n_stages - 1 in stage_ids
        self.token_shape = token_shape  # the ViT's (N, D): what passes between stages, per sample
        self.start_schedule(layout, loss_fn)

    def start_schedule(self, layout: ParallelConfig,
                       loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """torch's pipeline stages around this rank's chunks, and the schedule that runs them
        (distributed/async_pipeline.py runs its own instead)."""
        from torch.distributed import pipelining

        self.stages = [pipelining.PipelineStage(c, i, self.n_stages, self.device, group=self.group)
                       for c, i in zip(self.chunks, self.stage_ids)]
        schedule = getattr(pipelining, SCHEDULES[layout.pipeline_schedule])
        # scale_grads: each micro-batch's loss is its mean; the gradients are divided by their
        # number, so the step's gradient is that of the mean over the whole batch
        self.schedule = schedule(self.stages if layout.pipeline_schedule in INTERLEAVED else self.stages[0],
                                 n_microbatches=layout.num_microbatches, loss_fn=loss_fn, scale_grads=True)

    # --------------------------------------------------------- the model's interface ---
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        if self.prefix is not None:
            yield from self.prefix.named_parameters()
        for chunk in self.chunks:
            yield from unwrap(chunk).named_parameters()

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def train(self, mode: bool = True) -> Pipeline:
        for chunk in [self.prefix, *self.chunks] if self.prefix is not None else self.chunks:
            chunk.train(mode)
        return self

    def eval(self) -> Pipeline:
        return self.train(False)

    # ------------------------------------------------------------------- running ---
    def step(self, inp: torch.Tensor, tar: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every micro-batch, as the schedule orders them; returns the
        batch's mean loss on every stage (one small all-reduce over pp: only the last has it)."""
        losses: list[torch.Tensor] = []
        args = (inp,) if self.is_first else ()
        self.schedule.step(*args, target=tar if self.is_last else None, losses=losses)
        if self.average_over_dp:
            average_gradients(list(self.parameters()), self.dp_group)
        loss = torch.stack(losses).mean().detach() if self.is_last else \
            torch.zeros((), device=self.device)
        return all_reduce_sum(loss, self.group)

    @torch.no_grad()
    def forward(self, inp: torch.Tensor) -> torch.Tensor | None:
        """Prediction for validation: no schedule needed, the batch goes through the stages one
        after the other (each rank receives, runs its stage, sends). The output exists on the
        last stage only (None elsewhere)."""
        x = inp if self.prefix is None or not self.is_first else self.prefix(inp)
        for s in range(self.n_stages):
            if s % self.pp != self.pp_rank:
                continue
            if s > 0:  # tokens from the previous stage, sent in fp32 whatever the compute dtype
                x = torch.empty(inp.shape[0], *self.token_shape, device=self.device)
                dist.recv(x, src=self.peers[(s - 1) % self.pp], group=self.group)
            x = self.chunks[self.stage_ids.index(s)](x)
            if s < self.n_stages - 1:
                dist.send(x.float().contiguous(), dst=self.peers[(s + 1) % self.pp], group=self.group)
        return x if self.is_last else None

    def from_last_stage(self, obj: Any) -> Any:
        """``obj`` of the last stage's rank, on every rank of the pipeline (a small object)."""
        box = [obj]
        dist.broadcast_object_list(box, src=self.peers[-1], group=self.group)
        return box[0]

    def gather_to_first(self, obj: Any) -> list[Any] | None:
        """Every pipeline rank's ``obj`` on the first stage's rank (None on the others)."""
        first = self.pp_rank == 0
        out: list[Any] | None = [None] * self.pp if first else None
        dist.gather_object(obj, out, dst=self.peers[0], group=self.group)
        return out

    def record_timeline(self, events: list[tuple[str, int, int, float, float]]) -> None:
        """From now on append (kind, stage, micro-batch, start, end) for every forward ("F") and
        backward ("B") a stage runs (``time.perf_counter`` seconds). The time a stage waits
        for its neighbour's tensors falls between the events: the bubble."""
        for stage in self.stages:
            for kind, name in (("F", "forward_one_chunk"), ("B", "backward_one_chunk"),
                               ("W", "backward_weight_one_chunk")):  # W: zero-bubble's weight part
                if hasattr(stage, name):
                    setattr(stage, name, _timed(getattr(stage, name), kind, stage.stage_index, events,
                                                self.device))


def average_gradients(params: list[nn.Parameter], group: Any) -> None:
    """Average the gradients over the ranks of ``group`` with one all-reduce of all of them,
    flattened into one buffer (what DDP does bucket by bucket during backward)."""
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


def _timed(fn: Callable[..., Any], kind: str, stage: int, events: list,
           device: torch.device) -> Callable[..., Any]:
    """``fn`` with its start and end on the host clock. On a GPU the kernels run after the host
    has queued them: the device is synchronised before each reading, so that the times are
    the GPU's (a timeline only: it serialises the stage's work with the host)."""
    def run(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        dev.synchronize(device)
        start = time.perf_counter()
        out = fn(chunk_id, *args, **kwargs)
        dev.synchronize(device)
        events.append((kind, stage, chunk_id, start, time.perf_counter()))
        return out

    return run


def build(serial: Backbone, mesh: ParallelMesh, layout: ParallelConfig, device: torch.device,
          parallelize: Callable[[Backbone], nn.Module],
          loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
          kind: type[Pipeline] = Pipeline, ranges: list[range] | None = None, prefix: int = 0) -> Pipeline:
    """Cut ``serial`` into this rank's stages, make each one parallel over the other dimensions
    (``parallelize``: tp, checkpointing, compile, DDP/FSDP over dp), and set up the schedule
    (``kind``: a subclass of Pipeline that runs another, distributed/async_pipeline.py's).
    ``ranges``: each stage's blocks (default: as equal as possible); ``prefix``: the embedding and
    that many first blocks are frozen and run before the schedule on the first stage's rank."""
    n_stages = layout.stages
    ranges = ranges or split_blocks(len(serial.units()), n_stages)
    token_shape = serial.unit_shape
    ids = rank_stages(mesh.rank_in("pp"), mesh.size("pp"), n_stages // mesh.size("pp"))
    if mesh.rank == 0:
        log.info("pipeline of %d stages, %s schedule, %d micro-batches: %s", n_stages,
                 layout.pipeline_schedule, layout.num_microbatches,
                 describe_split(ranges, mesh.size("pp"), serial.LABELS, prefix))
    frozen = None
    if prefix and 0 in ids:
        frozen = parallelize(copy.deepcopy(serial).cut(range(prefix), True, False))
    chunks = []
    for k, s in enumerate(ids):
        model = serial if k == len(ids) - 1 else copy.deepcopy(serial)  # one copy per stage
        chunks.append(parallelize(model.cut(ranges[s], s == 0 and not prefix, s == n_stages - 1)))
    return kind(chunks, ids, n_stages, mesh, device, layout, token_shape, loss_fn, frozen)
