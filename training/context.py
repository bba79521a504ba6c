"""What a run knows about where it runs (not configuration): device, ranks, mesh, run folder; what
a step is handed (:class:`StepParts`: the model, optimizer and the rest it uses, instead of the
Trainer); and who listens to it: the callbacks through which scripts that measure a run and tests
that inject faults hook into a few named moments of training/trainer.py's loop, instead of
changing it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from distributed.mesh import ParallelMesh
from utils.config import Config


class TrainingError(RuntimeError):
    """Training cannot go on (for example the loss became NaN)."""


@dataclass(frozen=True)
class RunContext:
    device: torch.device
    run_dir: Path
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    mesh: ParallelMesh = field(default_factory=lambda: ParallelMesh(sizes={"dp": 1}))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # data parallel: how many replicas see different data, and this rank's place
    @property
    def dp_size(self) -> int:
        return self.mesh.dp_size

    @property
    def dp_rank(self) -> int:
        return self.mesh.dp_rank

    @property
    def dp_group(self) -> Any:
        return self.mesh.dp_group


@dataclass(eq=False)
class StepParts:
    """What a step variant (training/trainer.py's EagerStep and the variants extending it) and the
    checkpoint's state classes (training/state.py) are handed instead of the Trainer: the
    configuration, where the run runs, what the Trainer built, and the loop's progress. One copy:
    the Trainer's attributes of these names are these fields (:class:`Part`)."""

    cfg: Config
    ctx: RunContext
    local_batch: int  # this data-parallel rank's samples per step
    train_data: Any = None  # utils/data_loader.py's Batches (or DALI's): its epoch length, last indices
    amp_mode: str = "none"  # the autocast precision of the forward ("none" where FSDP or an engine casts)
    attention_kernel: str = "default"  # utils/attention.py's kernel, kept on resume
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # (prediction, target)
    # built by the Trainer, the model and optimizer by the step variant; ``model`` is what steps
    # (DDP, FSDP or an engine around ``raw_model``, which has the serial names); freezing replaces it
    model: Any = None
    raw_model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    scaler: Any = None  # torch.amp.GradScaler for fp16, else None
    writer: Any = None  # TensorBoard's SummaryWriter, on rank 0 once training starts
    # the loop's progress (the Trainer counts it, a checkpoint restores it)
    step: int = 0  # optimizer steps done
    epoch_steps: int = 0
    epoch_loss: torch.Tensor | None = None  # this epoch's running sum (a device scalar)
    grad_norms: list[torch.Tensor] = field(default_factory=list)  # this epoch's, before clipping
    moe_stats: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per step: shares, aux
    heartbeat: Any = None  # distributed/health.py's record of where this rank is (distributed runs)

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def fsdp_active(self) -> bool:
        return self.cfg.layout.sharded and self.ctx.mesh.dp_size > 1

    def mark(self, phase: str) -> None:
        """Where this rank is in its work, for the diagnosis of a hang (distributed/health.py)."""
        if self.heartbeat is not None:
            self.heartbeat.mark(self.step, phase)


class StepVariant(Protocol):
    """A step variant as the checkpoint's state classes hold it (training/trainer.py: EagerStep)."""

    parts: StepParts


class Part:
    """A Trainer attribute that is a field of its :class:`StepParts` (``trainer.model`` reads and
    writes ``trainer.parts.model``): the Trainer and the step share one copy."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, holder: Any, owner: type | None = None) -> Any:
        return self if holder is None else getattr(holder.parts, self.name)

    def __set__(self, holder: Any, value: Any) -> None:
        setattr(holder.parts, self.name, value)


def local_batch_size(global_batch: int, dp_size: int, override: int | None = None) -> int:
    """Each data-parallel replica's share of the global batch."""
    if override is not None:
        if override < 1:
            raise ValueError(f"--local_batch_size must be at least 1, got {override}")
        return override
    if global_batch % dp_size:
        raise ValueError(
            f"global_batch_size {global_batch} is not divisible by the {dp_size} data-parallel "
            f"ranks; choose a batch that is a multiple of {dp_size} or pass --local_batch_size"
        )
    return global_batch // dp_size


def check_micro_batches(cfg: Config, local_batch: int) -> None:
    """The local batch splits into the micro-batches of gradient accumulation or of a pipeline."""
    for count, flag in ((cfg.memory.grad_accum_steps, "--grad_accum_steps"),
                        (cfg.layout.num_microbatches if cfg.layout.pipeline_parallel > 1 else 1,
                         "--num_microbatches")):
        if local_batch % count:
            raise ValueError(f"the local batch of {local_batch} samples does not split into {flag} {count} "
                             f"equal micro-batches; choose a number of micro-batches that divides it")


class Callback:
    """A script's or a test's hook into a run: override the moments you need (each does nothing
    here). The Trainer calls them in the order the callbacks were given."""

    def model_built(self, trainer: Any) -> None:
        """The model and optimizer exist (before any step or checkpoint load)."""

    def step_start(self, trainer: Any) -> None:
        """A training step is about to run on a batch already on the device (``trainer.step``
        steps are done)."""

    def step_end(self, trainer: Any, loss: torch.Tensor) -> torch.Tensor | None:
        """The step ran (``trainer.step`` not yet counted up); ``loss`` is the device tensor it
        returned. Return a tensor to log instead (fault injection), or None."""
        return None

    def epoch_end(self, trainer: Any, epoch: int) -> None:
        """An epoch was trained, validated and logged."""

    def fit_end(self, trainer: Any) -> None:
        """Training is over (checkpoint written); ``trainer.stopped_early`` says whether a stop
        signal ended it."""


def needs_parallelize(cfg: Config, ctx: RunContext) -> bool:
    """Whether the serial model must go through distributed/parallelize.py: more than one rank,
    or a transformation it applies (compile, activation checkpointing, expert parallelism)."""
    return (ctx.mesh.world_size > 1 or cfg.optim.enable_jit or cfg.memory.activation_checkpointing != "none"
            or cfg.layout.expert_parallel > 1)
