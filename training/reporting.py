"""What a run reports after every epoch: the log lines, TensorBoard scalars, metrics.jsonl, memory.

The log lines and TensorBoard tags are the original tutorial's, so its notebook and
its habits carry over.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from distributed.shards import local, local_optimizer
from utils import device as dev

if TYPE_CHECKING:  # imported where a writer is opened (rank 0 only): 0.15 s of every other rank's start
    from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger(__name__)

LOGGED_CHANNELS = ("u10m", "t2m")  # RMSE of these goes to TensorBoard (of another data set: its first)
SHOWN_CHANNEL = "t2m"  # the channel of the prediction image (of another data set: its first)
MIB = 2**20
# colour stops (RGB in [0, 1]) of matplotlib's viridis, for fields, and of RdBu reversed, for errors
FIELD_STOPS = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]]) / 255
ERROR_STOPS = np.array([[33, 102, 172], [247, 247, 247], [178, 24, 43]]) / 255


def colour(x: np.ndarray, lo: float, hi: float, stops: np.ndarray) -> np.ndarray:
    """(H, W) values -> (H, W, 3) colours, linear between the stops from ``lo`` to ``hi``."""
    t = np.clip((x - lo) / max(hi - lo, 1e-12), 0.0, 1.0) * (len(stops) - 1)
    i = np.minimum(t.astype(int), len(stops) - 2)
    f = (t - i)[..., None]
    return stops[i] * (1 - f) + stops[i + 1] * f


def prediction_image(pred: torch.Tensor, target: torch.Tensor, c: int) -> np.ndarray:
    """Channel ``c``'s target | prediction | prediction - target, side by side with a white gap, as a
    (3, H, 3 W + 2) image in [0, 1] for TensorBoard: the fields on one scale, the error on a
    diverging scale centred on 0. Drawn with numpy, not matplotlib, whose import and figure cost
    about 0.8 s of every run's start; scripts/plot_prediction.py draws the labelled figure."""
    t, p = target[c].float().numpy(), pred[c].float().numpy()
    lo, hi = min(t.min(), p.min()), max(t.max(), p.max())
    err = float(np.abs(p - t).max())
    gap = np.ones((t.shape[0], 1, 3))
    panels = [colour(t, lo, hi, FIELD_STOPS), gap, colour(p, lo, hi, FIELD_STOPS), gap,
              colour(p - t, -err, err, ERROR_STOPS)]
    return np.concatenate(panels, axis=1).transpose(2, 0, 1)


def log_epoch(writer: SummaryWriter | None, run_dir: Path, epoch: int, step: int, seconds: float,
              samples: int, steps: int, train_loss: float, val: dict[str, Any], val_seconds: float,
              lr: float, memory: dict[str, float] | None = None,
              grad_norms: list[float] | None = None, extra: dict[str, Any] | None = None) -> None:
    """Log one epoch (every rank's logger; rank 0 alone has a ``writer`` and writes files).
    ``grad_norms``: the gradient norm before clipping of each of the epoch's steps, when clipping;
    ``extra``: more keys for the metrics record (the first record's ``build_peak_MiB``, DDP's
    ``grad_comm_bytes_per_step``)."""
    rate = samples / seconds if seconds > 0 else float("nan")
    log.info("Time taken for epoch %d is %.2f sec, avg %.2f samples/sec", epoch + 1, seconds, rate)
    log.info("  Avg train loss=%.6f", train_loss)
    log.info("  Avg val loss=%.6f", val["loss"])
    log.info("  Total validation time: %.2f sec", val_seconds)
    if writer is None:
        return
    writer.add_scalar("Loss/train", train_loss, step)
    writer.add_scalar("Loss/valid", val["loss"], step)
    names = list(val["rmse"])
    for ch in [c for c in LOGGED_CHANNELS if c in names] or names[:1]:
        if ch in val["rmse"]:
            writer.add_scalar(f"RMSE({ch})/valid", val["rmse"][ch], step)
            writer.add_scalar(f"RMSE({ch})/persistence", val["persistence"][ch], step)
    writer.add_scalar("Learning Rate", lr, step)
    for i, norm in enumerate(grad_norms or []):  # one point per step, at the step it was taken
        writer.add_scalar("Gradient norm/before clipping", norm, step - len(grad_norms) + i + 1)
    writer.add_scalar("Avg iters per sec", steps / seconds if seconds > 0 else 0.0, step)
    writer.add_scalar("Avg samples per sec", rate, step)
    if "grad_comm_bytes_per_step" in (extra or {}):
        writer.add_scalar("Communication/gradient MB per step", extra["grad_comm_bytes_per_step"] / 1e6, step)
    shown = SHOWN_CHANNEL if SHOWN_CHANNEL in names else names[0]
    if val["example"] is not None:
        writer.add_image(f"Predictions/{shown}", prediction_image(*val["example"], names.index(shown)), step)
    writer.flush()
    record = {"epoch": epoch + 1, "step": step, "train_loss": train_loss, "val_loss": val["loss"],
              "samples_per_sec": rate, "epoch_seconds": seconds,
              "rmse": val["rmse"], "persistence": val["persistence"], "memory_MiB": memory or {}}
    record.update(extra or {})
    if grad_norms:
        record["grad_norm_mean"] = sum(grad_norms) / len(grad_norms)
        record["grad_norm_max"] = max(grad_norms)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds now in parameters, gradients (those that exist) and optimizer state
    (FSDP: its shards; ZeRO-1: its share)."""
    def size(t: torch.Tensor) -> int:
        t = local(t)
        return t.numel() * t.element_size()

    params = list(model.parameters())
    state = local_optimizer(optimizer).state
    return {"parameters": sum(size(p) for p in params),
            "gradients": sum(size(p.grad) for p in params if p.grad is not None),
            "optimizer_state": sum(size(v) for s in state.values() for v in s.values() if torch.is_tensor(v))}


def host_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> dict[str, int]:
    """Of what this rank holds, the bytes in host memory while it computes on ``device`` (a GPU):
    the parameters whose shard is there (FSDP's CPU offload), the gradients a step gives them and
    their optimizer state. Nothing when the device is the host."""
    if device.type == "cpu":
        return {}

    def size(t: torch.Tensor) -> int:
        t = local(t)
        return t.numel() * t.element_size()

    state = local_optimizer(optimizer).state
    offloaded = [p for p in model.parameters() if local(p).device.type == "cpu"]
    return {"parameters": sum(size(p) for p in offloaded),
            "gradients": sum(size(p) for p in offloaded if p.requires_grad),  # held where the shard is
            "optimizer_state": sum(size(v) for p in offloaded for v in state.get(p, {}).values()
                                   if torch.is_tensor(v))}


def memory_report(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                  held: dict[str, int] | None = None) -> dict[str, float]:
    """What this rank holds (MiB) on the device it computes on, and, where FSDP offloads to host
    memory, there (``host_*``); the allocator's peak on CUDA. ``held``: a trainer's own count
    (DeepSpeed's engine counts its partitions and a step's gradients)."""
    held = held or held_bytes(model, optimizer)  # under FSDP: this rank's shards; ZeRO-1: its share
    gradients = held.get("step_gradients")
    if gradients is None:  # the gradients a step holds (after zero_grad(set_to_none) none are left)
        gradients = sum(local(p).numel() * local(p).element_size() for p in model.parameters()
                        if p.requires_grad)
    totals = {"parameters": held["parameters"], "gradients": gradients, "optimizer": held["optimizer_state"]}
    host = host_bytes(model, optimizer, device)
    host = {"parameters": host.get("parameters", 0), "gradients": host.get("gradients", 0),
            "optimizer": host.get("optimizer_state", 0)}
    report = {f"{k}_MiB": max(0, totals[k] - host[k]) / MIB for k in totals}
    if any(host.values()):
        report.update({f"host_{k}_MiB": v / MIB for k, v in host.items()})
    peak = dev.peak_memory_bytes(device)
    if peak is not None:
        report["allocator_peak_MiB"] = peak / MIB
    else:  # CPU: the process's peak resident memory (weights, activations, data, libraries)
        report["peak_rss_MiB"] = dev.process_peak_rss_bytes() / MIB
    return report


def log_experts(writer: SummaryWriter | None, step: int, stats: torch.Tensor) -> None:
    """A mixture of experts, one point per training step of the epoch: each MoE layer's share of
    the token assignments per expert, the share dropped by the capacity, and its balancing loss.
    ``stats``: (steps, layers, experts + 2), the epoch's last step taken at ``step``."""
    first = step - stats.shape[0] + 1
    mean = stats.mean(dim=0)
    for layer in range(stats.shape[1]):
        log.info("  MoE layer %d: tokens per expert %s, dropped %.3f, balancing loss %.4f", layer,
                 " ".join(f"{v:.3f}" for v in mean[layer, :-2].tolist()), mean[layer, -2].item(),
                 mean[layer, -1].item())
    if writer is None:
        return
    for i, per_layer in enumerate(stats.tolist()):
        for layer, values in enumerate(per_layer):
            writer.add_scalars(f"MoE/layer {layer} tokens per expert",
                               {f"expert {e}": v for e, v in enumerate(values[:-2])}, first + i)
            writer.add_scalar(f"MoE/layer {layer} dropped", values[-2], first + i)
            writer.add_scalar(f"MoE/layer {layer} balancing loss", values[-1], first + i)


def log_memory(writer: SummaryWriter | None, step: int, mem: dict[str, float],
               device: torch.device) -> None:
    log.info("  Memory per rank (MiB): %s", ", ".join(f"{k[:-4]} {v:.1f}" for k, v in mem.items()))
    if writer is not None:
        for k, v in mem.items():
            writer.add_scalar(f"Memory/{k}", v, step)
        writer.flush()
    dev.reset_peak_memory(device)


@contextlib.contextmanager
def compile_notice(device: torch.device, compiling: bool) -> Iterator[None]:
    """With torch.compile the first step compiles (a minute or more on a CPU): say so, and how
    long it took, instead of a silent wait."""
    if not compiling:
        yield
        return
    log.info("torch.compile: compiling the model in the first step (on a CPU this takes a "
             "minute or more; validation compiles once more)")
    start = time.time()
    yield
    dev.synchronize(device)
    log.info("torch.compile: first step done in %.1f s", time.time() - start)
