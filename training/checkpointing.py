"""Checkpoints: written atomically, only when they are sound, and loaded so that the run
continues exactly as if it had never stopped.

A checkpoint is made of parts (training/trainer.py:Trainer.checkpoint_parts): each part says what
it saves and restores with ``state_dict()`` / ``load_state_dict(state)`` over keys of its own (the
Trainer's progress: "step", "epoch_loss_sum", ...; the step variant's "model" and "optimizer";
"scheduler", "scaler", "rng", "config"), and this module writes their union and hands it back to
each of them. It knows nothing of the Trainer.

Two forms. The single file (``checkpoint.pt``, every layout but FSDP) holds the consolidated
model and optimizer state (whole tensors with the serial names, whatever the layout); only
rank 0 writes it, every rank takes part in the reductions that gather it. FSDP runs write
sharded checkpoints (training/sharded_checkpoint.py), every rank its shards of the model and
optimizer, rank 0 the other parts. Either form loads into any layout: a run whose layout changed
continues from whichever form is newer, then writes its own.
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from training.context import TrainingError
from utils import checkpoint as ckpt
from utils import device as dev
from utils.config import Config

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def sharded() -> Any:
    """training/sharded_checkpoint.py, imported by the runs that meet a sharded checkpoint."""
    from training import sharded_checkpoint

    return sharded_checkpoint


class Stateful(Protocol):
    """A part of a checkpoint: its own keys of the checkpoint's dict."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Sharded(Protocol):
    """The part that holds the model and optimizer, when it writes them as shards (FSDP)."""

    def shards(self) -> dict[str, Any]: ...

    def load_shards(self, path: Path) -> None: ...


class RandomState:
    """The random generators: the device's (torch's CPU one on a CPU), numpy's and Python's."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        return {"rng": {"device": dev.rng_state(self.device), "numpy": np.random.get_state(),
                        "python": random.getstate()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        dev.set_rng_state(state["rng"]["device"], self.device)
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])


class ScheduleState:
    """The learning-rate schedule ("scheduler"). Its rates load as numbers whatever the run that
    wrote them kept them as (a CUDA-graph run keeps the rate as a GPU tensor, training/graphs.py):
    a number is what an optimizer that is not capturable takes, and a capturable one's tensor rate
    is filled in place with it (torch's LRScheduler does that when the rate is a tensor)."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = dict(state["scheduler"])
        for key in ("base_lrs", "_last_lr"):
            if key in saved:
                saved[key] = [float(v) for v in saved[key]]
        self.scheduler.load_state_dict(saved)


class ScalerState:
    """fp16's loss scaler ("scaler"; None without one)."""

    def __init__(self, scaler: torch.amp.GradScaler | None) -> None:
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict() if self.scaler else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


class ConfigRecord:
    """The run's configuration, written for the record (training/run_dir.py compares a rerun's
    settings with it before anything starts); nothing to restore."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    def state_dict(self) -> dict[str, Any]:
        return {"config": self.cfg.to_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def find(run_dir: Path) -> Path | None:
    """The checkpoint a run in ``run_dir`` continues from: the single file or the newest sharded
    one, whichever holds the later step (both exist only if a save of the other form was
    killed before it removed the older one)."""
    candidates = [run_dir / ckpt.CHECKPOINT_NAME]
    if (run_dir / ckpt.DCP_DIR).exists():
        candidates.append(sharded().latest(run_dir))
    found = [p for p in candidates if p is not None and p.exists()]
    return max(found, key=lambda p: read_summary(p)["step"], default=None)


def read_summary(path: Path) -> dict[str, Any]:
    """Step and settings of a checkpoint (its tensors are not read in)."""
    state = sharded().read_trainer_file(path, mmap=True) if path.is_dir() else ckpt.load(path, mmap=True)
    return {"step": state["step"], "config": state.get("config", {})}


def collect(parts: Sequence[Stateful]) -> dict[str, Any]:
    """The union of the parts' states (collective: a part may gather over the ranks)."""
    state: dict[str, Any] = {}
    for part in parts:
        own = part.state_dict()
        clash = set(own) & set(state)
        assert not clash, f"two checkpoint parts write {sorted(clash)}"
        state.update(own)
    return state


def save(run_dir: Path, parts: Sequence[Stateful], step: int, is_main: bool,
         shards: Sharded | None = None) -> None:
    """Write every part's state (collective: every rank calls it). With ``shards`` (one of the
    parts), that part's tensors are written as shards by every rank, the others by rank 0."""
    if shards is not None:
        rest = collect([p for p in parts if p is not shards])
        try:
            folder = sharded().save(run_dir, step, shards.shards(), rest, is_main)
        except OSError as err:
            raise TrainingError(f"could not write the sharded checkpoint in {run_dir}: "
                                f"{err.strerror or err}; the previous checkpoint is kept. Free space "
                                f"(or choose another --expdir) and run the same command again") from None
        if is_main:
            (run_dir / ckpt.CHECKPOINT_NAME).unlink(missing_ok=True)  # an older single file
            log.info("sharded checkpoint at step %d written to %s", step, folder)
        return
    state = collect(parts)  # every rank joins the reductions inside
    if not is_main:
        return
    path = run_dir / ckpt.CHECKPOINT_NAME
    try:
        ckpt.save_atomic(state, path)
    except OSError as err:  # a full disk or quota, a folder removed under the run
        raise TrainingError(f"could not write the checkpoint {path}: {err.strerror or err}; the previous "
                            f"checkpoint is kept. Free space (or choose another --expdir) and run the "
                            f"same command again") from None
    log.info("checkpoint at step %d written to %s", step, path)
    if (run_dir / ckpt.DCP_DIR).exists():
        sharded().remove_all(run_dir)  # a sharded one of an earlier layout: now older


def load(path: Path, parts: Sequence[Stateful], shards: Sharded | None = None) -> None:
    """Hand each part its state from the checkpoint at ``path`` (either form, into any layout)."""
    if path.is_dir() and shards is not None:  # each rank reads the slices it needs
        shards.load_shards(path)
        state = sharded().read_trainer_file(path)
        parts = [p for p in parts if p is not shards]
    else:  # whole tensors: each part keeps what is this rank's
        state = sharded().read_consolidated(path) if path.is_dir() else ckpt.load(path)
    for part in parts:
        part.load_state_dict(state)


# How the optimizer computes, not what it has learned: the running script's choice
# (train_graph.py's capturable Adam, --enable_fused), never the checkpoint's.
KERNEL_FLAGS = ("capturable", "foreach", "fused")


def keep_kernel_flags(optimizer: torch.optim.Optimizer, load: Callable[[], None]) -> None:
    """Run ``load`` (the optimizer's state from a checkpoint) and keep this run's kernel flags.

    ``load_state_dict`` takes every param-group setting from the checkpoint, so a graph run
    resuming a train.py checkpoint would lose ``capturable`` (and its capture fail), and a
    change of ``--enable_fused`` would be ignored. Adam's step counts then move to where the
    kept flags want them: on the parameter's device for capturable or fused Adam, on the CPU
    otherwise (torch checks both). A learning rate saved as a tensor (a CUDA-graph run keeps it
    on the GPU for its replays) becomes a number again for an optimizer that is not capturable:
    foreach Adam refuses a tensor learning rate."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeRO-1: the optimizer that holds this rank's share
    before = [{key: group.get(key) for key in KERNEL_FLAGS} for group in inner.param_groups]
    load()
    changed = set()
    for group, flags in zip(inner.param_groups, before):
        for key, value in flags.items():
            if group.get(key) != value:
                changed.add(f"{key} {group.get(key)} -> {value}")
                group[key] = value
        if torch.is_tensor(group.get("lr")) and not group.get("capturable"):
            group["lr"] = group["lr"].item()
            if torch.is_tensor(group.get("initial_lr")):
                group["initial_lr"] = group["initial_lr"].item()
        on_device = bool(group.get("capturable") or group.get("fused"))
        for p in group["params"]:
            step = (inner.state.get(p) or {}).get("step")
            if torch.is_tensor(step):
                inner.state[p]["step"] = step.to(p.device if on_device else "cpu", torch.float32)
    if changed:
        log.info("the checkpoint's optimizer ran with other kernels; this run keeps its own (%s)",
                 ", ".join(sorted(changed)))


def trim_metrics(run_dir: Path, step: int) -> None:
    """Drop the metrics lines an interrupted attempt logged after ``step`` (the checkpoint it
    resumes from), as TensorBoard's purge_step does for the event files."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return
    lines = path.read_text().splitlines()
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    if len(kept) < len(lines):
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        os.replace(tmp, path)
        log.info("dropped %d lines of %s logged after step %d by the interrupted attempt",
                 len(lines) - len(kept), path.name, step)


def remove_temp_files(run_dir: Path) -> None:
    """Temporary files of saves that were killed (the run directory's lock is held: no other
    process of this run can be writing them)."""
    for tmp in run_dir.glob(f".{ckpt.CHECKPOINT_NAME}.tmp-*"):
        tmp.unlink(missing_ok=True)
        log.info("removed %s, left by a save that was killed", tmp.name)
    if (run_dir / ckpt.DCP_DIR).exists():
        sharded().remove_stale(run_dir)
