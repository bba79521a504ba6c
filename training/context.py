"""What a run knows about where it runs (not configuration): device, ranks, mesh, run folder; and
who listens to it: the callbacks through which scripts that measure a run and tests that inject
faults hook into a few named moments of training/trainer.py's loop, instead of changing it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

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
