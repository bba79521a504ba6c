"""The training loop, written once for train.py, train_graph.py and train_mp.py.

Read this file top to bottom: :class:`EagerStep` is one training step (forward, loss, backward,
optimizer step) and builds the model and optimizer it steps; :class:`Trainer` runs the epochs
(:meth:`Trainer.fit`: ``num_iters`` optimizer steps, validation after every epoch, checkpoints).

What a later lesson changes is a part the Trainer holds, never a subclass of it:

* the **step variant** (``step=``), chosen once by the launcher: :class:`EagerStep` here; CUDA
  graphs (training/graphs.py), pipeline stages (training/pipelined.py), DeepSpeed's engine
  (training/deepspeed_engine.py) each extend the step and say what they change;
* **callbacks** (``callbacks=``, :class:`Callback`): scripts and tests hook into a few named
  moments (model built, step start and end, epoch end, fit end);
* the checkpoint: each part saves and restores itself, training/checkpointing.py writes them all.

A run on one device builds the serial ViT and torch's optimizer right here; runs that split (or
compile) the model hand it to distributed/parallelize.py, which the first lesson never imports.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distributed.env import all_reduce_max, all_reduce_sum
from distributed.env import heartbeat as new_heartbeat
from distributed.stop import StopAgreement
from networks.backbone import build_on_meta, count_parameters
from training import checkpointing, context, reporting, validation
from training.context import Callback, Part, RunContext, StepParts, TrainingError
from training.schedule import make_lr_lambda, optimizer_choice
from training.state import LoopState, ModelState
from utils import attention
from utils import checkpoint as ckpt
from utils import device as dev
from utils.config import Config
from utils.data_loader import Batches, get_data_loader
from utils.era5 import channel_names
from utils.metrics import latitude_weights, relative_l2_loss
from utils.signals import received

log = logging.getLogger(__name__)


class EagerStep:
    """One training step, run eagerly: forward, loss, backward, optimizer step. It is handed
    ``parts`` (training/context.py: the configuration, the device and mesh, the model, optimizer,
    schedule and scaler once built, the loop's progress), builds and returns what it steps (the
    model on this rank, the optimizer) and says what of them a checkpoint holds.

    The variants of later lessons subclass this part and change what differs: CUDA graphs
    (training/graphs.py), pipeline stages (training/pipelined.py), DeepSpeed's engine
    (training/deepspeed_engine.py)."""

    autocast_cache = True  # CUDA graph capture needs it off
    autocast = True  # the forward under autocast in --amp_mode (not DeepSpeed's: its engine casts)
    n_params = 0  # of the whole (serial) model, counted by build_model
    engine: nn.Module | None = None  # the model inside an engine that build_optimizer makes (DeepSpeed)

    def __init__(self, parts: StepParts) -> None:
        self.parts = parts

    @classmethod
    def check(cls, cfg: Config, ctx: RunContext, local_batch: int) -> None:
        """Refuse, in one line (ValueError), a configuration this step cannot run."""
        context.check_micro_batches(cfg, local_batch)  # accumulation's (and a pipeline's) micro-batches

    # ------------------------------------------------------------------ building ---
    def build_model(self) -> nn.Module:
        """The serial ViT with the weights every layout starts from (drawn from the seed)."""
        parts = self.parts
        if context.needs_parallelize(parts.cfg, parts.ctx):
            return self.build_parallel_model()
        model, self.n_params = build_on_meta(parts.cfg.model)
        model = model.to_empty(device=parts.device)  # memory on the device, not yet initialised
        model.reset_parameters(torch.Generator().manual_seed(parts.cfg.run.seed))
        return model

    def build_parallel_model(self) -> nn.Module:
        """The serial model on the meta device (shapes, no memory), then this rank's part of it,
        allocated and filled with the serial model's values from the seed (part 6)."""
        from distributed.parallelize import parallelize, serial_values

        parts, cfg = self.parts, self.parts.cfg
        serial, self.n_params = build_on_meta(cfg.model)
        model = parallelize(serial, parts.ctx.mesh, parts.device, cfg.layout, cfg.memory, cfg.optim,
                            cfg.run.seed, serial_values(serial, cfg.run.seed))
        if parts.ctx.mesh.model_parallel:
            log.info("%s; this rank holds %d of the model's %d parameters", parts.ctx.mesh.describe(),
                     count_parameters(unwrap(model)), self.n_params)
        return model

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer over ``model``'s parameters (build_model's)."""
        parts, optim = self.parts, self.parts.cfg.optim
        optimizer_class, options = optimizer_choice(optim, dev.adam_kernel(optim.enable_fused))
        if parts.ctx.mesh.world_size == 1:
            return optimizer_class(model.parameters(), **options)
        from distributed import sharding  # ZeRO-1's sharded state, LAMB's norms over the ranks' parts

        return sharding.build_optimizer(model, optimizer_class, options, parts.cfg.layout, parts.ctx.mesh)

    # --------------------------------------------------------------------- steps ---
    def compute(self, cache_enabled: bool = True) -> contextlib.ExitStack:
        """Where forward passes run: autocast to the run's precision, and its attention kernel
        (backward follows the kernels that forward chose)."""
        parts = self.parts
        region = contextlib.ExitStack()
        region.enter_context(dev.autocast(parts.device, parts.amp_mode, cache_enabled=cache_enabled))
        if parts.attention_kernel != "default":  # a kernel chosen instead of torch's own pick (part 2)
            region.enter_context(attention.kernel(parts.attention_kernel))
        return region

    def forward_loss(self, inp: torch.Tensor, tar: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) input and target -> the loss, a device scalar."""
        parts = self.parts
        with self.compute(cache_enabled=self.autocast_cache):
            pred = parts.model(inp)
        return parts.loss_fn(pred.float(), tar)

    def train_step(self, inp: torch.Tensor, tar: torch.Tensor) -> torch.Tensor:
        """One optimizer step; returns the loss as a device tensor (no host sync).

        With ``grad_accum_steps`` N the batch runs as N micro-batches whose gradients add up;
        each loss is divided by N (the mean over the whole batch, as one big batch would give)
        and only the last micro-batch's backward reduces gradients over the ranks."""
        parts = self.parts
        n = parts.cfg.memory.grad_accum_steps
        total = torch.zeros((), device=parts.device)
        for i, (x, y) in enumerate(zip(inp.chunk(n), tar.chunk(n))):
            with self.gradient_sync(enabled=i == n - 1):
                parts.mark("forward")
                with dev.nvtx_range("forward"):
                    loss = self.forward_loss(x, y) / n
                    objective = loss + self.balancing_loss() / n  # the loss alone is logged
                parts.mark("backward")
                with dev.nvtx_range("backward"):
                    (parts.scaler.scale(objective) if parts.scaler else objective).backward()
            total += loss.detach()
        self.optimizer_step()
        self.record_experts()
        return total

    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Accumulation's micro-batches before the last: backward without reducing gradients."""
        if enabled:
            return contextlib.nullcontext()
        from distributed import sharding

        return sharding.gradient_sync(self.parts.model, enabled=False)

    def optimizer_step(self) -> None:
        parts = self.parts
        parts.mark("optimizer step")
        with dev.nvtx_range("optimizer"):
            if parts.cfg.optim.grad_clip_norm:
                self.clip_gradients()
            if parts.scaler:
                parts.scaler.step(parts.optimizer)
                parts.scaler.update()
            else:
                parts.optimizer.step()
            parts.optimizer.zero_grad(set_to_none=True)
            parts.scheduler.step()

    @functools.cached_property
    def moe_layers(self) -> list[nn.Module]:
        """The mixture-of-experts layers (networks/moe.py): their balancing loss joins the training
        loss (a pipeline's stages: none)."""
        raw = self.parts.raw_model
        return [m for m in raw.modules() if hasattr(m, "aux_loss")] if isinstance(raw, nn.Module) else []

    def balancing_loss(self) -> torch.Tensor | float:
        """The mixture of experts' load-balancing loss of the last forward, weighted (0 without experts)."""
        if not self.moe_layers:
            return 0.0
        return self.parts.cfg.model.moe_aux_weight * sum(m.aux_loss for m in self.moe_layers)

    def record_experts(self) -> None:
        """What each expert got in the step's (last) micro-batch, for the logs: each layer's shares
        (layers, experts + 1; host) and balancing loss (layers,; device: no host sync here)."""
        if self.moe_layers:
            self.parts.moe_stats.append((torch.stack([m.stats for m in self.moe_layers]),
                                         torch.stack([m.aux_loss.detach() for m in self.moe_layers])))

    def clip_gradients(self) -> None:
        """Scale the gradients so that the whole model's gradient norm is at most grad_clip_norm,
        whatever the layout (distributed/clipping.py); keep the norm before clipping for the log.
        fp16's gradients are unscaled first: the limit is on the true gradient."""
        from distributed import clipping  # imported only by runs that clip

        parts = self.parts
        if parts.scaler:
            parts.scaler.unscale_(parts.optimizer)  # scaler.step then knows not to unscale again
        limit = parts.cfg.optim.grad_clip_norm
        parts.grad_norms.append(clipping.clip_grad_norm(list(parts.model.parameters()), limit,
                                                        parts.ctx.mesh))

    def predict(self, inp: torch.Tensor) -> torch.Tensor | None:
        with self.compute():
            return self.parts.model(inp)

    def to_device(self, inp: torch.Tensor, tar: torch.Tensor,
                  validating: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        nb = self.parts.device.type == "cuda"  # pinned batches: the copy runs asynchronously
        return inp.to(self.parts.device, non_blocking=nb), tar.to(self.parts.device, non_blocking=nb)

    # ---------------------------------------------------------------- validation ---
    def metric_groups(self) -> list[Any]:
        """The process groups over which validation sums its metrics."""
        return [self.parts.ctx.dp_group]

    def gathers_in_forward(self) -> bool:
        """Collectives in every forward (FSDP's gathers, experts' all-to-all): the ranks must run
        as many validation batches."""
        parts = self.parts
        return parts.fsdp_active or parts.ctx.mesh.expert_parallel > 1

    def validated(self, result: dict[str, Any]) -> dict[str, Any]:
        """Validation's result, for rank 0's log (a pipeline sends the example image there)."""
        return result

    def held_bytes(self) -> dict[str, int]:
        """Bytes this rank holds by kind (training/reporting.py)."""
        return reporting.held_bytes(self.parts.model, self.parts.optimizer)

    def run_started(self) -> None:
        """The run directory is locked and training starts (DeepSpeed writes its config here)."""

    def epoch_record(self) -> dict[str, Any]:  # keys of the epoch's metrics (training/freezing.py)
        return {}

    def may_stop_after(self, done: int) -> bool:  # a stop signal may end training here (async: drains)
        return True

    def next_layout(self) -> dict[str, Any] | None:
        """Config values of the layout the next step needs, if not this one (training/freezing.py)."""
        return None

    state_class: type[ModelState] = ModelState  # the checkpoint's model and optimizer (training/state.py)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (or the model itself): distributed/tags.py's, which a
    single-device run does not load."""
    return model.module if isinstance(model, DistributedDataParallel) else model


class Trainer:
    """Builds every component from a validated Config and a RunContext (device, ranks, mesh, run
    folder) and runs the epochs; ``step``: the step variant's class; ``callbacks``: named hooks."""

    # what the step is handed (training/context.py: StepParts), read and written here by these names
    cfg, ctx, local_batch, train_data, amp_mode, attention_kernel, loss_fn = (Part() for _ in range(7))
    model, raw_model, optimizer, scheduler, scaler, writer = (Part() for _ in range(6))
    step, epoch_steps, epoch_loss, grad_norms, moe_stats, heartbeat = (Part() for _ in range(6))
    device, fsdp_active = Part(), Part()  # read only (StepParts' properties)

    def __init__(self, cfg: Config, ctx: RunContext, local_batch: int, step: type[EagerStep] = EagerStep,
                 callbacks: Sequence[Callback] = ()) -> None:
        step.check(cfg, ctx, local_batch)
        self.parts = StepParts(cfg, ctx, local_batch)
        self.callbacks = list(callbacks)
        dev.seed_all(cfg.run.seed)
        dev.configure_matmul(self.device)
        self.train_data = self.build_data("train", train=True)
        self.valid_data = self.build_data("valid", train=False)
        # bf16 under FSDP comes from its mixed-precision policy (bf16 copies of the gathered
        # weights, fp32 master weights and gradient reduction), not from autocast; DeepSpeed's
        # from its engine (bf16 weights: autocast would only add casts)
        self.amp_mode = "none" if self.fsdp_active and cfg.optim.amp_mode == "bf16" or not step.autocast \
            else cfg.optim.amp_mode
        self.attention_kernel = self.choose_attention_kernel()  # a resumed run keeps its own
        self.loss_fn = torch.compile(relative_l2_loss) if cfg.optim.enable_jit else relative_l2_loss
        self.variant = step(self.parts)
        self.model = self.variant.build_model()
        self.n_params = self.variant.n_params  # of the whole (serial) model
        self.raw_model = unwrap(self.model)
        self.optimizer = self.variant.build_optimizer(self.model)
        self.model = self.model if self.variant.engine is None else self.variant.engine
        self.weights = self.variant.state_class(self.variant)  # the model and optimizer in a checkpoint
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, make_lr_lambda(cfg.optim))
        self.scaler = dev.make_grad_scaler(self.device, cfg.optim.amp_mode)
        self.lat_weights = latitude_weights(cfg.model.img_size[0], self.device)
        self.channels = channel_names(cfg.data.data_dir, cfg.model.n_in_channels)[: cfg.model.n_out_channels]
        self.watches = self.build_watches()  # profilers and memory record, where the run asks
        self.epoch_loss = torch.zeros((), device=self.device)  # running sum in this epoch
        self.stop_agreement = StopAgreement(self.device, cfg.run.stop_check_every)
        self.stopped_early = False  # a stop signal ended training before num_iters
        self.stop_agreed = False  # every rank has agreed to stop, at the next step the variant may
        self.next_layout: dict[str, Any] | None = None  # the layout the run continues in (launcher)
        self._steps_at_start = 0  # the step this process started from (set by fit)
        self.heartbeat = new_heartbeat()  # where this rank is, for the diagnosis of a hang
        if self.heartbeat is not None:
            from distributed.health import collectives_by_phase  # loaded by distributed runs only

            self.heartbeat.collectives = collectives_by_phase(
                ddp=hasattr(self.model, "no_sync"), fsdp=self.fsdp_active,
                clipping=bool(cfg.optim.grad_clip_norm), zero1=cfg.layout.zero1 and ctx.mesh.dp_size > 1,
                model_parallel=ctx.mesh.model_parallel, pipeline=cfg.layout.pipeline_parallel > 1)
        # the process's peak memory up to here (model built, sharded, data loaders started), for
        # the first metrics record: a model that cannot fit one device must not be built whole
        peak = dev.peak_memory_bytes(self.device) or dev.process_peak_rss_bytes()
        self.build_peak_MiB: float | None = peak / 2**20
        for callback in self.callbacks:
            callback.model_built(self)

    # ------------------------------------------------------------------ building ---
    def build_data(self, split: str, train: bool) -> Batches:
        if self.cfg.data.data_loader_config == "dali":
            from utils.data_loader_dali import DALIBatches

            return DALIBatches(self.cfg, split, self.local_batch, train, num_shards=self.ctx.dp_size,
                               shard_id=self.ctx.dp_rank, device=self.device)
        pin = self.device.type == "cuda"  # page-locked batches: the copy to the GPU runs async
        loader, _, sampler = get_data_loader(
            self.cfg, split, self.local_batch, train, num_shards=self.ctx.dp_size,
            shard_id=self.ctx.dp_rank, pin_memory=pin)
        return Batches(loader, sampler, pin_memory=pin)

    def build_watches(self) -> list[Any]:
        """The profiling window (part 2) and the memory record (part 6), only where the run asks
        for them (utils/profiling.py)."""
        if self.cfg.profiling.profile_epoch is None and not self.cfg.profiling.memory_snapshot:
            return []
        from utils.profiling import MemoryRecord, ProfilingWindow

        return [ProfilingWindow(self.cfg, self.device, self.ctx.run_dir, self.ctx.rank,
                                self.train_data.batches_per_epoch),
                MemoryRecord(self.cfg, self.device, self.ctx.run_dir, self.ctx.rank, self.held_bytes)]

    def watched(self, epoch: int, batch: int) -> contextlib.AbstractContextManager:
        """One step inside the watches (nothing, without them)."""
        around = contextlib.ExitStack()
        for watch in self.watches:
            around.enter_context(watch.step(epoch, batch, self.step))
        return around

    def choose_attention_kernel(self) -> str:
        """The attention kernel for this run's device and precision (utils/attention.py)."""
        _, kv_len = attention.call_shape(self.cfg.model, self.local_batch)
        dtype = dev.AMP_DTYPES[self.cfg.optim.amp_mode] or torch.float32
        return attention.choose(self.cfg.optim.attention_kernel, self.device, dtype, kv_len)

    # --------------------------------------------------------------------- steps ---
    def train_step(self, inp: torch.Tensor, tar: torch.Tensor) -> torch.Tensor:
        """One optimizer step of this run's step variant; the loss as a device tensor."""
        return self.variant.train_step(inp, tar)

    def forward_loss(self, inp: torch.Tensor, tar: torch.Tensor) -> torch.Tensor:
        return self.variant.forward_loss(inp, tar)

    def run_steps(self, n: int) -> Iterator[tuple[float, torch.Tensor]]:
        """``n`` steps of the loop (as fit's, with the callbacks), epoch after epoch, with no
        validation, log or checkpoint: the benchmark's, the range test's and the batch-scaling
        study's loop. Yields each step's learning rate and loss (a device tensor) after the step;
        the caller may stop early."""
        self.model.train()
        while n > 0 and self.train_data.batches_per_epoch:
            epoch, start = divmod(self.step, self.train_data.batches_per_epoch)
            self.train_data.set_epoch(epoch, start)
            for i, batch in enumerate(self.train_data):
                lr = self.optimizer.param_groups[0]["lr"]  # this step's (the schedule moves it after)
                yield lr, self.run_step(batch, epoch, start + i)
                n -= 1
                if n == 0:
                    return

    def run_step(self, batch: tuple[torch.Tensor, torch.Tensor], epoch: int, index: int) -> torch.Tensor:
        """One step on ``batch`` (the epoch's ``index``-th; host tensors (B, C, H, W)): to the device,
        the callbacks around the step variant's step, the epoch's loss and the step count."""
        with self.watched(epoch, index), dev.nvtx_range(f"step {self.step}"):
            with dev.nvtx_range(f"data copy in {self.step}"):
                inp, tar = self.variant.to_device(*batch)
            with reporting.compile_notice(self.device, self.cfg.optim.enable_jit and
                                          self.step == self._steps_at_start):
                self.mark("forward")  # (a pipelined step marks nothing finer)
                for callback in self.callbacks:
                    callback.step_start(self)
                loss = self.train_step(inp, tar)
                for callback in self.callbacks:
                    loss = callback.step_end(self, loss) or loss
                self.epoch_loss += loss
        del inp, tar
        self.train_data.give_back(*batch)  # the step is over: the loader may reuse its memory
        self.step += 1
        self.epoch_steps += 1
        return loss

    def train_epoch(self, epoch: int, start_batch: int) -> int:
        """Train from ``start_batch`` to the end of the epoch or of training; returns steps run."""
        self.model.train()
        self.train_data.set_epoch(epoch, start_batch)
        done, optim = 0, self.cfg.optim
        for batch in self.train_data:  # (input, target): (B, C, H, W) each
            self.next_layout = self.variant.next_layout()  # another: a checkpoint, the launcher moves on
            if self.step >= optim.num_iters or self.next_layout is not None:
                break
            self.run_step(batch, epoch, start_batch + done)
            done += 1
            self.mark("stop check")
            self.stop_agreed = self.stop_agreed or self.stop_agreement.poll(self.step)
            if self.stop_agreed and self.variant.may_stop_after(self.step) and self.step < optim.num_iters:
                self.stopped_early = True
                break
            if self.checkpoint_due() and not self.at_epoch_end():  # the epoch's last: after validation
                self.save_checkpoint()
        return done

    def at_epoch_end(self) -> bool:
        return self.step % self.train_data.batches_per_epoch == 0 or self.step >= self.cfg.optim.num_iters

    def checkpoint_due(self) -> bool:
        every = self.cfg.run.checkpoint_every
        return bool(every) and self.step % every == 0 and self.step < self.cfg.optim.num_iters

    def validate(self) -> dict[str, Any]:
        """Loss and RMSE over every validation sample of every data-parallel rank."""
        self.model.eval()
        self.mark("validation")
        self.valid_data.set_epoch(0)
        pad_to = 0
        if self.variant.gathers_in_forward():  # every dp rank runs as many batches
            most = torch.tensor(float(self.valid_data.batches_per_epoch), device=self.device)
            pad_to = int(all_reduce_max(most, self.ctx.dp_group).item())
        batches = (self.variant.to_device(inp, tar, validating=True) for inp, tar in self.valid_data)
        result = validation.evaluate(self.variant.predict, batches, self.channels, self.lat_weights,
                                     self.variant.metric_groups(), pad_to)
        return self.variant.validated(result)

    def held_bytes(self) -> dict[str, int]:
        """Bytes this rank holds by kind (training/reporting.py; "step_gradients": a step's, if not
        as many as the trainable parameters)."""
        return self.variant.held_bytes()

    # --------------------------------------------------------------- checkpoints ---
    @property
    def checkpoint_path(self) -> Path:
        return self.ctx.run_dir / ckpt.CHECKPOINT_NAME

    def model_state(self) -> dict[str, torch.Tensor]:
        """The whole model's weights with the serial names (collective over the ranks)."""
        return self.weights.model_state()

    def checkpoint_parts(self) -> list[Any]:
        """What a checkpoint holds, part by part (each a state_dict / load_state_dict pair over its
        own keys of the checkpoint): this Trainer's progress first (it refuses a NaN), the model
        and optimizer (the step variant's, training/state.py), the schedule, the loss
        scaler, the random generators, the configuration."""
        return [LoopState(self.parts), self.weights, checkpointing.ScheduleState(self.scheduler),
                checkpointing.ScalerState(self.scaler), checkpointing.RandomState(self.device),
                checkpointing.ConfigRecord(self.cfg)]

    def save_checkpoint(self) -> None:
        self.mark("checkpoint")
        checkpointing.save(self.ctx.run_dir, self.checkpoint_parts(), self.step, self.ctx.is_main,
                           shards=self.weights if self.weights.sharded else None)

    def load_checkpoint(self, path: Path) -> None:
        checkpointing.load(path, self.checkpoint_parts(),
                           shards=self.weights if self.weights.sharded else None)
        log.info("resumed from %s at step %d", path, self.step)

    def set_lr_factor(self, factor: Callable[[int], float]) -> None:
        """Another schedule: step i's rate is ``lr`` x factor(i) (the range test's growing rate)."""
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)

    @contextlib.contextmanager
    def attention_kernel_as(self, kernel: str) -> Iterator[None]:
        """Steps inside use ``kernel`` (the cost measurement counts math's FLOPs)."""
        kept, self.attention_kernel = self.attention_kernel, kernel
        try:
            yield
        finally:
            self.attention_kernel = kept

    def mark(self, phase: str) -> None:
        """Where this rank is in its work, for the diagnosis of a hang (distributed/health.py)."""
        self.parts.mark(phase)

    # ------------------------------------------------------------------- logging ---
    def open_writer(self) -> None:
        if self.ctx.is_main:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.ctx.run_dir), purge_step=self.step or None)

    def log_epoch(self, epoch: int, seconds: float, steps: int, train_loss: float,
                  val: dict[str, Any], val_seconds: float) -> None:
        samples = steps * self.local_batch * self.ctx.dp_size
        memory = reporting.memory_report(self.raw_model, self.optimizer, self.device, self.held_bytes())
        norms = torch.stack(self.grad_norms).tolist() if self.grad_norms else None  # one host sync
        self.grad_norms = []
        extra = {"build_peak_MiB": self.build_peak_MiB} if self.build_peak_MiB is not None else {}
        self.build_peak_MiB = None  # in this process's first record only
        experts = None  # (steps, layers, experts + 2): shares, dropped, balancing loss
        if self.moe_stats:
            shares, aux = zip(*self.moe_stats)
            experts = torch.cat([torch.stack(shares), torch.stack(aux).cpu().unsqueeze(-1)], dim=-1)
        self.moe_stats = []
        if experts is not None:  # per layer: each expert's share of the assignments, dropped, aux loss
            extra["moe"] = experts.mean(dim=0).tolist()
        extra.update(self.variant.epoch_record())
        if self.ctx.mesh.world_size > 1:  # DDP's gradient all-reduce (compressed or not)
            from distributed.tags import gradient_bytes

            sent = gradient_bytes(self.model, steps)
            if sent is not None and steps:
                extra["grad_comm_bytes_per_step"] = sent / steps
        reporting.log_epoch(self.writer, self.ctx.run_dir, epoch, self.step, seconds, samples, steps,
                            train_loss, val, val_seconds, self.optimizer.param_groups[0]["lr"], memory,
                            norms, extra)
        reporting.log_memory(self.writer, self.step, memory, self.device)
        if experts is not None:
            reporting.log_experts(self.writer, self.step, experts)

    def finish_epoch_loss(self) -> float:
        """Average training loss of the epoch over all data-parallel ranks (one host sync)."""
        self.mark("epoch end")
        total = all_reduce_sum(self.epoch_loss.clone(), self.ctx.dp_group).item()
        mean = total / max(1, self.epoch_steps * self.ctx.dp_size)
        if not math.isfinite(mean):
            raise TrainingError(f"training loss is {mean} at step {self.step}; lower the learning "
                                f"rate or check the data")
        self.epoch_loss.zero_()
        self.epoch_steps = 0
        return mean

    # ----------------------------------------------------------------------- fit ---
    def fit(self) -> dict[str, Any]:
        """Train until ``num_iters`` steps; resume first if the run directory has a checkpoint."""
        found = checkpointing.find(self.ctx.run_dir)
        if found is not None:
            self.load_checkpoint(found)
            if self.step >= self.cfg.optim.num_iters:  # nothing to do: touch nothing (no TensorBoard purge)
                log.info("this run already took all %d steps; to train again, pass another --run_num "
                         "(or --num_iters N to train it further)", self.cfg.optim.num_iters)
                return {}
        self.variant.run_started()
        if self.ctx.is_main:
            checkpointing.remove_temp_files(self.ctx.run_dir)
            checkpointing.trim_metrics(self.ctx.run_dir, self.step)
        self.open_writer()
        self._steps_at_start = self.step
        spe = self.train_data.batches_per_epoch
        log.info("%d parameters; %d steps per epoch of %d samples; local batch %d on %d ranks",
                 self.n_params, spe, spe * self.local_batch * self.ctx.dp_size, self.local_batch,
                 self.ctx.dp_size)
        val: dict[str, Any] = {}
        while self.step < self.cfg.optim.num_iters and self.next_layout is None:
            epoch, start_batch = divmod(self.step, spe)
            dev.synchronize(self.device)
            start = time.time()
            steps = self.train_epoch(epoch, start_batch)
            if not ((self.stopped_early or self.next_layout) and not (steps and self.at_epoch_end())):
                dev.synchronize(self.device)
                seconds = time.time() - start
                train_loss = self.finish_epoch_loss()
                val_start = time.time()
                val = self.validate()
                self.log_epoch(epoch, seconds, steps, train_loss, val, time.time() - val_start)
                for callback in self.callbacks:
                    callback.epoch_end(self, epoch)
            if self.stopped_early:
                log.warning("stop signal (%s): stopping at step %d of %d to checkpoint",
                            received() or "received by another rank", self.step, self.cfg.optim.num_iters)
                break
            if self.checkpoint_due():  # a checkpoint on the epoch's last step, after validation
                self.save_checkpoint()
        self.stop_agreement.drain()
        if val or self.stopped_early or self.next_layout or checkpointing.find(self.ctx.run_dir) is None:
            self.save_checkpoint()
        if self.writer is not None:
            self.writer.close()
        if self.next_layout is None:  # (else the run goes on, in the launcher's next Trainer)
            for callback in self.callbacks:
                callback.fit_end(self)
        return val
