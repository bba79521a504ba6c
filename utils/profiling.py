"""The profiling window: a few chosen training steps, captured by Nsight Systems or torch.profiler.

The window is ``profile_num_steps`` steps from batch ``profile_start_step`` of epoch
``profile_epoch`` (0-based; without ``profile_num_steps``, to the end of the epoch or of
training). At its edges every rank calls ``cudaProfilerStart`` / ``cudaProfilerStop``, so

    nsys profile -c cudaProfilerApi --trace cuda,nvtx python train.py ...

records exactly those steps with their NVTX ranges (step, data copy in, forward,
backward, optimizer), one report per rank when every rank runs under nsys (the submit
scripts do that; a rank without nsys is not affected by the calls). With ``profile: True``
(``--profile``) every rank also records a torch.profiler trace of the same steps, on CPU and GPU alike, into
``RUN_DIR/profile/rank<N>.<time>.pt.trace.json``: open it in Perfetto
(https://ui.perfetto.dev) or in TensorBoard with the torch-tb-profiler plugin.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from utils import compat
from utils import device as dev
from utils.config import Config

log = logging.getLogger(__name__)

TRACE_DIR = "profile"


class ProfilingWindow:
    """Opens and closes the profilers around the steps of the window."""

    def __init__(self, cfg: Config, device: torch.device, run_dir: Path, rank: int,
                 steps_per_epoch: int) -> None:
        self.enabled = cfg.profiling.profile_epoch is not None
        self.epoch = cfg.profiling.profile_epoch
        self.first = cfg.profiling.profile_start_step
        self.last = steps_per_epoch - 1
        if cfg.profiling.profile_num_steps is not None:
            self.last = min(self.last, self.first + cfg.profiling.profile_num_steps - 1)
        self.last_global_step = cfg.optim.num_iters - 1
        self.device, self.rank, self.torch_trace = device, rank, cfg.profiling.profile
        self.trace_dir = run_dir / TRACE_DIR
        self._torch_prof: torch.profiler.profile | None = None
        self._open = False
        if self.enabled:
            self._check(steps_per_epoch, cfg.optim.num_iters)

    def _check(self, steps_per_epoch: int, num_iters: int) -> None:
        if self.first >= steps_per_epoch:
            raise ValueError(f"profile_start_step {self.first} is beyond the {steps_per_epoch} steps "
                             f"of an epoch; choose a step below {steps_per_epoch}")
        if self.epoch * steps_per_epoch + self.first >= num_iters:
            raise ValueError(f"the profiling window (epoch {self.epoch}, step {self.first}) starts "
                             f"after the last of {num_iters} training steps; choose an earlier epoch")

    @contextlib.contextmanager
    def step(self, epoch: int, batch: int, global_step: int) -> Iterator[None]:
        """Wrap one training step: batch ``batch`` of ``epoch``, ``global_step`` overall."""
        in_window = self.enabled and epoch == self.epoch and self.first <= batch <= self.last
        if in_window and not self._open:
            self._start()
        try:
            yield
        finally:
            if self._open and (batch >= self.last or global_step >= self.last_global_step):
                self._stop()

    def _start(self) -> None:
        self._open = True
        dev.synchronize(self.device)
        if self.torch_trace:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            handler = torch.profiler.tensorboard_trace_handler(str(self.trace_dir),
                                                               worker_name=f"rank{self.rank}")
            self._torch_prof = torch.profiler.profile(activities=activities, on_trace_ready=handler)
            self._torch_prof.start()
        dev.cuda_profiler_start()  # every rank: each rank's nsys waits for its own start
        log.info("profiling window opened (epoch %d, step %d)", self.epoch, self.first)

    def _stop(self) -> None:
        self._open = False
        dev.synchronize(self.device)
        dev.cuda_profiler_stop()
        if self._torch_prof is not None:
            self._torch_prof.stop()  # writes the trace through the handler
            self._torch_prof = None
            log.info("torch.profiler trace written to %s", self.trace_dir)
        log.info("profiling window closed")


class SavedTensorMeter:
    """Bytes of the tensors autograd keeps for backward that are alive at once: each saved
    tensor is packed into a holder whose release (when backward is done with it) subtracts
    its storage again. Parameters are weights, not activations, and are not counted."""

    def __init__(self) -> None:
        self.live: dict[int, list[int]] = {}  # storage address -> [bytes, holders]
        self.now = self.peak = 0

    def pack(self, t: torch.Tensor) -> object:
        if isinstance(t, torch.nn.Parameter):
            return t
        storage = t.untyped_storage()
        key = storage.data_ptr()
        entry = self.live.setdefault(key, [storage.nbytes(), 0])
        if entry[1] == 0:
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        return _Held(t, key, self)

    @staticmethod
    def unpack(held):
        return held.t if isinstance(held, _Held) else held

    def release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[key]


class _Held:
    def __init__(self, t, key: int, meter: SavedTensorMeter) -> None:
        self.t, self.key, self.meter = t, key, meter

    def __del__(self) -> None:
        self.meter.release(self.key)


MEMORY_DIR = "memory"


PHASES = ("forward", "backward", "optimizer")  # the trainer's ranges the record closes on


class MemoryRecord:
    """``memory_snapshot``: where memory goes during one training step, kind by kind.

    The step is the second this process runs (the first allocates Adam's state) or, with one
    step left, the first. Each rank writes ``RUN_DIR/memory/memory_phases_rank<N>.json``,
    counted here in any layout: the bytes this rank holds in parameters, gradients and
    optimizer state (``held()``: FSDP shards, ZeRO-1's share) and in activations (what autograd
    keeps for backward, SavedTensorMeter), at the step's start and at the end of its forward,
    backward and optimizer ranges (the last ends with ``zero_grad``), with the activations'
    peak and the process's peak (CUDA allocator, or resident set) during the step;
    scripts/plot_memory.py draws it. (torch.profiler's ``export_memory_timeline`` sorts every
    allocation by kind too, but it is deprecated from torch 2.13 on and its analysis failed on
    FSDP2 steps here.)

    On CUDA the allocator's history is written too, ``memory_snapshot_rank<N>.pickle``: every
    block with the stack that allocated it, for PyTorch's viewer (https://pytorch.org/memory_viz).
    """

    def __init__(self, cfg: Config, device: torch.device, run_dir: Path, rank: int,
                 held: Callable[[], dict[str, int]]) -> None:
        self.enabled, self.num_iters = cfg.profiling.memory_snapshot, cfg.optim.num_iters
        self.device, self.rank, self.out, self.held = device, rank, run_dir / MEMORY_DIR, held
        self.target: int | None = None

    @contextlib.contextmanager
    def step(self, epoch: int, batch: int, global_step: int) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        if self.target is None:
            self.target = min(global_step + 1, self.num_iters - 1)
        if global_step != self.target:
            yield
            return
        cuda = self.device.type == "cuda"
        if cuda:
            compat.cuda_memory_history(True)
        meter, phases = SavedTensorMeter(), []

        def record(name: str) -> None:
            dev.synchronize(self.device)
            phases.append({"phase": name, **self.held(), "activations": meter.now})

        @contextlib.contextmanager
        def at_end(name: str) -> Iterator[None]:
            yield
            if name in PHASES:
                record(name)

        dev.reset_peak_memory(self.device)
        dev.reset_process_peak()
        record("start")
        dev.RANGE_HOOKS.append(at_end)
        try:
            with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                yield
        finally:
            dev.RANGE_HOOKS.remove(at_end)
        self.out.mkdir(parents=True, exist_ok=True)
        peak = dev.peak_memory_bytes(self.device) or dev.process_peak_rss_bytes()
        summary = {"step": global_step, "device": str(self.device), "phases": phases,
                   "activations_peak": meter.peak, "process_peak": peak,
                   "process_peak_kind": "CUDA allocator" if cuda else "resident set"}
        (self.out / f"memory_phases_rank{self.rank}.json").write_text(json.dumps(summary, indent=1))
        if cuda:
            compat.dump_cuda_memory_snapshot(str(self.out / f"memory_snapshot_rank{self.rank}.pickle"))
            compat.cuda_memory_history(False)
        log.info("memory of step %d written to %s", global_step, self.out)
