"""The training loop, written once for train.py, train_graph.py and train_mp.py.

:class:`Trainer` builds every component from a validated :class:`Config` and a
:class:`~training.context.RunContext` (device, ranks, mesh, run directory), then
:meth:`Trainer.fit` runs exactly ``num_iters`` optimizer steps with validation after
every epoch. The model is the serial ViT made parallel from outside by
distributed/parallelize.py, whatever the layout; variants that change the step
subclass it (training/graphs.py: CUDA Graphs).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from distributed import consolidate, sharding
from distributed.env import all_reduce_max, all_reduce_sum, heartbeat
from distributed.parallelize import parallelize, serial_values
from distributed.stop import StopAgreement
from distributed.tags import gradient_bytes, unwrap
from networks.vit import build_vit, count_parameters
from training import checkpointing, reporting, validation
from training.context import RunContext, TrainingError
from utils import attention
from utils import checkpoint as ckpt
from utils import device as dev
from utils.config import Config
from utils.data_loader import Batches, get_data_loader
from utils.metrics import latitude_weights, relative_l2_loss
from utils.profiling import MemoryRecord, ProfilingWindow
from utils.signals import received

if TYPE_CHECKING:  # imported by the rank that writes (open_writer): 0.15 s of every other rank's start
    from torch.utils.tensorboard import SummaryWriter
log = logging.getLogger(__name__)


def make_lr_lambda(cfg: Config):
    """The learning rate of each step as a multiple of ``lr``: linear warmup over ``warmup`` steps,
    then cosine decay to 0 at ``num_iters`` (or constant); or one cycle (Smith's one-cycle policy,
    with cosine ramps as torch's OneCycleLR): up from lr / div over the first pct_start of the
    steps, then down to lr / div / final_div at ``num_iters``. A pure function of the step, so a
    resumed run continues the schedule exactly."""
    if cfg.lr_schedule == "onecycle":
        return onecycle_factor(cfg.num_iters, cfg.onecycle_pct_start, cfg.onecycle_div_factor,
                               cfg.onecycle_final_div_factor)

    def factor(step: int) -> float:
        if cfg.warmup and step < cfg.warmup:
            return (step + 1) / cfg.warmup
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = (step - cfg.warmup) / max(1, cfg.num_iters - cfg.warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def onecycle_factor(total: int, pct_start: float, div: float, final_div: float):
    first = 1.0 / div
    last = first / final_div
    rise = max(1, round(pct_start * total))

    def ramp(start: float, end: float, progress: float) -> float:  # cosine from start to end
        return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    def factor(step: int) -> float:
        if step < rise:
            return ramp(first, 1.0, step / rise)
        return ramp(1.0, last, (step - rise) / max(1, total - rise))

    return factor


class Trainer:
    def __init__(self, cfg: Config, ctx: RunContext, local_batch: int) -> None:
        self.cfg, self.ctx, self.local_batch = cfg, ctx, local_batch
        if local_batch % cfg.grad_accum_steps:
            raise ValueError(f"the local batch of {local_batch} samples does not split into "
                             f"--grad_accum_steps {cfg.grad_accum_steps} equal micro-batches; choose a "
                             f"number of micro-batches that divides it")
        self.device = ctx.device
        dev.seed_all(cfg.seed)
        dev.configure_matmul(self.device)
        self.train_data = self.build_data("train", train=True)
        self.valid_data = self.build_data("valid", train=False)
        self.n_params = 0  # of the whole (serial) model, set by build_model
        self.model = self.build_model()
        self.raw_model = unwrap(self.model)
        # mixture-of-experts layers (networks/moe.py): their balancing loss joins the training loss
        self.moe_layers = [m for m in self.raw_model.modules() if hasattr(m, "aux_loss")] \
            if isinstance(self.raw_model, nn.Module) else []  # (a pipeline's stages: no experts)
        # per step: each layer's shares (layers, experts + 1) and balancing loss (layers,)
        self.moe_stats: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.amp_mode = sharding.autocast_mode(cfg, ctx.mesh)  # FSDP's bf16 is its own policy
        self.attention_kernel = self.choose_attention_kernel()  # a resumed run keeps its own
        # FSDP alone writes sharded checkpoints; with tp its tensors are tp slices, consolidated
        self.sharded_checkpoints = sharding.fsdp_active(cfg, ctx.mesh) and not ctx.mesh.model_parallel
        self.loss_fn = torch.compile(relative_l2_loss) if cfg.enable_jit else relative_l2_loss
        self.optimizer = self.build_optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, make_lr_lambda(cfg))
        self.scaler = dev.make_grad_scaler(self.device, cfg.amp_mode)
        self.lat_weights = latitude_weights(cfg.img_size[0], self.device)
        self.profiling = ProfilingWindow(cfg, self.device, ctx.run_dir, ctx.rank,
                                         self.train_data.batches_per_epoch)
        self.memory_record = MemoryRecord(cfg, self.device, ctx.run_dir, ctx.rank, self.held_bytes)
        self.step = 0  # optimizer steps done
        self.epoch_loss = torch.zeros((), device=self.device)  # running sum in this epoch
        self.epoch_steps = 0
        self.grad_norms: list[torch.Tensor] = []  # this epoch's, before clipping (device scalars)
        self.writer: SummaryWriter | None = None
        self.stop_agreement = StopAgreement(self.device, cfg.stop_check_every)
        self.stopped_early = False  # a stop signal ended training before num_iters
        self._steps_at_start = 0  # the step this process started from (set by fit)
        self.heartbeat = heartbeat()  # where this rank is, for the diagnosis of a hang
        if self.heartbeat is not None:
            from distributed.health import collectives_by_phase  # loaded by distributed runs only

            mesh = ctx.mesh
            self.heartbeat.collectives = collectives_by_phase(
                ddp=hasattr(self.model, "no_sync"), fsdp=sharding.fsdp_active(cfg, mesh),
                zero1=cfg.data_parallel == "zero1" and mesh.dp_size > 1, model_parallel=mesh.model_parallel,
                pipeline=cfg.pipeline_parallel > 1, clipping=bool(cfg.grad_clip_norm))
        # the process's peak memory up to here (model built, sharded, data loaders started), for
        # the first metrics record: a model that cannot fit one device must not be built whole
        peak = dev.peak_memory_bytes(self.device) or dev.process_peak_rss_bytes()
        self.build_peak_MiB: float | None = peak / 2**20

    # ------------------------------------------------------------------ building ---
    def build_data(self, split: str, train: bool) -> Batches:
        if self.cfg.data_loader_config == "dali":
            from utils.data_loader_dali import DALIBatches

            return DALIBatches(self.cfg, split, self.local_batch, train, num_shards=self.ctx.dp_size,
                               shard_id=self.ctx.dp_rank, device=self.device)
        pin = self.device.type == "cuda"  # page-locked batches: the copy to the GPU runs async
        loader, _, sampler = get_data_loader(
            self.cfg, split, self.local_batch, train, num_shards=self.ctx.dp_size,
            shard_id=self.ctx.dp_rank, pin_memory=pin)
        return Batches(loader, sampler, pin_memory=pin)

    def build_model(self) -> nn.Module:
        """The serial model on the meta device (shapes, no memory), then this rank's part of it,
        allocated and filled with the serial model's values from the seed (the same weights in
        every layout)."""
        with torch.device("meta"):
            serial = build_vit(self.cfg)
        self.n_params = count_parameters(serial)
        model = parallelize(serial, self.ctx.mesh, self.cfg, self.device,
                            serial_values(serial, self.cfg.seed))
        if self.ctx.mesh.model_parallel:
            log.info("%s; this rank holds %d of the model's %d parameters", self.ctx.mesh.describe(),
                     count_parameters(unwrap(model)), self.n_params)
        return model

    def choose_attention_kernel(self) -> str:
        """The attention kernel for this run's device and precision (utils/attention.py)."""
        _, kv_len = attention.call_shape(self.cfg, self.local_batch)
        dtype = dev.AMP_DTYPES[self.cfg.amp_mode] or torch.float32
        return attention.choose(self.cfg.attention_kernel, self.device, dtype, kv_len)

    def build_optimizer(self) -> torch.optim.Optimizer:
        return sharding.build_optimizer(self.model, self.cfg, self.ctx.mesh,
                                        dev.adam_kernel(self.cfg.enable_fused))

    # --------------------------------------------------------------------- steps ---
    autocast_cache = True  # CUDA graph capture needs it off

    def compute(self, cache_enabled: bool = True) -> contextlib.ExitStack:
        """Where forward passes run: autocast to the run's precision, and its attention kernel
        (backward follows the kernels that forward chose)."""
        region = contextlib.ExitStack()
        region.enter_context(dev.autocast(self.device, self.amp_mode, cache_enabled=cache_enabled))
        region.enter_context(attention.kernel(self.attention_kernel))
        return region

    def forward_loss(self, inp: torch.Tensor, tar: torch.Tensor) -> torch.Tensor:
        with self.compute(cache_enabled=self.autocast_cache):
            pred = self.model(inp)
        return self.loss_fn(pred.float(), tar)

    def train_step(self, inp: torch.Tensor, tar: torch.Tensor) -> torch.Tensor:
        """One optimizer step; returns the loss as a device tensor (no host sync).

        With ``grad_accum_steps`` N the batch runs as N micro-batches whose gradients add up;
        each loss is divided by N (the mean over the whole batch, as one big batch would give)
        and only the last micro-batch's backward reduces gradients over the ranks."""
        n = self.cfg.grad_accum_steps
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(zip(inp.chunk(n), tar.chunk(n))):
            with sharding.gradient_sync(self.model, enabled=i == n - 1):
                self.mark("forward")
                with dev.nvtx_range("forward"):
                    loss = self.forward_loss(x, y) / n
                    objective = loss + self.balancing_loss() / n  # the loss alone is logged
                self.mark("backward")
                with dev.nvtx_range("backward"):
                    (self.scaler.scale(objective) if self.scaler else objective).backward()
            total += loss.detach()
        self.optimizer_step()
        if self.moe_layers:  # what each expert got in the step's (last) micro-batch, for the logs:
            # shares (host) and the balancing loss (device: no host sync here, one per epoch)
            self.moe_stats.append((torch.stack([m.stats for m in self.moe_layers]),
                                   torch.stack([m.aux_loss.detach() for m in self.moe_layers])))
        return total

    def balancing_loss(self) -> torch.Tensor | float:
        """The mixture of experts' load-balancing loss of the last forward, weighted (0 without experts)."""
        if not self.moe_layers:
            return 0.0
        return self.cfg.moe_aux_weight * sum(m.aux_loss for m in self.moe_layers)

    def optimizer_step(self) -> None:
        self.mark("optimizer step")
        with dev.nvtx_range("optimizer"):
            if self.cfg.grad_clip_norm:
                self.clip_gradients()
            if self.scaler:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()

    def clip_gradients(self) -> None:
        """Scale the gradients so that the whole model's gradient norm is at most grad_clip_norm,
        whatever the layout (distributed/clipping.py); keep the norm before clipping for the log.
        fp16's gradients are unscaled first: the limit is on the true gradient."""
        from distributed import clipping  # imported only by runs that clip

        if self.scaler:
            self.scaler.unscale_(self.optimizer)  # scaler.step then knows not to unscale again
        self.grad_norms.append(clipping.clip_grad_norm(list(self.model.parameters()), self.cfg.grad_clip_norm,
                                                       self.ctx.mesh))

    def to_device(self, inp: torch.Tensor, tar: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        nb = self.device.type == "cuda"
        return inp.to(self.device, non_blocking=nb), tar.to(self.device, non_blocking=nb)

    def train_epoch(self, epoch: int, start_batch: int) -> int:
        """Train from ``start_batch`` to the end of the epoch or of training; returns steps run."""
        self.model.train()
        self.train_data.set_epoch(epoch, start_batch)
        done = 0
        for batch in self.train_data:  # (input, target): (B, C, H, W) each
            if self.step >= self.cfg.num_iters:
                break
            with self.profiling.step(epoch, start_batch + done, self.step), \
                    self.memory_record.step(self.step), dev.nvtx_range(f"step {self.step}"):
                with dev.nvtx_range(f"data copy in {self.step}"):
                    inp, tar = self.to_device(*batch)
                with reporting.compile_notice(self.device, self.cfg.enable_jit and
                                              self.step == self._steps_at_start):
                    self.mark("forward")  # (a pipelined step marks nothing finer)
                    self.epoch_loss += self.train_step(inp, tar)
            del inp, tar
            self.train_data.give_back(*batch)  # the step is over: the loader may reuse its memory
            self.step += 1
            self.epoch_steps += 1
            done += 1
            self.mark("stop check")
            if self.stop_agreement.poll(self.step):
                self.stopped_early = True
                break
            if self.checkpoint_due() and not self.at_epoch_end():  # the epoch's last: after validation
                self.save_checkpoint()
        return done

    def at_epoch_end(self) -> bool:
        return self.step % self.train_data.batches_per_epoch == 0 or self.step >= self.cfg.num_iters

    def checkpoint_due(self) -> bool:
        every = self.cfg.checkpoint_every
        return bool(every) and self.step % every == 0 and self.step < self.cfg.num_iters

    def predict(self, inp: torch.Tensor) -> torch.Tensor | None:
        with self.compute():
            return self.model(inp)

    def metric_groups(self) -> list[Any]:
        """The process groups over which validation sums its metrics."""
        return [self.ctx.dp_group]

    def validate(self) -> dict[str, Any]:
        """Loss and RMSE over every validation sample of every data-parallel rank."""
        self.model.eval()
        self.mark("validation")
        self.valid_data.set_epoch(0)
        pad_to = 0
        if self.gathers_in_forward():  # every dp rank runs as many batches
            most = torch.tensor(float(self.valid_data.batches_per_epoch), device=self.device)
            pad_to = int(all_reduce_max(most, self.ctx.dp_group).item())
        batches = (self.to_device(inp, tar) for inp, tar in self.valid_data)
        return validation.evaluate(self.predict, batches, self.cfg.n_out_channels, self.lat_weights,
                                   self.metric_groups(), pad_to)

    def gathers_in_forward(self) -> bool:  # collectives in every forward: FSDP's gathers, experts' all-to-all
        return sharding.fsdp_active(self.cfg, self.ctx.mesh) or self.ctx.mesh.expert_parallel > 1

    def held_bytes(self) -> dict[str, int]:
        """Bytes this rank holds by kind (training/reporting.py; "step_gradients": a step's, if not
        as many as the trainable parameters)."""
        return reporting.held_bytes(self.model, self.optimizer)

    # --------------------------------------------------------------- checkpoints ---
    @property
    def checkpoint_path(self) -> Path:
        return self.ctx.run_dir / ckpt.CHECKPOINT_NAME

    # consolidated: whole tensors with the serial names, whatever the layout (collectives over tp)
    # (expert parallel: every rank's experts too, broadcast by their owners, distributed/experts.py)
    def model_state(self) -> dict[str, torch.Tensor]:
        state = consolidate.full_state(self.raw_model, self.ctx.mesh)
        if self.ctx.mesh.expert_parallel > 1:
            state = self.experts().full_model_state(self.raw_model, self.ctx.mesh, state)
        return state

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        if self.ctx.mesh.expert_parallel > 1:
            state = self.experts().local_model_state(self.raw_model, state)
        consolidate.load_full_state(self.raw_model, state, self.ctx.mesh)

    def optimizer_state(self) -> dict[str, Any]:
        state = consolidate.full_optimizer_state(self.optimizer, self.ctx.mesh)
        if self.ctx.mesh.expert_parallel > 1:
            state = self.experts().full_optimizer_state(self.raw_model, self.ctx.mesh, state)
        return state

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        if self.ctx.mesh.expert_parallel > 1:
            state = self.experts().local_optimizer_state(self.raw_model, state)
        consolidate.load_full_optimizer_state(self.optimizer, state, self.ctx.mesh)

    @staticmethod
    def experts() -> Any:
        from distributed import experts  # loaded by expert-parallel runs only

        return experts

    def save_checkpoint(self) -> None:
        self.mark("checkpoint")
        checkpointing.save(self)

    def load_checkpoint(self, path: Path) -> None:
        checkpointing.load(self, path)

    def mark(self, phase: str) -> None:
        """Where this rank is in its work, for the diagnosis of a hang (distributed/health.py)."""
        if self.heartbeat is not None:
            self.heartbeat.mark(self.step, phase)

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
        sent = gradient_bytes(self.model, steps)  # DDP's gradient all-reduce (compressed or not)
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
            if self.step >= self.cfg.num_iters:  # nothing to do: touch nothing (no TensorBoard purge)
                log.info("this run already took all %d steps; to train again, pass another --run_num "
                         "(or --num_iters N to train it further)", self.cfg.num_iters)
                return {}
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
        while self.step < self.cfg.num_iters:
            epoch, start_batch = divmod(self.step, spe)
            dev.synchronize(self.device)
            start = time.time()
            steps = self.train_epoch(epoch, start_batch)
            if not (self.stopped_early and not self.at_epoch_end()):  # a whole epoch: close it
                dev.synchronize(self.device)
                seconds = time.time() - start
                train_loss = self.finish_epoch_loss()
                val_start = time.time()
                val = self.validate()
                self.log_epoch(epoch, seconds, steps, train_loss, val, time.time() - val_start)
            if self.stopped_early:
                log.warning("stop signal (%s): stopping at step %d of %d to checkpoint",
                            received() or "received by another rank", self.step, self.cfg.num_iters)
                break
            if self.checkpoint_due():  # a checkpoint on the epoch's last step, after validation
                self.save_checkpoint()
        self.stop_agreement.drain()
        if val or self.stopped_early or checkpointing.find(self.ctx.run_dir) is None:
            self.save_checkpoint()
        if self.writer is not None:
            self.writer.close()
        return val
