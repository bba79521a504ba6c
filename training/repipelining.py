"""A pipeline that shrinks as its blocks freeze, while more data-parallel replicas join
(PipeTransformer's AutoPipe and AutoDP).

The frozen embedding and blocks leave the schedule: the first stage's rank runs them before
it, without autograd (and from the activation cache), and hands their output to the first
stage. The active blocks are cut into stages by their cost, a block's parameters as AutoPipe
counts it, the frozen prefix at a sixth of its parameters (it runs forward only, once). When
the active blocks fit on half the stages with a largest stage no costlier than the largest at
the start, the run continues on half the stages and twice the data-parallel ranks: pp = p,
dp = d becomes pp = p/2, dp = 2d. Any change of the cut means new stages: the Trainer writes
its checkpoint (consolidated: it loads into any layout), the launcher builds the process groups
and the Trainer of the new layout in the same processes, and that one resumes from it.
"""

from __future__ import annotations

from typing import Any

import torch

from distributed.env import all_reduce_sum
from distributed.pipeline import Pipeline, balanced_split
from networks.backbone import build_on_meta
from training.context import RunContext
from training.freezing import Freezing, saved_freezing
from training.pipelined import PipelineState, PipelineStep
from utils.config import Config
from utils.config_groups import ModelConfig

FROZEN_COST = 1 / 6  # AutoPipe: a frozen layer costs a sixth of an active one


def unit_parameters(cfg: ModelConfig) -> tuple[int, int, int]:
    """Parameters of the stem (the ViT's patch and position embedding), of one unit (a block), of
    the tail (the final norm and head), counted on a model with shapes only."""
    sizes = build_on_meta(cfg)[0].part_sizes()
    return sizes["stem"], sizes[0], sizes["tail"]


def stage_items(cfg: Config, frozen: int) -> list[float]:
    """The cost of each active block, the first carrying the frozen prefix (or, with nothing
    frozen, the embedding) and the last the head: what :func:`balanced_split` cuts."""
    embedding, block, tail = unit_parameters(cfg.model)
    items = [float(block)] * (cfg.model.depth - frozen)
    items[0] += (embedding + frozen * block) * FROZEN_COST if frozen else embedding
    items[-1] += tail
    return items


def pipeline_layout(cfg: Config, frozen: int, start_pipeline: int, shrink: bool = True
                    ) -> tuple[int, list[range]]:
    """The stages for ``frozen`` blocks: their number (halved from ``start_pipeline`` while the
    costliest stage of half as many is no costlier than the costliest at the start, or while
    there are fewer active blocks than stages) and each one's blocks."""
    def worst(items: list[float], stages: int) -> float:
        return max(sum(items[i] for i in r) for r in balanced_split(items, stages))

    if frozen >= cfg.model.depth:  # every block frozen: the head trains, on one stage
        return 1, [range(cfg.model.depth, cfg.model.depth)]
    reference = worst(stage_items(cfg, 0), start_pipeline)
    items, active, pp = stage_items(cfg, frozen), cfg.model.depth - frozen, start_pipeline
    while pp > 1 and (active < pp or (shrink and worst(items, pp // 2) <= reference)):
        pp //= 2
    ranges = [range(r.start + frozen, r.stop + frozen) for r in balanced_split(items, pp)]
    return pp, ranges


class FreezingPipelineStep(Freezing, PipelineStep):
    """The pipeline's step with freezing: its stages built for the blocks frozen at the step it
    starts from, and a new layout asked for whenever the schedule changes them."""

    weights_class = PipelineState

    @classmethod
    def check(cls, cfg: Config, ctx: RunContext | None, local_batch: int) -> None:
        """Every layout the run may shrink to must take the batch: the global batch over the
        data-parallel ranks, each one's batch over the micro-batches."""
        super().check(cfg, ctx, local_batch)
        lay, batch = cfg.layout, cfg.optim.global_batch_size
        pp, micro = lay.pipeline_parallel, lay.num_microbatches
        ranks = pp * batch // local_batch  # stages x data-parallel ranks (no tp, cp)
        while cfg.freeze.freeze_repipeline and pp > 1:
            pp //= 2
            dp = ranks // pp
            if batch % dp or (pp > 1 and batch // dp % micro):
                raise ValueError(f"as blocks freeze the pipeline may shrink to {pp} stage(s) on {dp} "
                                 f"data-parallel ranks, where global batch {batch} does "
                                 f"not split into local batches of --num_microbatches "
                                 f"{micro}; choose a batch that does, or "
                                 f"--no-freeze_repipeline")

    def scheduled(self, step: int) -> int:
        """Without re-pipelining each stage keeps one active block at least."""
        count = super().scheduled(step)
        cfg = self.parts.cfg
        if cfg.freeze.freeze_repipeline:
            return count
        return min(count, cfg.model.depth - cfg.layout.pipeline_parallel)

    def build_model(self) -> Pipeline:
        """The stages for the blocks frozen at the step this run starts from (its checkpoint's)."""
        parts = self.parts
        saved = saved_freezing(parts.ctx.run_dir)
        self.start_pipeline = saved.get("start_pipeline", self.start_pipeline)
        self.decided = saved.get("decided", 0)
        pp = parts.cfg.layout.pipeline_parallel
        # a checkpoint past this layout: stages that can be built, then next_layout moves on
        self.frozen = min(saved.get("next", self.scheduled(0)), parts.cfg.model.depth - pp)
        self.ranges = pipeline_layout(parts.cfg, self.frozen, pp, shrink=False)[1]
        model = super().build_model()
        if model.prefix is not None:
            model.prefix.requires_grad_(False)
        return model

    def stage_layout(self) -> dict[str, Any]:
        return {"ranges": self.ranges, "prefix": self.frozen}

    def prefix_model(self) -> torch.nn.Module:
        return self.parts.model.prefix

    def train_step(self, inp: torch.Tensor, tar: torch.Tensor) -> torch.Tensor:
        parts = self.parts
        if self.scheduled(parts.step) != self.frozen:  # next_layout() moves on before such a step
            raise RuntimeError(f"step {parts.step}: stages built for {self.frozen} frozen blocks, the "
                               f"schedule says {self.scheduled(parts.step)}")
        self.count_step()
        if self.frozen and parts.model.is_first:
            inp = self.prefix_output(inp)  # the first stage takes the frozen prefix's tokens
        return super().train_step(inp, tar)

    def stages(self) -> list[list[int]]:
        return [[r.start, r.stop] for r in self.ranges]

    def next_layout(self) -> dict[str, Any] | None:
        """The stages the next step needs, when they are not these."""
        step, cfg = self.parts.step, self.parts.cfg
        if step >= cfg.optim.num_iters:
            return None
        count = self.scheduled(step)
        pp, ranges = pipeline_layout(cfg, count, self.start_pipeline, cfg.freeze.freeze_repipeline)
        if (count, pp, ranges) == (self.frozen, cfg.layout.pipeline_parallel, self.ranges):
            return None
        return {"pipeline_parallel": pp}

    def block_norms(self) -> torch.Tensor:
        """Each stage has its own blocks' norms: summed over the pipeline, every rank has all."""
        return all_reduce_sum(super().block_norms(), self.parts.model.group)
