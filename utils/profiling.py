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
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from utils import device as dev
from utils.config import Config

log = logging.getLogger(__name__)

TRACE_DIR = "profile"


class ProfilingWindow:
    """Opens and closes the profilers around the steps of the window."""

    def __init__(self, cfg: Config, device: torch.device, run_dir: Path, rank: int,
                 steps_per_epoch: int) -> None:
        self.enabled = cfg.profile_epoch is not None
        self.epoch = cfg.profile_epoch
        self.first = cfg.profile_start_step
        self.last = steps_per_epoch - 1
        if cfg.profile_num_steps is not None:
            self.last = min(self.last, self.first + cfg.profile_num_steps - 1)
        self.last_global_step = cfg.num_iters - 1
        self.device, self.rank, self.torch_trace = device, rank, cfg.profile
        self.trace_dir = run_dir / TRACE_DIR
        self._torch_prof: torch.profiler.profile | None = None
        self._open = False
        if self.enabled:
            self._check(steps_per_epoch, cfg.num_iters)

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
