"""Freezing layers as training goes (PipeTransformer, He et al., ICML 2021).

The first layers of a transformer stop changing long before the last ones. Freezing them as
training goes saves their backward, their gradients' all-reduce and their optimizer state;
their forward can be kept, per sample, from one epoch to the next. What freezes, in order:
the patch and position embedding with block 0, then blocks 1, 2, ...; the final norm and the
head always train. ``--freeze_schedule`` says how many blocks are frozen at each step:

* ``formula``: after e epochs (``--freeze_every`` steps each), ceil(L (1 - (1 - alpha)^e)) of
  the L blocks (:func:`formula_frozen`), the schedule PipeTransformer's own runs use;
* ``steps``: block i freezes at step ``freeze_steps[i]`` (fixed, for tests and experiments);
* ``gradnorm``: PipeTransformer's gradient test (:func:`gradnorm_frozen`).

A frozen parameter stops requiring a gradient, leaves the optimizer (its state freed) and
DDP's all-reduce (the wrapper is rebuilt around the parameters that still train). The frozen
embedding and blocks run first, without autograd, and their output replaces the input of
the rest of the model; with ``--freeze_cache_mib`` that output is kept per sample
(:class:`ActivationCache`) and extended through newly frozen blocks from the kept output.
A pipeline re-cuts its stages as blocks freeze, and moves to half the stages and twice the
data-parallel ranks when the active blocks fit (training/repipelining.py). The checkpoint
carries what was frozen ("freezing"), so a run resumes exactly in the middle of a schedule.
"""

from __future__ import annotations

import gc
import logging
import math
import statistics
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distributed.env import all_reduce_max
from distributed.tags import unwrap
from networks.backbone import backbone_class
from training import checkpointing
from training.context import StepParts
from training.state import ModelState
from training.trainer import EagerStep
from utils import checkpoint as ckpt
from utils.config import Config

log = logging.getLogger(__name__)

MIB = 2**20


# --------------------------------------------------------------- the schedule ---
def formula_frozen(depth: int, alpha: float, epoch: int) -> int:
    """Blocks frozen after ``epoch`` epochs: ceil(L (1 - (1 - alpha)^e)), each epoch freezing a
    share alpha of the blocks still active. (The 1e-9 keeps 12 x (1 - 2/3), which floating
    point makes 4.000000000000001, from rounding up to 5.)"""
    return min(depth, math.ceil(depth * (1 - (1 - alpha) ** epoch) - 1e-9))


def steps_frozen(freeze_steps: Sequence[int], step: int) -> int:
    """Blocks frozen at ``step`` (0-based) by the fixed list: entry i freezes block i."""
    return sum(s <= step for s in freeze_steps)


def gradnorm_frozen(before: Sequence[float], now: Sequence[float], frozen: int) -> int:
    """PipeTransformer's gradient test: per block, the L1 norm of its gradients summed over an
    interval (``now``) against the previous interval (``before``); among the active blocks (from
    ``frozen`` on), each one's relative change and their median. Every block before the first
    one whose change is at or above the median freezes (none, when that is the first active one:
    it is still moving)."""
    changes = [abs(n - b) / b if b > 0 else math.inf for b, n in zip(before[frozen:], now[frozen:])]
    if not changes:
        return frozen
    median = statistics.median(changes)
    return frozen + next(i for i, c in enumerate(changes) if c >= median)


class GradNormRule:
    """The gradient test's running state: this interval's per-block L1 norms (a device tensor,
    added to each step without a host sync) and the previous interval's."""

    def __init__(self) -> None:
        self.current: torch.Tensor | None = None
        self.previous: list[float] | None = None
        self.history: list[list[float]] = []  # every interval's norms, in the checkpoint too

    def add(self, norms: torch.Tensor) -> None:
        self.current = norms if self.current is None else self.current + norms

    def decide(self, frozen: int) -> int:
        """End of an interval: the blocks to freeze from now on (one host sync)."""
        now = self.current.tolist() if self.current is not None else None
        before, self.previous, self.current = self.previous, now, None
        if now is not None:
            self.history.append(now)
        return frozen if before is None or now is None else gradnorm_frozen(before, now, frozen)

    def state_dict(self) -> dict[str, Any]:
        current = self.current.tolist() if self.current is not None else None
        return {"previous": self.previous, "current": current, "history": self.history}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        self.previous = state["previous"]
        current = state["current"]
        self.current = None if current is None else torch.tensor(current, device=device)
        self.history = list(state.get("history", []))  # (older checkpoints have none)


def freeze_order(cfg: Config) -> list[int]:
    """The blocks in the order they freeze: the earliest first, or (the control) a permutation
    drawn from the seed."""
    if cfg.freeze.freeze_order == "first":
        return list(range(cfg.model.depth))
    return torch.randperm(cfg.model.depth, generator=torch.Generator().manual_seed(cfg.run.seed)).tolist()


def frozen_parameter(part: str | int, blocks: Sequence[int]) -> bool:
    """Whether a parameter of ``part`` (``Backbone.part_of`` its serial name: "stem", a block's
    index, "tail") is frozen when ``blocks`` are: those blocks' parameters, and the stem's (the
    embedding's) with the first of them."""
    return bool(blocks) and (part == "stem" or part in blocks)


def leave_optimizer(optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter]) -> None:
    """Take ``params`` out of the optimizer's groups and free their state (Adam's moments)."""
    gone = {id(p) for p in params}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) not in gone]
    for p in params:
        optimizer.state.pop(p, None)


# ------------------------------------------------------------------ the cache ---
def run_blocks(vit: nn.Module, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Blocks ``start`` .. ``stop`` - 1 of ``vit`` on ``x``: from the input image (the embedding
    first) when ``start`` is 0, else from the tokens (B, N, D) that block start - 1 gave."""
    if start == 0:
        x = vit.embed(x)
    for i in range(start, stop):
        x = vit.units()[str(i)](x)
    return x


class ActivationCache:
    """Each sample's output of the frozen prefix (embedding and frozen blocks), (N, D) tokens on
    the training device, keyed by the sample's index in the data set. Exact: frozen weights do
    not change, nothing here is random (the configuration refuses dropout), and each sample's
    row is computed as it would be in any batch (the kernels here give a row the same bits
    whatever the other rows: tests/test_freezing.py checks it with torch.equal).

    A sample kept after fewer blocks than are frozen now is *extended*: the newly frozen blocks
    run on its kept output, not on its input again. Up to ``budget_mib`` are kept, first come
    first kept; the other samples' prefix is computed each time."""

    def __init__(self, budget_mib: float) -> None:
        self.budget = int(budget_mib * MIB)
        self.used = 0
        self.entries: dict[int, tuple[int, torch.Tensor]] = {}  # sample -> (blocks run, tokens)
        self.counts = {"hit": 0, "extended": 0, "missed": 0}

    def tokens(self, keys: Sequence[int], inp: torch.Tensor, frozen: int,
               run: Callable[[torch.Tensor, int, int], torch.Tensor]) -> torch.Tensor:
        """The prefix's output (B, N, D) for the samples ``keys`` (the rows of ``inp``), through
        ``frozen`` blocks; ``run(x, start, stop)`` runs blocks start .. stop - 1."""
        if len(keys) != inp.shape[0]:
            raise RuntimeError(f"{len(keys)} sample indices for a batch of {inp.shape[0]}")
        by_depth: dict[int, list[int]] = {}  # blocks a kept output has been through -> its rows
        missed = []
        for row, key in enumerate(keys):
            entry = self.entries.get(key)
            if entry is None:
                missed.append(row)
            else:
                by_depth.setdefault(entry[0], []).append(row)
        parts = []
        for depth, rows in by_depth.items():
            out = torch.stack([self.entries[keys[r]][1] for r in rows])
            if depth < frozen:  # more blocks froze since: run only those
                out = run(out, depth, frozen)
                self.keep([keys[r] for r in rows], out, frozen)
            self.counts["extended" if depth < frozen else "hit"] += len(rows)
            parts.append((rows, out))
        if missed:
            out = run(inp[missed], 0, frozen)
            self.keep([keys[r] for r in missed], out, frozen)
            self.counts["missed"] += len(missed)
            parts.append((missed, out))
        result = parts[0][1].new_empty((len(keys), *parts[0][1].shape[1:]))
        for rows, out in parts:
            result[rows] = out
        return result

    def keep(self, keys: Sequence[int], out: torch.Tensor, frozen: int) -> None:
        """Keep each row (its own copy: a view would keep the whole batch alive) within the budget."""
        row_bytes = out[0].numel() * out[0].element_size()
        for key, row in zip(keys, out):
            if key not in self.entries:
                if self.used + row_bytes > self.budget:
                    continue
                self.used += row_bytes
            self.entries[key] = (frozen, row.clone())

    def report(self) -> dict[str, float]:
        """Since the last report: the shares of samples served whole, extended and computed, and
        the memory held (this rank's)."""
        total = max(1, sum(self.counts.values()))
        out = {f"cache_{k}_rate": v / total for k, v in self.counts.items()}
        out["cache_MiB"] = self.used / MIB
        self.counts = dict.fromkeys(self.counts, 0)
        return out


# ------------------------------------------------------------------- the step ---
class FreezingState:
    """The checkpoint part of a freezing run: the step variant's own model-and-optimizer part
    ("model", "optimizer": a frozen parameter's optimizer state is simply absent) and
    "freezing": the blocks frozen, those of the next step, the gradient test's history, the
    pipeline's stages at the start. A checkpoint without "freezing" loads as nothing frozen."""

    sharded = False  # FSDP is refused with freezing: always the single file

    def __init__(self, variant: Freezing) -> None:
        self.variant = variant
        self.weights = variant.weights_class(variant)

    def model_state(self) -> dict[str, torch.Tensor]:
        return self.weights.model_state()

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        self.weights.load_model_state(state)

    def state_dict(self) -> dict[str, Any]:
        return {**self.weights.state_dict(), "freezing": self.variant.freezing_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # first the freezing: the optimizer then holds the parameters the checkpoint's did
        self.variant.load_freezing_state(state.get("freezing") or {})
        self.weights.load_state_dict(state)


def saved_freezing(run_dir: Any) -> dict[str, Any]:
    """The "freezing" part of the checkpoint a run in ``run_dir`` will resume from ({} if none),
    read before the model is built (its tensors stay on disk)."""
    path = checkpointing.find(run_dir)
    if path is None or path.is_dir():
        return {}
    return ckpt.load(path, mmap=True).get("freezing") or {}


class Freezing:
    """What freezing adds to a step variant: the schedule, the frozen parameters leaving the
    optimizer and the gradient sync, the frozen prefix run without autograd (and cached), the
    checkpoint's "freezing" and the metrics. Mixed into :class:`FreezingStep` here and into the
    pipeline's step in training/repipelining.py, before the variant it extends."""

    state_class = FreezingState
    weights_class: type[ModelState] = ModelState  # the variant's own model-and-optimizer part

    parts: StepParts  # (EagerStep's, which this class comes before)

    def __init__(self, parts: StepParts) -> None:
        super().__init__(parts)
        cfg = parts.cfg
        self.frozen = 0  # blocks frozen now
        self.decided = 0  # gradnorm: blocks frozen from the next interval on
        self.order = freeze_order(cfg)
        self.prefix = cfg.freeze.freeze_order == "first"  # the frozen blocks lead: they run apart
        self.rule = GradNormRule() if cfg.freeze.freeze_schedule == "gradnorm" else None
        self.cache = ActivationCache(cfg.freeze.freeze_cache_mib) if cfg.freeze.freeze_cache_mib else None
        self.epoch_frozen: list[int] = []  # blocks frozen at each step of this epoch
        self.epoch_stages: list[list[list[int]]] = []  # and each stage's active blocks [start, stop)
        self.start_pipeline = cfg.layout.pipeline_parallel  # stages the run started with (repipelining)

    # ------------------------------------------------------------ the schedule ---
    def every(self) -> int:
        """Steps per epoch of the formula, and per interval of the gradient test."""
        return self.parts.cfg.freeze.freeze_every or self.parts.train_data.batches_per_epoch

    def scheduled(self, step: int) -> int:
        """Blocks frozen during ``step`` (0-based)."""
        cfg = self.parts.cfg
        if cfg.freeze.freeze_schedule == "formula":
            return formula_frozen(cfg.model.depth, cfg.freeze.freeze_alpha, step // self.every())
        if cfg.freeze.freeze_schedule == "steps":
            return steps_frozen(cfg.freeze.freeze_steps, step)
        return self.decided

    def frozen_blocks(self, count: int | None = None) -> list[int]:
        return self.order[: self.frozen if count is None else count]

    # ------------------------------------------------------------- freezing ---
    def freeze(self, count: int, step: int) -> None:
        """From ``step`` on, ``count`` blocks are frozen (frozen blocks stay frozen): no gradient,
        out of the optimizer with their state, out of the gradient sync."""
        if count <= self.frozen:
            return
        parts = self.parts
        blocks, part_of = self.frozen_blocks(count), backbone_class(parts.cfg.model).part_of
        newly = [p for name, p in parts.raw_model.named_parameters()
                 if p.requires_grad and frozen_parameter(part_of(name), blocks)]
        for p in newly:
            p.requires_grad_(False)
            p.grad = None
        leave_optimizer(parts.optimizer, newly)
        self.frozen = count
        self.leave_gradient_sync()
        log.info("step %d: %d of %d blocks frozen (%s), %d parameters still train", step, count,
                 parts.cfg.model.depth, "embedding + blocks " + ", ".join(map(str, sorted(blocks))),
                 sum(p.numel() for p in parts.raw_model.parameters() if p.requires_grad))

    def leave_gradient_sync(self) -> None:
        """The frozen parameters leave the gradient sync (a pipeline's average skips parameters
        without a gradient by itself)."""

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The step's optimizer, without the parameters frozen when the model was built (a
        pipeline that resumes builds its frozen prefix apart)."""
        optimizer = super().build_optimizer(model)
        leave_optimizer(optimizer, [p for p in model.parameters() if not p.requires_grad])
        return optimizer

    # ------------------------------------------------------------------ steps ---
    def prefix_model(self) -> nn.Module:
        """The module that holds the frozen embedding and blocks (a ViT, whole or cut)."""
        return self.parts.raw_model

    @torch.no_grad()
    def prefix_output(self, inp: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, N, D): the frozen embedding and blocks, without autograd, from
        the cache where it has the samples."""
        run = partial(run_blocks, self.prefix_model())
        with self.compute():
            if self.cache is None:
                return run(inp, 0, self.frozen)
            return self.cache.tokens(self.parts.train_data.last_indices, inp, self.frozen, run)

    def optimizer_step(self) -> None:
        parts = self.parts
        if self.rule is not None:
            self.rule.add(self.block_norms())
        super().optimizer_step()
        if self.rule is not None and (parts.step + 1) % self.every() == 0:
            decided = torch.tensor(float(self.rule.decide(self.frozen)), device=parts.device)
            self.decided = max(self.decided, int(all_reduce_max(decided).item()))  # every rank alike

    def block_norms(self) -> torch.Tensor:
        """Per block, the L1 norm of its gradients this step (the blocks this rank holds)."""
        parts = self.parts
        norms = torch.zeros(parts.cfg.model.depth, device=parts.device)
        part_of = backbone_class(parts.cfg.model).part_of
        for name, p in unwrap(parts.model).named_parameters():  # DDP's names start with "module."
            if p.grad is not None and isinstance(block := part_of(name), int):
                norms[block] += p.grad.detach().abs().sum().float()
        return norms

    # ------------------------------------------------------------ checkpoint ---
    def freezing_state(self) -> dict[str, Any]:
        return {"frozen": self.frozen, "next": self.scheduled(self.parts.step), "decided": self.decided,
                "start_pipeline": self.start_pipeline, "epoch_frozen": list(self.epoch_frozen),
                "epoch_stages": list(self.epoch_stages),
                "gradnorm": self.rule.state_dict() if self.rule is not None else None}

    def load_freezing_state(self, state: dict[str, Any]) -> None:
        self.start_pipeline = state.get("start_pipeline", self.start_pipeline)
        self.decided = state.get("decided", 0)
        self.epoch_frozen = list(state.get("epoch_frozen", []))
        self.epoch_stages = list(state.get("epoch_stages", []))
        if self.rule is not None and state.get("gradnorm"):
            self.rule.load_state_dict(state["gradnorm"], self.parts.device)
        self.freeze(state.get("frozen", 0), self.parts.step)

    # -------------------------------------------------------------- metrics ---
    def epoch_record(self) -> dict[str, Any]:
        """The blocks frozen at each step of the epoch (and the cache's rates), for metrics.jsonl;
        TensorBoard gets one point per step."""
        parts = self.parts
        record: dict[str, Any] = {"frozen_blocks": self.epoch_frozen, "pipeline_stages": self.epoch_stages}
        if self.cache is not None:
            record.update(self.cache.report())
            log.info("  Frozen blocks: %d; the cache served %.0f%% of the samples whole, extended %.0f%%, "
                     "computed %.0f%% (%.1f MiB kept)", self.frozen, 100 * record["cache_hit_rate"],
                     100 * record["cache_extended_rate"], 100 * record["cache_missed_rate"],
                     record["cache_MiB"])
        if parts.writer is not None:
            first = parts.step - len(self.epoch_frozen) + 1
            for i, count in enumerate(self.epoch_frozen):
                parts.writer.add_scalar("Freezing/frozen blocks", count, first + i)
            for key in ("cache_hit_rate", "cache_extended_rate", "cache_MiB"):
                if key in record:
                    parts.writer.add_scalar(f"Freezing/{key}", record[key], parts.step)
        self.epoch_frozen, self.epoch_stages = [], []
        return record

    def stages(self) -> list[list[int]]:
        """Each pipeline stage's active blocks as [start, stop) (one stage without a pipeline)."""
        return [[self.frozen if self.prefix else 0, self.parts.cfg.model.depth]]

    def count_step(self) -> None:
        """Note this step's frozen blocks and stages, for the epoch's record."""
        self.epoch_frozen.append(self.frozen)
        self.epoch_stages.append(self.stages())


class FreezingStep(Freezing, EagerStep):
    """The eager step with freezing (one device, or DDP over the data-parallel ranks)."""

    def run_started(self) -> None:
        """Before the first step: what the schedule freezes from it (a resumed run has it already)."""
        super().run_started()
        self.freeze(self.scheduled(self.parts.step), self.parts.step)

    def train_step(self, inp: torch.Tensor, tar: torch.Tensor) -> torch.Tensor:
        """The frozen prefix runs apart: its output (B, N, D) is what the rest of the model trains
        on. After the step, what the schedule freezes from the next one on, so that the next
        step (and a checkpoint before it) finds the model, optimizer and DDP it will use."""
        parts = self.parts
        self.count_step()
        if self.frozen and self.prefix:
            inp = self.prefix_output(inp)
        loss = super().train_step(inp, tar)
        if parts.step + 1 < parts.cfg.optim.num_iters:
            self.freeze(self.scheduled(parts.step + 1), parts.step + 1)
        return loss

    def forward_loss(self, inp: torch.Tensor, tar: torch.Tensor) -> torch.Tensor:
        if not (self.frozen and self.prefix):
            return super().forward_loss(inp, tar)
        parts = self.parts
        with self.compute(cache_enabled=self.autocast_cache):
            pred = parts.model(inp, first_unit=self.frozen)  # inp: the frozen prefix's output tokens
        return parts.loss_fn(pred.float(), tar)

    def leave_gradient_sync(self) -> None:
        """DDP reduces the parameters that required a gradient when it was built: it is built
        again around those that still do (the old one's hooks go with it)."""
        parts = self.parts
        if not isinstance(parts.model, DistributedDataParallel):
            return
        from distributed.tags import wrap_data_parallel

        parts.model = None  # the old wrapper's hooks are freed before the new one is built
        gc.collect()
        parts.model = wrap_data_parallel(parts.raw_model, parts.ctx.mesh, parts.device, parts.cfg.layout,
                                         parts.cfg.run.seed)

