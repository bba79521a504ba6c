"""The step with an asynchronous pipeline (``--pipeline_schedule async_1f1b`` in train_mp.py).

What changes against training/pipelined.py's flushed pipeline:

- a training step pushes the step's micro-batches into a pipeline that is never emptied
  (distributed/async_pipeline.py): each stage runs the backwards of micro-batches that entered
  earlier and steps the optimizer as soon as a step's gradient is complete on it, with the
  weights ``--weight_stashing`` names. The learning-rate schedule still advances once per
  training step;
- nothing makes the stages wait for each other between steps: the last stage's loss reaches
  the others without waiting, and the loop is given it (summed) only where it reads its sum
  (:meth:`AsyncPipelineStep.loss_read_after`), once every few steps;
- the pipeline drains (every micro-batch in flight through its backward and update) after every
  ``--async_drain_every`` steps and at the end, and nowhere else: the drains are part of the
  update rule. A checkpoint is written only there (``--checkpoint_every`` must be a multiple),
  and a stop signal ends training at the next drain (:meth:`AsyncPipelineStep.may_stop_after`),
  so neither moves a drain. The checkpoint is a flushed pipeline's: consolidated, in the serial
  model's names. A resumed run starts with an empty pipeline, as the run it continues did after
  the drain, so it continues exactly.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch

from distributed import async_pipeline
from distributed.tags import unwrap
from training.context import RunContext
from training.pipelined import PipelineState, PipelineStep
from utils import device as dev
from utils.config import Config

log = logging.getLogger(__name__)


class AsyncPipelineState(PipelineState):
    """A flushed pipeline's checkpoint, written where the pipeline drained."""

    def state_dict(self) -> dict[str, Any]:
        model = self.parts.model
        if model.unshared:  # the loop's part of this checkpoint holds a loss sum without them
            raise RuntimeError("a checkpoint after a step whose loss was not shared: "
                               "AsyncPipelineStep.loss_read_after must name this step")
        if model.engine.flights:  # a drain here would change the update rule
            raise RuntimeError(f"a checkpoint at step {self.parts.step}, where the pipeline does not "
                               f"drain: AsyncPipelineStep.may_stop_after must name this step")
        return super().state_dict()


class AsyncPipelineStep(PipelineStep):
    state_class = AsyncPipelineState
    stop_deferred = False  # a stop signal came between two drains (logged once)

    @classmethod
    def check(cls, cfg: Config, ctx: RunContext, local_batch: int) -> None:
        super().check(cfg, ctx, local_batch)
        if ctx is not None and ctx.mesh.dp_size > 1:  # ctx None: the launcher's check before the mesh
            raise ValueError(f"the async_1f1b schedule runs one pipeline here, not {ctx.mesh.dp_size} side "
                             f"by side; start as many ranks as --pipeline_parallel "
                             f"{cfg.layout.pipeline_parallel}")

    def stage_layout(self) -> dict[str, Any]:
        """PipelineStep.build_model's stages, run by this module's schedule instead of torch's."""
        return {"kind": async_pipeline.AsyncPipeline}

    def build_model(self) -> async_pipeline.AsyncPipeline:
        model = super().build_model()
        # one rank per stage: no DDP or FSDP wrapper (check refuses several pipelines side by side)
        assert all(unwrap(c) is c for c in model.chunks)
        model.update = self.stage_update
        engine = model.engine
        log.info("asynchronous 1F1B, weight_stashing %s: stage %d keeps %d micro-batch(es) in flight "
                 "beyond the newest", self.parts.cfg.layout.weight_stashing, engine.stage, engine.depth)
        return model

    def train_step(self, inp: torch.Tensor, tar: torch.Tensor) -> torch.Tensor:
        """The step's loss is added up by the loop once the stages have shared it (after the steps
        :meth:`loss_read_after` names; zero after the others, whose losses come with the next)."""
        parts = self.parts
        if parts.epoch_steps == 0 and parts.model.unshared:  # an epoch was closed without them
            raise RuntimeError("an epoch ended after a step whose loss was not shared: "
                               "AsyncPipelineStep.loss_read_after must name that step")
        with dev.nvtx_range("asynchronous pipeline"), self.compute():
            # the stage's updates happen inside (stage_update)
            loss = parts.model.step(inp, tar, share=self.loss_read_after(parts.step + 1))
            if self.drains_after(parts.step + 1):
                parts.model.drain()
        with warnings.catch_warnings():  # the schedule follows the training steps, which the first
            # stages' warm-up takes before their first update: torch's warning is for a mistake
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
            parts.scheduler.step()
        return loss

    def drains_after(self, done: int) -> bool:
        """The pipeline drains after ``done`` steps: every ``--async_drain_every`` and at the end."""
        cfg = self.parts.cfg
        return done % cfg.layout.async_drain_every == 0 or done >= cfg.optim.num_iters

    def may_stop_after(self, done: int) -> bool:
        """Training stops for a signal only where the pipeline drains (a drain elsewhere would change
        the update rule: the resumed run would not be the uninterrupted one)."""
        if not self.drains_after(done) and not self.stop_deferred:
            self.stop_deferred = True
            cfg = self.parts.cfg
            every = cfg.layout.async_drain_every
            log.warning("stop signal at step %d: the asynchronous pipeline stops where it next drains, "
                        "at step %d", done, min(cfg.optim.num_iters, -(-done // every) * every))
        return self.drains_after(done)

    def loss_read_after(self, done: int) -> bool:
        """Whether the loop reads the losses it added up after ``done`` steps: at an epoch's end, a
        checkpoint, the last step, and where a stop signal can end training (the stop agreement
        asks every ``stop_check_every`` steps and reads the answer a step later)."""
        cfg = self.parts.cfg
        every = cfg.run.stop_check_every
        return (done % self.parts.train_data.batches_per_epoch == 0 or self.drains_after(done)
                or every == 1 or done % every == 1)

    def held_bytes(self) -> dict[str, int]:
        """What EagerStep counts, and the older weight versions: the most the stage held at once."""
        held = super().held_bytes()
        held["weight_versions"] = (self.parts.model.engine.most_versions - 1) * held["parameters"]
        return held

    def stage_update(self) -> None:
        """The stage's optimizer step, when a step's gradient is complete on it."""
        parts = self.parts
        parts.mark("optimizer step")
        with dev.nvtx_range("optimizer"):
            parts.optimizer.step()
            parts.optimizer.zero_grad(set_to_none=True)
