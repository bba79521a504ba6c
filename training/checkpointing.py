"""A trainer's whole state in a checkpoint: written atomically, only when it is sound, and
loaded so that the run continues exactly as if it had never stopped.

Two forms. The single file (``checkpoint.pt``, every layout but FSDP) holds the consolidated
model and optimizer state (whole tensors with the serial names, whatever the layout); only
rank 0 writes it, every rank takes part in the reductions that gather it. FSDP runs write
sharded checkpoints (training/sharded_checkpoint.py), every rank its shards. Both hold the
scheduler, the loss scaler, the step, the running sum of the epoch's training loss, the
random generators and the configuration, and either loads into any layout: a run whose
layout changed continues from whichever form is newer, then writes its own.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from distributed.env import all_reduce_sum
from distributed.sharding import local, local_optimizer
from training import sharded_checkpoint as sharded
from training.context import TrainingError
from utils import attention
from utils import checkpoint as ckpt
from utils import device as dev

if TYPE_CHECKING:
    from training.trainer import Trainer

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def find(run_dir: Path) -> Path | None:
    """The checkpoint a run in ``run_dir`` continues from: the single file or the newest sharded
    one, whichever holds the later step (both exist only if a save of the other form was
    killed before it removed the older one)."""
    found = [p for p in (run_dir / ckpt.CHECKPOINT_NAME, sharded.latest(run_dir))
             if p is not None and p.exists()]
    return max(found, key=lambda p: read_summary(p)["step"], default=None)


def read_summary(path: Path) -> dict[str, Any]:
    """Step and settings of a checkpoint (its tensors are not read in)."""
    state = sharded.read_trainer_file(path, mmap=True) if path.is_dir() else ckpt.load(path, mmap=True)
    return {"step": state["step"], "config": state.get("config", {})}


def trainer_state(trainer: Trainer, tensors: bool = True) -> dict[str, Any]:
    """Everything needed to continue (collective: every rank must call it); without
    ``tensors``, all but the model and optimizer state."""
    epoch_loss = all_reduce_sum(trainer.epoch_loss.clone(), trainer.ctx.dp_group).item()
    check_finite(trainer, epoch_loss)
    state = {"model": trainer.model_state(), "optimizer": trainer.optimizer_state()} if tensors else {}
    return {
        **state,
        "scheduler": trainer.scheduler.state_dict(),
        "scaler": trainer.scaler.state_dict() if trainer.scaler else None,
        "step": trainer.step,
        "attention_kernel": trainer.attention_kernel,
        "epoch_loss_sum": epoch_loss,  # summed over data-parallel ranks...
        "epoch_loss_ranks": trainer.ctx.dp_size,  # ...of which there were this many
        "epoch_steps": trainer.epoch_steps,
        "rng": {"device": dev.rng_state(trainer.device), "numpy": np.random.get_state(),
                "python": random.getstate()},
        "config": trainer.cfg.to_dict(),
    }


def check_finite(trainer: Trainer, epoch_loss_sum: float) -> None:
    """Refuse, on every rank alike, to checkpoint a NaN or infinite loss or weight: it would
    replace the last good checkpoint with one that no rerun can recover from."""
    finite = torch.stack([torch.isfinite(local(p)).all() for p in trainer.raw_model.parameters()])
    bad = torch.stack([torch.tensor(not math.isfinite(epoch_loss_sum), device=trainer.device),
                       (~finite).any()]).float()  # on the device: one host sync, below
    all_reduce_sum(bad)  # over every rank: shards differ, the decision must not
    if bad.any():
        what = "training loss" if bad[0] else "model weights"
        last = find(trainer.ctx.run_dir)
        kept = f"the last good checkpoint ({last}) is kept" if last else "no checkpoint was written"
        raise TrainingError(f"the {what} at step {trainer.step} is not finite (NaN or inf): not writing "
                            f"a checkpoint, {kept}; lower the learning rate or check the data")


def save(trainer: Trainer) -> None:
    if trainer.sharded_checkpoints:
        save_sharded(trainer)
        return
    state = trainer_state(trainer)  # every rank joins the reductions inside
    if trainer.ctx.is_main:
        try:
            ckpt.save_atomic(state, trainer.checkpoint_path)
        except OSError as err:  # a full disk or quota, a folder removed under the run
            raise TrainingError(f"could not write the checkpoint {trainer.checkpoint_path}: "
                                f"{err.strerror or err}; the previous checkpoint is kept. Free space "
                                f"(or choose another --expdir) and run the same command again") from None
        log.info("checkpoint at step %d written to %s", trainer.step, trainer.checkpoint_path)
        sharded.remove_all(trainer.ctx.run_dir)  # a sharded one of an earlier layout: now older


def save_sharded(trainer: Trainer) -> None:
    rest = trainer_state(trainer, tensors=False)
    tensors = sharded.model_and_optimizer(trainer.raw_model, trainer.optimizer)
    try:
        folder = sharded.save(trainer.ctx.run_dir, trainer.step, tensors, rest, trainer.ctx.is_main)
    except OSError as err:
        raise TrainingError(f"could not write the sharded checkpoint in {trainer.ctx.run_dir}: "
                            f"{err.strerror or err}; the previous checkpoint is kept. Free space "
                            f"(or choose another --expdir) and run the same command again") from None
    if trainer.ctx.is_main:
        (trainer.ctx.run_dir / ckpt.CHECKPOINT_NAME).unlink(missing_ok=True)  # an older single file
        log.info("sharded checkpoint at step %d written to %s", trainer.step, folder)


# How the optimizer computes, not what it has learned: the running script's choice
# (train_graph.py's capturable Adam, --enable_fused), never the checkpoint's.
KERNEL_FLAGS = ("capturable", "foreach", "fused")


def keep_kernel_flags(optimizer: torch.optim.Optimizer, load: Callable[[], None]) -> None:
    """Run ``load`` (the optimizer's state from a checkpoint) and keep this run's kernel flags.

    ``load_state_dict`` takes every param-group setting from the checkpoint, so a graph run
    resuming a train.py checkpoint would lose ``capturable`` (and its capture fail), and a
    change of ``--enable_fused`` would be ignored. Adam's step counts then move to where the
    kept flags want them: on the parameter's device for capturable or fused Adam, on the CPU
    otherwise (torch checks both)."""
    inner = local_optimizer(optimizer)  # ZeRO-1: the Adam that holds this rank's share
    before = [{key: group.get(key) for key in KERNEL_FLAGS} for group in inner.param_groups]
    load()
    changed = set()
    for group, flags in zip(inner.param_groups, before):
        for key, value in flags.items():
            if group.get(key) != value:
                changed.add(f"{key} {group.get(key)} -> {value}")
                group[key] = value
        on_device = bool(group.get("capturable") or group.get("fused"))
        for p in group["params"]:
            step = (inner.state.get(p) or {}).get("step")
            if torch.is_tensor(step):
                inner.state[p]["step"] = step.to(p.device if on_device else "cpu", torch.float32)
    if changed:
        log.info("the checkpoint's optimizer ran with other kernels; this run keeps its own (%s)",
                 ", ".join(sorted(changed)))


def load(trainer: Trainer, path: Path) -> None:
    if path.is_dir() and trainer.sharded_checkpoints:  # each rank reads the slices it needs
        keep_kernel_flags(trainer.optimizer,
                          lambda: sharded.load_into(path, trainer.raw_model, trainer.optimizer))
        state = sharded.read_trainer_file(path)
    else:  # whole tensors, each rank keeps its part
        state = sharded.read_consolidated(path) if path.is_dir() else ckpt.load(path)
        from training.upgrade import upgrade_checkpoint  # older checkpoints' layout, when resuming

        state = upgrade_checkpoint(state, trainer.cfg.num_heads)
        trainer.load_model_state(state["model"])
        keep_kernel_flags(trainer.optimizer, lambda: trainer.load_optimizer_state(state["optimizer"]))
    trainer.scheduler.load_state_dict(state["scheduler"])
    if trainer.scaler and state["scaler"]:
        trainer.scaler.load_state_dict(state["scaler"])
    trainer.step = state["step"]
    keep_attention_kernel(trainer, state.get("attention_kernel"))
    # the epoch's loss sum so far goes to one rank, so the epoch-end reduction counts it once;
    # rescaled from the data-parallel ranks that summed it to those that will average it
    ranks = state.get("epoch_loss_ranks", trainer.ctx.dp_size)
    loss_sum = state["epoch_loss_sum"] * trainer.ctx.dp_size / ranks
    trainer.epoch_loss.fill_(loss_sum if trainer.ctx.dp_rank == 0 else 0.0)
    trainer.epoch_steps = state["epoch_steps"]
    dev.set_rng_state(state["rng"]["device"], trainer.device)
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
    log.info("resumed from %s at step %d", path, trainer.step)


def keep_attention_kernel(trainer: Trainer, kernel: str | None) -> None:
    """With ``attention_kernel: auto``, continue on the kernel the run chose when it started
    (timed again, it could come out otherwise and the resumed run would not be exact)."""
    if trainer.cfg.attention_kernel != "auto" or kernel in (None, trainer.attention_kernel):
        return
    if kernel in attention.CUDA_ONLY and trainer.device.type != "cuda":
        return  # a GPU run continued on a CPU: keep this device's own choice
    log.info("attention kernel %s, as the run chose at its start", kernel)
    trainer.attention_kernel = kernel


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
    sharded.remove_stale(run_dir)
