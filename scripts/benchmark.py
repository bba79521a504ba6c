#!/usr/bin/env python
"""Climb the single-device optimization ladder and measure every rung.

    python scripts/benchmark.py --config small            # CPU lesson (generates its data)
    python scripts/benchmark.py --config short --steps 50 # a GPU node

Rungs, each adding to the one before: baseline (PyTorch DataLoader, no workers, fp32);
+workers; +DALI; +AMP (bf16); +fused Adam; +torch.compile; +CUDA graphs (CUDA only).
Without DALI installed, +DALI is left out and the later rungs keep the PyTorch DataLoader.
Every rung trains with the project's Trainer (its train_epoch and train_step, nothing
re-implemented) for ``--warmup`` + ``--steps`` steps and reports

* samples/s over the ``--steps`` timed steps (after warm-up: compilation, first batches);
* the step time split into data wait (between steps: the loader's wait and the loop's work)
  and forward, backward and optimizer (the trainer's own ranges, over ``--profile_steps``
  extra steps so the timing's overhead stays out of samples/s): on CPU the CPU time
  torch.profiler gives those ranges, on CUDA the GPU time between CUDA events recorded at their
  edges (see EventPhases);
* peak memory: the CUDA allocator's peak, or on CPU the process's peak resident set
  (VmHWM, reset before each rung);
* model FLOPs per sample (forward + backward, counted by torch.utils.flop_counter) and
  MFU against two peaks of the rung's dtype, both measured in this run on this device with
  the trainer's matmul settings (on CUDA, fp32 matmuls on TF32 tensor cores): one large
  square matmul, what the hardware can do; and the model's own linear layers at this batch
  (each distinct M x K x N, forward and the two backward products), what this model can reach
  here (a CPU's bf16 units reach their peak only on large enough products);
* the data loader alone (no model) against a plain h5py read of the same samples.

A bare PyTorch loop over the same model and one batch held in memory (no loader, no
logging, no scheduler), with the rung's precision, Adam kernel, compilation and attention
kernel, is the reference: it runs right after each rung (the same state of the process and
the machine), and ``vs bare`` is the rung's samples/s over it. A rung whose training loss is
not finite does not train: it is reported as failed, with the step, and not timed (it stops at
the end of its warm-up when the loss is already not finite there). The attention table times
one attention call per kernel and dtype (utils/attention.py). Results go to
OUT_DIR/benchmark.json and OUT_DIR/benchmark.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import h5py
import torch
from torch.utils import flop_counter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from networks.backbone import build  # noqa: E402
from scripts.instruments import write_report  # noqa: E402
from training.context import RunContext  # noqa: E402
from training.trainer import Callback, EagerStep, Trainer  # noqa: E402
from utils import attention  # noqa: E402
from utils import device as dev  # noqa: E402
from utils.config import ATTENTION_KERNELS, DEFAULT_YAML, Config, load_config, with_overrides  # noqa: E402
from utils.metrics import relative_l2_loss  # noqa: E402

# name -> settings added on top of the rung before
RUNGS: list[tuple[str, dict[str, Any]]] = [
    ("baseline", {"data_loader_config": "pytorch", "num_data_workers": 0, "amp_mode": "none",
                  "enable_fused": False, "enable_jit": False}),
    ("+workers", {"num_data_workers": None}),  # None: --workers
    ("+DALI", {"data_loader_config": "dali"}),
    ("+AMP", {"amp_mode": None}),  # None: --amp
    ("+fused", {"enable_fused": True}),
    ("+compile", {"enable_jit": True}),
    ("+graphs", {}),  # the CUDA graph trainer of train_graph.py
]
RUNG_NAMES = [name for name, _ in RUNGS]
DTYPES = {"none": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# the trainers' ranges (utils.device.nvtx_range) that the step breakdown reports
PHASES = ("forward", "backward", "optimizer", "graph replay")


# ---------------------------------------------------------------- measuring ---
class RungClock(Callback):
    """Clocks a rung's steps from the Trainer's callbacks: the timed window runs from the end of
    step ``timed_from - 1`` to the end of step ``profile_from - 1`` (device synchronised at both
    edges), and each timed step's wait is the time between the previous step's end and its start
    (the loader's wait for the batch, and the loop's own work between steps); from step
    ``profile_from`` on, ``phases`` break the steps down. It keeps each step's loss (a device
    scalar, no host sync) and, at the end of the warm-up, stops the rung (NonFiniteLossError) if one
    is not finite: a rung that does not train is not timed."""

    def __init__(self, device: torch.device, timed_from: int, profile_from: int,
                 phases: ProfilerPhases | EventPhases) -> None:
        self.device, self.phases = device, phases
        self.timed_from, self.profile_from = timed_from, profile_from
        self.count = 0  # steps done
        self.wait = 0.0  # seconds between steps inside the timed window
        self.t_start = self.t_end = self.last_end = None
        self.losses: list[torch.Tensor] = []

    def begin(self) -> None:
        """Before the first step: the window starts here when nothing is warmed up first."""
        dev.synchronize(self.device)
        self.last_end = time.perf_counter()
        if self.timed_from == 0:
            self.t_start = self.last_end

    def step_start(self, trainer: Trainer) -> None:
        if self.timed_from <= self.count < self.profile_from:
            self.wait += time.perf_counter() - self.last_end
        if self.count == self.profile_from:
            self.phases.start()

    def step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
        self.count += 1
        self.losses.append(loss.detach())
        if self.count in (self.timed_from, self.profile_from):
            dev.synchronize(self.device)
            now = time.perf_counter()
            if self.count == self.timed_from:
                self.raise_if_not_finite()  # before the timed window opens
                self.t_start = time.perf_counter()
            if self.count == self.profile_from:
                self.t_end = now
        self.last_end = time.perf_counter()

    def first_non_finite(self) -> tuple[int, float] | None:
        """(step, loss) of the first step whose training loss is not finite (steps counted from
        1, as the Trainer counts them), or None."""
        if not self.losses:
            return None
        losses = torch.stack(self.losses).float().cpu()  # one host sync
        bad = torch.nonzero(~torch.isfinite(losses)).flatten()
        return (int(bad[0]) + 1, float(losses[bad[0]])) if len(bad) else None

    def raise_if_not_finite(self) -> None:
        bad = self.first_non_finite()
        if bad is not None:
            raise NonFiniteLossError(*bad)


class NonFiniteLossError(Exception):
    """A rung's training loss is not finite: it does not train, so its speed means nothing."""

    def __init__(self, step: int, loss: float) -> None:
        super().__init__(f"training loss is {loss} at step {step}")
        self.step, self.loss = step, loss


class ProfilerPhases:
    """CPU: the CPU time torch.profiler gives the trainer's ranges."""

    def __init__(self) -> None:
        self.prof: torch.profiler.profile | None = None

    def start(self) -> None:
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.prof.start()

    def stop(self) -> None:
        if self.prof is not None:
            self.prof.stop()

    def ms_per_step(self, steps: int) -> dict[str, float]:
        out: dict[str, float] = {}
        for event in self.prof.key_averages() if self.prof is not None else []:
            if event.key in PHASES:
                out[event.key] = out.get(event.key, 0.0) + event.cpu_time_total / 1000.0 / steps
        return out


class EventPhases:
    """CUDA: GPU time of the trainer's ranges, from events on the current stream at their edges.

    torch.profiler cannot give this: autograd launches the backward kernels from its own
    device thread, so the main thread's ``backward`` range is credited with almost none of
    them. An event recorded when a range is entered and one when it is left bracket every
    kernel queued in between, whichever thread queued it: ``backward()`` returns only when
    all its kernels are queued, on the streams of their forward ops (here the current one).

    While started, a hook on ``utils.device.nvtx_range`` (``RANGE_HOOKS``) records the events
    around the trainer's own ranges, so nothing of the trainer is copied.
    """

    def __init__(self, device: torch.device, make_event: Callable[[], Any] | None = None) -> None:
        self.make_event = make_event or (lambda: dev.timing_event(device))
        self.pairs: list[tuple[str, Any, Any]] = []

    def start(self) -> None:
        dev.RANGE_HOOKS.append(self._range)

    def stop(self) -> None:
        if self._range in dev.RANGE_HOOKS:
            dev.RANGE_HOOKS.remove(self._range)

    @contextlib.contextmanager
    def _range(self, name: str) -> Iterator[None]:
        if name not in PHASES:
            yield
            return
        begin = self.make_event()
        begin.record()
        yield
        end = self.make_event()
        end.record()
        self.pairs.append((name, begin, end))

    def ms_per_step(self, steps: int) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, begin, end in self.pairs:
            end.synchronize()
            out[name] = out.get(name, 0.0) + begin.elapsed_time(end) / steps
        return out


def phase_clock(device: torch.device) -> ProfilerPhases | EventPhases:
    return EventPhases(device) if device.type == "cuda" else ProfilerPhases()


def reset_peak_memory(device: torch.device) -> None:
    gc.collect()
    dev.reset_peak_memory(device)
    if device.type == "cpu":
        dev.reset_process_peak()


def peak_memory(device: torch.device) -> tuple[int | None, str]:
    if device.type == "cuda":
        return dev.peak_memory_bytes(device), "CUDA allocator peak"
    return dev.process_peak_rss_bytes(), "process peak RSS"


def _cpu_sdpa_flop(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query, key, value)


def _cpu_sdpa_backward_flop(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)


# torch 2.13's FlopCounterMode knows the GPU attention kernels but not the CPU one: without
# these, attention (about a third of this model's FLOPs) would count as zero on CPU.
# torch's own GPU formulas are reused, so both devices count alike.
CPU_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flop,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flop,
}


def flops_per_sample(cfg: Config, batch: int, device: torch.device) -> float:
    """Forward + backward FLOPs of the model per sample (eager, fp32: FLOPs do not depend on dtype)."""
    torch.manual_seed(0)
    model = build(cfg.model).to(device)
    h, w = cfg.model.img_size
    inp = torch.randn(batch, cfg.model.n_in_channels, h, w, device=device)
    tar = torch.randn(batch, cfg.model.n_out_channels, h, w, device=device)
    counter = flop_counter.FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS)
    with counter:
        relative_l2_loss(model(inp), tar).backward()
    return counter.get_total_flops() / batch


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int, reps: int = 5,
                budget_s: float = 1.0) -> float:
    """Best FLOP/s of square matmuls (n/8 to 2n) in ``dtype`` on this device. A size whose first
    call takes over ``budget_s`` ends the climb: on a CPU without bf16 arithmetic one bf16
    matmul of 4096 took minutes (0.26 GFLOP/s on an AVX2-only AMD EPYC)."""
    best = 0.0
    for size in (n // 8, n // 4, n // 2, n, 2 * n):
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        dev.synchronize(device)
        t0 = time.perf_counter()
        torch.mm(a, b)  # warm-up: library initialisation, kernel choice
        dev.synchronize(device)
        first = time.perf_counter() - t0
        if first > budget_s:
            best = max(best, 2.0 * size**3 / first)
            break
        for _ in range(reps):
            dev.synchronize(device)
            t0 = time.perf_counter()
            torch.mm(a, b)
            dev.synchronize(device)
            best = max(best, 2.0 * size**3 / (time.perf_counter() - t0))
    return best


def measure_peaks(device: torch.device, amp: str, n: int) -> dict[str, float]:
    """Matmul peak of fp32 ('none') and ``amp`` under the matmul settings the trainer uses.

    The Trainer turns TF32 on for fp32 matmuls on CUDA (utils.device.configure_matmul); a
    peak measured before that, in true fp32, is several times lower on Ampere and newer
    and would overstate fp32 MFU as much.
    """
    dev.configure_matmul(device)
    return {mode: matmul_peak(device, DTYPES[mode], n) for mode in ("none", amp)}


def linear_shapes(cfg: Config, batch: int,
                  device: torch.device | None = None) -> dict[tuple[int, int, int], int]:
    """Every distinct (M, K, N) of the model's linear layers at this batch (M rows: the batch's
    tokens; K input features; N output features) and how many layers have it. Read from one
    forward of one sample on ``device`` (a layer's rows grow with the batch); a forward on the
    meta device would need no arithmetic, but its attention imports sympy: seconds."""
    device = device or torch.device("cpu")
    model = build(cfg).to(device)
    h, w = cfg.model.img_size
    shapes: dict[tuple[int, int, int], int] = {}

    def note(layer: torch.nn.Linear, args: tuple[torch.Tensor, ...]) -> None:
        shape = (batch * args[0].numel() // layer.in_features, layer.in_features, layer.out_features)
        shapes[shape] = shapes.get(shape, 0) + 1

    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear):
            layer.register_forward_pre_hook(note)
    with torch.no_grad():
        model(torch.zeros(1, cfg.model.n_in_channels, h, w, device=device))
    return shapes


def fastest_call(fn: Callable[[], Any], device: torch.device, seconds: float, least: int = 3) -> float:
    """Seconds of the fastest of single calls of ``fn`` over about ``seconds`` (at least ``least``
    calls, after one to warm up): a peak, taken as matmul_peak takes it; on a busy machine the
    fastest call is the one that other processes did not slow down."""
    fn()
    dev.synchronize(device)
    best, start, calls = float("inf"), time.perf_counter(), 0
    while calls < least or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        fn()
        dev.synchronize(device)
        best = min(best, time.perf_counter() - t0)
        calls += 1
    return best


def shape_peak(shapes: dict[tuple[int, int, int], int], device: torch.device, dtype: torch.dtype,
               seconds: float = 0.25) -> dict[str, Any]:
    """The FLOP/s of the model's own linear layers on this device: each distinct shape's three
    products (forward and the two of backward, as scripts/cost_measure.py:layer_products runs a
    layer), the fastest call in ``dtype``; their FLOPs over their seconds, each shape weighted
    by the layers that have it, as a step runs them. The ceiling for this model here: a step
    that ran at its linear layers' speed and did nothing else."""
    from scripts.cost_measure import layer_products

    rows, flops, seconds_total = [], 0, 0.0
    for (m, k, n), layers in sorted(shapes.items()):
        products, shape_flops = layer_products(m, k, n, dtype, device)
        t = fastest_call(products, device, seconds)
        rows.append({"m": m, "k": k, "n": n, "layers": layers, "flops": shape_flops, "seconds": t,
                     "flops_per_sec": shape_flops / t})
        flops += layers * shape_flops
        seconds_total += layers * t
    return {"flops_per_sec": flops / seconds_total, "shapes": rows}


def measure_shape_peaks(cfg: Config, batch: int, device: torch.device, amp: str,
                        seconds: float = 0.25) -> dict[str, dict[str, Any]]:
    """shape_peak of fp32 ('none') and ``amp`` under the trainer's matmul settings."""
    dev.configure_matmul(device)
    shapes = linear_shapes(cfg, batch, device)
    return {mode: shape_peak(shapes, device, DTYPES[mode], seconds) for mode in ("none", amp)}


def dali_available() -> bool:
    from utils.data_loader import DataError
    from utils.data_loader_dali import import_dali

    try:
        import_dali()
    except DataError:
        return False
    return True


LOADER_REPEATS = 9  # alternating loader / raw passes of the loader-alone measurement


def loader_alone(trainer: Trainer, batches: int, repeats: int = LOADER_REPEATS) -> dict[str, Any]:
    """Samples/s of the rung's training loader with no model, and of h5py reading the same
    samples in a plain loop (after one warm-up batch of the loader and one pass of the loop).

    The two alternate ``repeats`` times, each loader pass followed by a raw pass over the
    samples it gave; the medians are reported, and the median of the passes' ratios (a pass
    and its raw pass see the same machine load, so their ratio scatters less than either).
    """
    data = trainer.build_data("train", train=True)
    it = epochs(data)
    next(it)  # warm-up: workers, pipeline start, page cache
    raw = RawReads(trainer.cfg)
    order = _sample_indices(trainer.cfg, trainer.local_batch, batches * repeats * trainer.local_batch)
    loader_rates, raw_rates = [], []
    for k in range(repeats):
        t0 = time.perf_counter()
        n = 0
        for _ in range(batches):
            batch = next(it)
            n += batch[0].shape[0]
            data.give_back(*batch)  # as the training loop does after its step
        del batch
        loader_rates.append(n / (time.perf_counter() - t0))
        raw_rates.append(raw.rate(order[k * n : (k + 1) * n]))
    it.close()
    if hasattr(data, "close"):
        data.close()
    raw.close()
    ratios = [a / b for a, b in zip(loader_rates, raw_rates)]
    return {"samples_per_sec": statistics.median(loader_rates),
            "raw_h5py_samples_per_sec": statistics.median(raw_rates),
            "raw_h5py_MB_per_sec": statistics.median(raw_rates) * raw.sample_bytes / 1e6,
            "ratio_to_raw": statistics.median(ratios), "ratios": ratios}


def epochs(data):
    """Batches of epoch 0, 1, ... without end (a small data set may hold few batches)."""
    epoch = 0
    while True:
        data.set_epoch(epoch)
        yield from data
        epoch += 1


def _sample_indices(cfg: Config, batch: int, n: int) -> list[int]:
    """The samples the loader gives after its warm-up batch, in the same epochs."""
    from utils.data_loader import get_data_loader

    _, _, sampler = get_data_loader(cfg, "train", batch, True)
    order: list[int] = []
    epoch = 0
    while len(order) < batch + n:
        sampler.set_epoch(epoch)
        order += sampler.epoch_order()
        epoch += 1
    return order[batch : batch + n]


class RawReads:
    """The reference: (fields[t], fields[t + dt]) read with h5py slicing, nothing else."""

    def __init__(self, cfg: Config) -> None:
        from utils.data_loader import ERA5Dataset

        self.cfg = cfg
        self.dataset = ERA5Dataset(cfg, "train", cfg.data.limit_nsamples)
        self.files = [h5py.File(f.path, "r")["fields"] for f in self.dataset.files]
        h, w = cfg.model.img_size
        self.sample_bytes = 2 * self.files[0].dtype.itemsize * cfg.model.n_in_channels * h * w
        self._warm = False

    def read(self, indices: list[int]) -> None:
        h, w = self.cfg.model.img_size
        for index in indices:
            file_no, t = self.dataset.locate(index)
            fields = self.files[file_no]
            inp = fields[t, :, :h, :w]  # noqa: F841 (kept until the next pair, as a loop would)
            tar = fields[t + self.cfg.data.dt, :, :h, :w]  # noqa: F841

    def rate(self, indices: list[int]) -> float:
        """Samples/s of reading ``indices`` (the first call reads them once untimed first)."""
        if not self._warm:
            self.read(indices)  # warm-up, as for the loader
            self._warm = True
        t0 = time.perf_counter()
        self.read(indices)
        return len(indices) / (time.perf_counter() - t0)

    def close(self) -> None:
        for f in self.files:
            f.file.close()


# -------------------------------------------------------------------- rungs ---
@dataclass
class Options:
    steps: int
    warmup: int
    profile_steps: int
    loader_batches: int
    out_dir: Path
    device: torch.device
    results: list[dict[str, Any]] = field(default_factory=list)


def rung_configs(base: Config, names: list[str], workers: int, amp: str,
                 cuda: bool, dali: bool = True) -> list[tuple[str, Config]]:
    """The config of each rung in ``names``. Without ``dali`` the +DALI rung is left out and the
    rungs after it keep the PyTorch DataLoader."""
    out, settings = [], {}
    for name, change in RUNGS:
        if name == "+DALI" and not dali:
            continue
        for key, value in change.items():
            settings[key] = {"num_data_workers": workers, "amp_mode": amp}[key] if value is None else value
        if name == "+graphs" and not cuda:
            continue
        if name in names:
            out.append((name, with_overrides(base, **settings)))
    return out


def step_class(name: str) -> type[EagerStep]:
    if name != "+graphs":
        return EagerStep
    from training.graphs import GraphStep

    return GraphStep


def run_rung(name: str, cfg: Config, opts: Options, batch: int, flops: float,
             peaks: dict[str, float], loader_cache: dict,
             shape_peaks: dict[str, float] | None = None) -> dict[str, Any]:
    """Train one rung and measure it; a rung whose training loss is not finite comes back as
    ``failed`` (the step and the loss), with no time, rate or MFU."""
    if name == "+graphs":  # its eager warm-up steps, then the capture, come before the timed steps
        from training.graphs import EAGER_WARMUP_STEPS

        opts = replace(opts, warmup=max(opts.warmup, EAGER_WARMUP_STEPS + 1))
    total = opts.warmup + opts.steps + opts.profile_steps
    cfg = with_overrides(cfg, num_iters=total, warmup=0, checkpoint_every=0)
    reset_peak_memory(opts.device)
    run_dir = Path(tempfile.mkdtemp(prefix="rung-", dir=opts.out_dir))
    clock = phase_clock(opts.device)
    timed = RungClock(opts.device, opts.warmup, opts.warmup + opts.steps, clock)
    trainer = Trainer(cfg, RunContext(device=opts.device, run_dir=run_dir), batch, step=step_class(name),
                      callbacks=[timed])
    t0 = time.perf_counter()
    timed.begin()
    settings = {k: getattr(cfg, k) for k in ("data_loader_config", "num_data_workers", "amp_mode",
                                             "enable_fused", "enable_jit")}
    try:
        for _ in trainer.run_steps(total):
            pass
        dev.synchronize(opts.device)
        timed.raise_if_not_finite()
    except NonFiniteLossError as err:
        close_rung(trainer, run_dir)
        return {"name": name, "settings": settings, "failed": str(err), "failed_step": err.step,
                "failed_loss": err.loss, "steps_run": timed.count,
                "attention_kernel": trainer.attention_kernel}
    finally:
        clock.stop()
    elapsed = timed.t_end - timed.t_start
    step_ms = 1000.0 * elapsed / opts.steps
    breakdown = {"data_wait": 1000.0 * timed.wait / opts.steps, **clock.ms_per_step(opts.profile_steps)}
    breakdown["other"] = step_ms - sum(breakdown.values())
    mem, mem_kind = peak_memory(opts.device)
    samples_per_sec = opts.steps * batch / elapsed
    loader_key = (cfg.data.data_loader_config, cfg.data.num_data_workers)
    if loader_key not in loader_cache:
        loader_cache[loader_key] = loader_alone(trainer, opts.loader_batches)
    close_rung(trainer, run_dir)
    return {
        "name": name,
        "settings": settings,
        "samples_per_sec": samples_per_sec,
        "step_ms": step_ms,
        "warmup_seconds": timed.t_start - t0,  # includes compilation on the +compile rungs
        "breakdown_ms": breakdown,
        "peak_memory_bytes": mem,
        "memory_kind": mem_kind,
        "mfu": flops * samples_per_sec / peaks[cfg.optim.amp_mode],
        **({"mfu_shapes": flops * samples_per_sec / shape_peaks[cfg.optim.amp_mode]} if shape_peaks else {}),
        "loader": loader_cache[loader_key],
        "attention_kernel": trainer.attention_kernel,
        "mean_train_loss": float(trainer.epoch_loss.item() / max(1, trainer.epoch_steps)),
    }


def close_rung(trainer: Trainer, run_dir: Path) -> None:
    """The rung's loader stopped, its run folder removed: nothing of a rung is kept."""
    close = getattr(trainer.train_data, "close", None)
    if close:
        close()
    shutil.rmtree(run_dir, ignore_errors=True)


def attention_table(cfg: Config, batch: int, device: torch.device, amp: str) -> list[dict[str, Any]]:
    """Forward and backward of one attention call of the model (the whole batch) per kernel
    and dtype, and which kernel ``attention_kernel: auto`` takes for that dtype."""
    shape, kv_len = attention.call_shape(cfg.model, batch)
    rows = []
    for mode in ("none", amp):
        chosen = attention.choose("auto", device, DTYPES[mode], kv_len)
        for name, (fwd, bwd) in attention.time_kernels(shape, kv_len, DTYPES[mode], device).items():
            rows.append({"dtype": "fp32" if mode == "none" else mode, "kernel": name,
                         "forward_ms": 1e3 * fwd, "backward_ms": 1e3 * bwd, "chosen": name == chosen})
    return rows


BareKey = tuple[str, bool, bool]  # (amp_mode, enable_fused, enable_jit): what the bare loop varies


def bare_key(cfg: Config) -> BareKey:
    return cfg.optim.amp_mode, cfg.optim.enable_fused, cfg.optim.enable_jit


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of one rung, each followed by its bare loop (so that load from other processes hits
    both alike) -> the rung's result: the round of median samples/s (the lower of the two middle
    ones for an even count), with the bare loop's median rate and ``vs_bare`` the median of the
    rounds' own ratios; every round's rates under ``rounds``."""
    if len(rounds) == 1:
        return rounds[0]
    rung = dict(sorted(rounds, key=lambda r: r["samples_per_sec"])[(len(rounds) - 1) // 2])
    keys = ("samples_per_sec", "bare_samples_per_sec", "vs_bare")
    rung["rounds"] = [{k: r[k] for k in keys if k in r} for r in rounds]
    if all("vs_bare" in r for r in rounds):
        rung["bare_samples_per_sec"] = statistics.median(r["bare_samples_per_sec"] for r in rounds)
        rung["vs_bare"] = statistics.median(r["vs_bare"] for r in rounds)
    return rung


def bare_step(cfg: Config, batch: int, device: torch.device, amp: str, fused: bool,
              jit: bool) -> tuple[Callable[[], torch.Tensor], str]:
    """The bare loop's step (it returns the loss), over the same model and one batch held in
    memory, and the attention kernel it runs: the one the trainer chooses for these settings
    (utils/attention.py)."""
    torch.manual_seed(cfg.run.seed)
    model = build(cfg.model).to(device)
    # the Trainer's Adam kernel (fused, else foreach), so the reference differs from it only in
    # what surrounds the step
    opt = torch.optim.Adam(model.parameters(), lr=cfg.optim.lr, betas=cfg.optim.adam_betas,
                           **dev.adam_kernel(fused))
    forward = torch.compile(model) if jit else model
    loss_fn = torch.compile(relative_l2_loss) if jit else relative_l2_loss
    h, w = cfg.model.img_size
    inp = torch.randn(batch, cfg.model.n_in_channels, h, w, device=device)
    tar = torch.randn(batch, cfg.model.n_out_channels, h, w, device=device)
    _, kv_len = attention.call_shape(cfg.model, batch)
    kernel = attention.choose(cfg.optim.attention_kernel, device, DTYPES[amp], kv_len)

    def step() -> torch.Tensor:
        with dev.autocast(device, amp), attention.kernel(kernel):
            pred = forward(inp)
        loss = loss_fn(pred.float(), tar)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, kernel


def bare_loop(cfg: Config, batch: int, opts: Options, flops: float, peaks: dict[str, float],
              amp: str, fused: bool, jit: bool) -> dict[str, Any]:
    """The reference: the same model and one batch from memory, nothing around the step."""
    device = opts.device
    step, kernel = bare_step(cfg, batch, device, amp, fused, jit)
    for _ in range(opts.warmup):
        step()
    dev.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(opts.steps):
        loss = step()
    dev.synchronize(device)
    rate = opts.steps * batch / (time.perf_counter() - t0)
    finite = bool(torch.isfinite(loss))  # after the clock: one host sync
    return {"name": f"bare loop ({amp}{', fused' if fused else ''}{', compile' if jit else ''})",
            "settings": {"amp_mode": amp, "enable_fused": fused, "enable_jit": jit},
            "attention_kernel": kernel, "samples_per_sec": rate, "mfu": flops * rate / peaks[amp],
            **({} if finite else {"failed": f"training loss is {float(loss)} at its last step"})}


# ------------------------------------------------------------------- output ---
def markdown(report: dict[str, Any]) -> str:
    gflops = lambda peaks: ", ".join(f"{k} {v / 1e9:.0f}" for k, v in peaks.items())  # noqa: E731
    rounds = report["rounds"]
    alternated = f", {rounds} rounds of each rung and its bare loop alternated (medians)" * (rounds > 1)
    lines = [f"Config `{report['config']}`, batch {report['batch']}, {report['steps']} timed steps "
             f"after {report['warmup']} warm-up{alternated}; {report['device_name']}, "
             f"torch {report['torch']} "
             f"(1-minute load average at the end: {report['load_average_1min_at_end']:.1f}).",
             f"Model: {report['flops_per_sample'] / 1e9:.2f} GFLOP per sample (forward + backward, "
             f"FlopCounterMode). Matmul peak measured here, GFLOP/s: one large square matmul "
             f"{gflops(report['matmul_peak_flops'])}; the model's own linear layers (shape peak, "
             f"below) {gflops(report['shape_peak_flops'])}. MFU is against the large matmul's peak, "
             f"MFU (shapes) against the shape peak: the most this model can reach here."]
    if report["device"].startswith("cuda"):
        lines.append("On CUDA, forward, backward and optimizer are GPU time between CUDA events at the "
                     "trainer's range edges, and the fp32 peak is measured with TF32 on, as the trainer "
                     "runs fp32 matmuls; +graphs replays its whole step as one graph (its time shows "
                     "under forward).")
    lines += ["",
              "| rung | samples/s | bare loop | vs bare | step ms | data wait | forward | backward "
              "| optimizer | peak mem MB | MFU | MFU (shapes) | attention | loader alone / raw h5py "
              "| warm-up s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [rung_row(r) for r in report["rungs"]]
    if report["failed"]:
        lines += ["", "A rung whose training loss is not finite does not train: it is stopped (at the end "
                      "of its warm-up, or of its steps), not timed, and left out of the best rung."]
    lines += shape_table(report)
    if report.get("attention"):
        shape = report["attention_shape"]
        lines += ["", f"One attention call of the model, queries and keys {shape} (batch, heads, "
                      "tokens, head dim), median of 3; `default` is torch's own pick, **bold** the "
                      "kernel `attention_kernel: auto` takes:", "",
                  "| dtype | kernel | forward ms | backward ms | total ms |", "|---|---|---|---|---|"]
        for a in report["attention"]:
            name = f"**{a['kernel']}**" if a["chosen"] else a["kernel"]
            lines.append(f"| {a['dtype']} | {name} | {a['forward_ms']:.2f} | {a['backward_ms']:.2f} "
                         f"| {a['forward_ms'] + a['backward_ms']:.2f} |")
    if any(max(r.get("mfu", 0), r.get("mfu_shapes", 0)) > 1 for r in report["rungs"]):
        lines += ["", "(\\*) above 100 %: the model's matmuls ran faster than the matmuls that "
                      "measured the peak. On a CPU without arithmetic for the dtype (bf16 on AVX2) "
                      "torch computes it in generic code whose speed depends on the shape: no peak "
                      "holds, so MFU means nothing there."]
    best = report.get("best")
    if best:
        lines += ["", f"Best rung: {best['name']}, {best['samples_per_sec_vs_bare']:.0%} of the bare loop "
                      f"with the same settings; MFU {mfu_text(best['mfu'])} of the measured "
                      f"{best['dtype']} matmul peak, {mfu_text(best['mfu_shapes'])} of its shape peak; "
                      f"its loader alone reaches {best['loader_ratio_to_raw']:.0%} of the raw h5py read."]
    return "\n".join(lines) + "\n"


def rung_row(r: dict[str, Any]) -> str:
    """One rung's row of the table; a failed rung says why, with no numbers."""
    if "failed" in r:
        return (f"| {r['name']} | **failed**: {r['failed']}, not timed |" + " - |" * 10
                + f" {r['attention_kernel']} | - | - |")
    b = r["breakdown_ms"]
    mem = f"{r['peak_memory_bytes'] / 2**20:.0f}" if r["peak_memory_bytes"] else "n/a"
    ld = r["loader"]
    if "graph replay" in b:
        phases = f"replay {b['graph replay']:.0f} | - | -"
    else:
        phases = " | ".join(f"{b.get(k, float('nan')):.0f}" for k in ("forward", "backward", "optimizer"))
    vs_bare = f"{r['bare_samples_per_sec']:.2f} | {r['vs_bare']:.2f}x" if "vs_bare" in r else "- | -"
    return (f"| {r['name']} | {r['samples_per_sec']:.2f} | {vs_bare} | {r['step_ms']:.0f} "
            f"| {b['data_wait']:.0f} | {phases} | {mem} | {mfu_text(r['mfu'])} | {mfu_text(r['mfu_shapes'])} "
            f"| {r['attention_kernel']} | {ld['samples_per_sec']:.0f} / {ld['raw_h5py_samples_per_sec']:.0f} "
            f"({100 * ld['ratio_to_raw']:.0f}%) | {r['warmup_seconds']:.1f} |")


def shape_table(report: dict[str, Any]) -> list[str]:
    """GFLOP/s of each of the model's linear-layer shapes per dtype (forward and backward's two
    products together), and what they make for the whole model."""
    dtypes = list(report["shape_peak"])
    lines = ["", "The model's linear layers at this batch (M rows, K in, N out features), their "
                 "three products (forward, the input's and the weight's gradients) timed per dtype, "
                 "GFLOP/s:", "",
             "| M x K x N | layers | " + " | ".join(dtypes) + " |", "|---|---|" + "---|" * len(dtypes)]
    for i, row in enumerate(report["shape_peak"][dtypes[0]]):
        rates = " | ".join(f"{report['shape_peak'][d][i]['flops_per_sec'] / 1e9:.0f}" for d in dtypes)
        lines.append(f"| {row['m']} x {row['k']} x {row['n']} | {row['layers']} | {rates} |")
    lines.append("| the model (shape peak) | | " + " | ".join(
        f"{report['shape_peak_flops'][d] / 1e9:.0f}" for d in dtypes) + " |")
    return lines


def mfu_text(mfu: float) -> str:
    return f"{100 * mfu:.1f}%" if mfu <= 1 else "(\\*)"


def ensure_data(cfg: Config, samples: int) -> None:
    """Generate synthetic data of the config's grid when its data directory is missing."""
    if cfg.data_path.exists():
        return
    from utils.synthetic_era5 import generate

    print(f"generating {samples} samples per split of synthetic data in {cfg.data_path}", file=sys.stderr)
    generate(cfg.data_path, cfg.model.img_size, samples, {"train": [2016], "valid": [2017], "test": [2018]},
             seed=0)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--yaml_config", default=str(DEFAULT_YAML))
    p.add_argument("--config", default="small")
    p.add_argument("--data_dir", help="override the config's data_dir")
    p.add_argument("--steps", type=int, default=10, help="timed steps per rung")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--profile_steps", type=int, default=2,
                   help="extra steps for the forward/backward/optimizer breakdown (torch.profiler "
                   "on CPU, CUDA events on a GPU)")
    p.add_argument("--loader_batches", type=int, default=8,
                   help=f"batches per pass of the loader-alone measurement ({LOADER_REPEATS} passes, "
                   "each followed by a plain h5py read of its samples)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader / DALI workers from +workers on")
    p.add_argument("--amp", choices=("bf16", "fp16"), default="bf16", help="dtype of the +AMP rung")
    p.add_argument("--rungs", default=",".join(RUNG_NAMES), help="comma-separated subset of: "
                   + ", ".join(RUNG_NAMES))
    p.add_argument("--no_bare", action="store_true", help="skip the bare-loop reference")
    p.add_argument("--rounds", type=int, default=1,
                   help="train each rung this many times, each followed by its bare loop; report the "
                   "median (on a shared machine, so that other processes' load hits both alike)")
    p.add_argument("--batch", type=int, help="global batch (default: the config's); smaller for a "
                                             "quick look on a slow machine")
    p.add_argument("--attention_kernel", choices=ATTENTION_KERNELS,
                   help="attention kernel of every rung and bare loop (default: the config's, auto)")
    p.add_argument("--matmul_size", type=int, default=2048,
                   help="matmul peak: best of square matmuls of n/8 to 2n")
    p.add_argument("--shape_seconds", type=float, default=0.25,
                   help="about how long each of the model's matmul shapes is timed per dtype "
                   "(the shape peak)")
    p.add_argument("--out_dir", type=Path, default=Path("logs/benchmark"))
    return p.parse_args(argv)


def checked_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str], Config]:
    """The command line, its rungs and the base config; a user mistake is one line."""
    args = parse_args(argv)
    names = [n.strip() for n in args.rungs.split(",") if n.strip()]
    unknown = set(names) - set(RUNG_NAMES)
    if unknown:
        raise SystemExit(f"error: unknown rung(s) {', '.join(sorted(unknown))}; "
                         f"choose from {', '.join(RUNG_NAMES)}")
    if min(args.steps, args.profile_steps, args.loader_batches, args.rounds) < 1:
        raise SystemExit("error: --steps, --profile_steps, --loader_batches and --rounds must be at least 1")
    if min(args.warmup, args.workers) < 0 or args.matmul_size < 2:
        raise SystemExit("error: --warmup and --workers must be at least 0, --matmul_size at least 2")
    if not args.shape_seconds > 0:
        raise SystemExit("error: --shape_seconds must be above 0")
    if "+graphs" in names and args.amp == "fp16" and dev.cuda_available():
        raise SystemExit("error: the +graphs rung needs --amp bf16 (train_graph.py cannot capture "
                         "fp16's GradScaler); drop +graphs from --rungs or use --amp bf16")
    try:
        base = load_config(args.yaml_config, args.config)
        if args.data_dir:
            base = with_overrides(base, data_dir=args.data_dir)
        if args.batch is not None:
            base = with_overrides(base, global_batch_size=args.batch)
        if args.attention_kernel is not None:
            base = with_overrides(base, attention_kernel=args.attention_kernel)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    return args, names, base


def climb(configs: list[tuple[str, Config]], base: Config, args: argparse.Namespace, opts: Options,
          flops: float, peaks: dict, ceilings: dict) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each rung (``--rounds`` times, each followed by its bare loop; the medians): rungs, bare loops."""
    rungs, bare, loader_cache = [], [], {}
    started = time.perf_counter()
    for i, (name, cfg) in enumerate(configs):
        print(f"rung {i + 1}/{len(configs)} {name} ...", file=sys.stderr, flush=True)
        rounds = []
        for _ in range(args.rounds):
            rung = run_rung(name, cfg, opts, base.optim.global_batch_size, flops, peaks, loader_cache,
                            ceilings)
            if "failed" in rung:  # it does not train: nothing to compare, nothing to repeat
                break
            # right after the rung: the same state of the process and machine
            if not args.no_bare:
                bare.append(bare_loop(base, base.optim.global_batch_size, opts, flops, peaks, *bare_key(cfg)))
                if "failed" not in bare[-1]:
                    rung["bare_samples_per_sec"] = bare[-1]["samples_per_sec"]
                    rung["vs_bare"] = rung["samples_per_sec"] / bare[-1]["samples_per_sec"]
            rounds.append(rung)
        rung = rung if "failed" in rung else median_round(rounds)
        rungs.append(rung)
        pace, remaining = (time.perf_counter() - started) / (i + 1), configs[i + 1 :]
        left = f", about {pace * len(remaining):.0f} s left at this pace" if remaining else ""
        if any(c.enable_jit for _, c in remaining):
            left += " (the +compile rungs take longer)"
        result = (f"FAILED: {rung['failed']}, not timed" if "failed" in rung
                  else f"{rung['samples_per_sec']:.2f} samples/s")
        print(f"  {result}{left}", file=sys.stderr, flush=True)
    return rungs, bare


def best_rung(rungs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fastest rung that trained and was compared with its bare loop."""
    trained = [r for r in rungs if "vs_bare" in r]
    if not trained:
        return None
    best = max(trained, key=lambda r: r["samples_per_sec"])
    return {"name": best["name"], "samples_per_sec": best["samples_per_sec"],
            "samples_per_sec_vs_bare": best["vs_bare"], "mfu": best["mfu"], "mfu_shapes": best["mfu_shapes"],
            "dtype": dtype_name(best["settings"]["amp_mode"]),
            "loader_ratio_to_raw": best["loader"]["ratio_to_raw"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args, names, base = checked_args(argv)
    batch = base.optim.global_batch_size
    total = args.warmup + args.steps + args.profile_steps
    ensure_data(base, max(256, (total + args.loader_batches + 2) * batch))
    dev.set_cpu_threads(1)
    device = dev.pick_device(0)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    opts = Options(args.steps, args.warmup, args.profile_steps, args.loader_batches, args.out_dir, device)

    flops = flops_per_sample(base, batch, device)
    peaks = measure_peaks(device, args.amp, args.matmul_size)
    shape_peaks = measure_shape_peaks(base, batch, device, args.amp, args.shape_seconds)
    ceilings = {mode: p["flops_per_sec"] for mode, p in shape_peaks.items()}
    kernels = attention_table(base, batch, device, args.amp)
    if "+graphs" in names and device.type != "cuda":
        print("skipping +graphs: CUDA Graphs need a GPU", file=sys.stderr)
    # every rung from +DALI on reads through DALI, whether +DALI itself is asked for or not
    dali = not any(RUNG_NAMES.index(n) >= RUNG_NAMES.index("+DALI") for n in names) or dali_available()
    if not dali:
        print("skipping +DALI: NVIDIA DALI is not installed; the later rungs keep the PyTorch "
              "DataLoader", file=sys.stderr)
    configs = list(rung_configs(base, names, args.workers, args.amp, device.type == "cuda", dali))
    rungs, bare = climb(configs, base, args, opts, flops, peaks, ceilings)
    report: dict[str, Any] = {
        "config": args.config, "batch": batch, "steps": args.steps, "warmup": args.warmup,
        "rounds": args.rounds,
        "device": str(device), "device_name": device_name(device), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "flops_per_sample": flops,
        "load_average_1min_at_end": os.getloadavg()[0],  # other work on the machine skews everything
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "matmul_peak_flops": {dtype_name(k): v for k, v in peaks.items()},
        "shape_peak_flops": {dtype_name(k): v for k, v in ceilings.items()},
        "shape_peak": {dtype_name(k): v["shapes"] for k, v in shape_peaks.items()},
        "failed": [{"name": r["name"], "step": r["failed_step"], "loss": r["failed_loss"]}
                   for r in rungs if "failed" in r],
        "attention": kernels, "attention_shape": list(attention.call_shape(base.model, batch)[0]),
        "rungs": rungs, "bare": bare,
    }
    best = best_rung(rungs)
    if best is not None:
        report["best"] = best
    write_report(args.out_dir, "benchmark", markdown(report), report)
    print(markdown(report))
    return report


def device_name(device: torch.device) -> str:
    """The GPU's name; or the CPU's model and widest matrix instructions (AVX2, AVX-512,
    AVX-512 BF16, AMX: what decides its bf16 speed) and the kernels torch's CPU code uses."""
    if device.type == "cuda":
        return f"GPU {dev.gpu_facts(device.index or 0)['name']}"
    return (f"CPU {dev.cpu_description()}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}, "
            f"{os.cpu_count()} cores, {torch.get_num_threads()} threads")


def dtype_name(amp_mode: str) -> str:
    return "fp32" if amp_mode == "none" else amp_mode


if __name__ == "__main__":
    main()
