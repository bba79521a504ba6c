"""What asynchronous SGD (training/async_sgd.py) writes: the checkpoints of the parameter server
and of Hogwild, and the finish of every mode.

Every ``--checkpoint_every`` updates the run writes RUN_DIR/checkpoint.pt, whole or not at all
(utils/checkpoint.py's save_atomic): the weights after that many updates, the optimizer (Hogwild:
each worker's own) and the learning-rate schedule, and the updates applied so far: each one's
trainer, loss and time (the server's also its version and staleness). The log is also each
trainer's place in its data: a trainer has drawn one batch per entry of its own.

A killed run, started again with the same command, continues from there: the weights and
optimizers are loaded, every trainer skips the batches it had drawn, and the versions and the
log go on from the checkpoint's. The gradients in flight when the run died are computed again,
at the checkpoint's weights. With one trainer (or one Hogwild worker) the resumed run is then the
uninterrupted one to the bit; with more, its log is the saved one continued, and replaying the
whole log (training/async_sgd.py's ``replay``) still gives the server's weights to the bit.

Hogwild's workers each own an optimizer in their own process, so its checkpoint is a point that
every worker waits at: at update k (a multiple of ``--checkpoint_every``) no worker claims another
until each has sent its optimizer's state and the parent has copied the shared weights
(:class:`HogwildPause`).

The finish (:func:`finish`) writes weights.pt, then metrics.jsonl, whose presence says the run is
finished: a run killed between the two is run again.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from training import validation
from training.run_dir import check_same_run, previous_run
from utils import checkpoint as ckpt
from utils.config import Config
from utils.data_loader import get_data_loader
from utils.era5 import channel_names
from utils.metrics import latitude_weights

log = logging.getLogger(__name__)


@dataclass
class AsyncState:
    """What a checkpoint holds; ``log`` has a dict per applied update, in the order applied."""

    weights: dict[str, torch.Tensor]
    optimizers: list[dict[str, Any]]  # the server's one; a Hogwild worker's each
    log: list[dict[str, Any]] = field(default_factory=list)
    schedule: dict[str, Any] | None = None  # the server's scheduler (Hogwild's rate: the update number)

    @property
    def updates(self) -> int:
        return len(self.log)

    def drawn(self, trainer: int) -> int:
        """The batches ``trainer`` had drawn: one per update of its own."""
        return sum(1 for u in self.log if u["trainer"] == trainer)


def check_resumable(run_dir: Path, cfg: Config) -> None:
    """A checkpoint in ``run_dir`` is of this run's settings, or the run is refused (one line)."""
    previous = previous_run(run_dir)
    if previous is not None:
        check_same_run(previous, cfg, run_dir)


def save(run_dir: Path, state: AsyncState, cfg: Config) -> None:
    ckpt.save_atomic({"step": state.updates, "config": cfg.to_dict(), "model": state.weights,
                      "optimizers": state.optimizers, "schedule": state.schedule, "log": state.log},
                     run_dir / ckpt.CHECKPOINT_NAME)
    log.info("checkpoint after %d updates written to %s", state.updates, run_dir / ckpt.CHECKPOINT_NAME)


def load(run_dir: Path) -> AsyncState | None:
    """The run's checkpoint, or None where it has none (a new run)."""
    path = run_dir / ckpt.CHECKPOINT_NAME
    if not path.exists():
        return None
    raw = ckpt.load(path)
    log.info("resuming from %s after %d updates", path, raw["step"])
    return AsyncState(raw["model"], raw["optimizers"], raw["log"], raw["schedule"])


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the model's weights (Hogwild's are shared with workers that go on writing them)."""
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


class HogwildPause:
    """Where Hogwild's workers wait for a checkpoint (shared by the parent and its forked workers).

    A worker asks :meth:`due` before it claims update number ``n``: at a multiple of ``every``
    not yet saved, it sends its optimizer's state (:meth:`send`) and waits until the parent has
    copied the weights (:meth:`wait`). The parent, once it has every worker's state, copies the
    weights and calls :meth:`release`."""

    def __init__(self, ctx: Any, every: int, workers: int, saved: int, timeout_s: float,
                 folder: Path) -> None:
        self.every, self.timeout_s, self.folder = every, timeout_s, folder  # folder: the states on their way
        self.saved = ctx.Value("i", saved, lock=False)  # the last update saved (set by the release)

    def due(self, number: int, total: int) -> bool:
        return bool(self.every) and number < total and number % self.every == 0 and number > self.saved.value

    def send(self, results: Any, rank: int, optimizer: torch.optim.Optimizer, number: int) -> None:
        """The optimizer's state to a file, then a small message. Through the queue, the parent
        would wait forever on a worker stopped while sending: a tensor's memory is handed over by
        the sending process, and a large message arrives in parts."""
        path = self.folder / f"state_{rank}.pt"
        torch.save(optimizer.state_dict(), path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)
        results.put(("state", rank, number))

    def received(self, rank: int) -> dict[str, Any]:
        """The state worker ``rank`` sent (the parent, once its message came)."""
        path = self.folder / f"state_{rank}.pt"
        state = torch.load(path, weights_only=True)
        path.unlink()
        return state

    def wait(self, number: int) -> bool:
        """Until the parent has copied the weights of update ``number``; False if it did not in
        time (it died, or gave up). A shared number, polled: a barrier's release waits for every
        process it wakes, and a worker killed while waiting would hang the parent there."""
        deadline = time.monotonic() + self.timeout_s
        while self.saved.value < number:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)  # (16 workers polling on 2 cores: rarely enough to leave them to the parent)
        return True

    def release(self, number: int) -> None:
        self.saved.value = number


def records(updates: list[dict[str, Any]], samples_per_update: int, every: int) -> list[dict[str, Any]]:
    """A metrics record per ``every`` updates (in the order they were applied)."""
    out, before = [], 0.0
    for k, first in enumerate(range(0, len(updates), every)):
        part = updates[first: first + every]
        seconds = part[-1]["seconds"] - before
        before = part[-1]["seconds"]
        record = {"epoch": k + 1, "step": first + len(part),
                  "train_loss": sum(u["loss"] for u in part) / len(part),
                  "samples_per_sec": len(part) * samples_per_update / seconds if seconds > 0 else None,
                  "epoch_seconds": seconds}
        if "staleness" in part[0]:
            record["staleness_mean"] = sum(u["staleness"] for u in part) / len(part)
            record["staleness_max"] = max(u["staleness"] for u in part)
        out.append(record)
    return out


def finish(cfg: Config, args: argparse.Namespace, run_dir: Path, model: torch.nn.Module,
           updates: list[dict[str, Any]], samples_per_update: int) -> None:
    """Validate the final weights; write weights.pt, then metrics.jsonl (atomically, last)."""
    loader, _, _ = get_data_loader(cfg, "valid", cfg.optim.global_batch_size, False)
    model.eval()
    weights = latitude_weights(cfg.model.img_size[0], torch.device("cpu"))
    channels = channel_names(cfg.data.data_dir, cfg.model.n_in_channels)[: cfg.model.n_out_channels]
    val = validation.evaluate(model, iter(loader), channels, weights)
    rows = records(updates, samples_per_update, args.log_every)
    by_worker: dict[str, int] = {}
    for u in updates:
        by_worker[str(u["trainer"])] = by_worker.get(str(u["trainer"]), 0) + 1
    rows[-1].update(val_loss=val["loss"], rmse=val["rmse"], run_seconds=updates[-1]["seconds"],
                    run_samples_per_sec=len(updates) * samples_per_update / updates[-1]["seconds"],
                    updates_by_worker=by_worker)
    ckpt.save_atomic({"model": {n: p.detach().clone() for n, p in model.named_parameters()},
                      "step": len(updates)}, run_dir / "weights.pt")
    # last, and whole or not at all: its presence is what says the run is finished (main)
    ckpt.write_text_atomic(run_dir / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    for r in rows:
        stale = f", staleness {r['staleness_mean']:.2f} (at most {r['staleness_max']})" \
            if "staleness_mean" in r else ""
        rate = f"{r['samples_per_sec']:.1f}" if r["samples_per_sec"] else "-"
        log.info("updates %d: train loss %.6f, %s samples/s%s", r["step"], r["train_loss"], rate, stale)
    log.info("%s: %d updates in %.1f s, val loss %.6f; metrics in %s", args.mode, len(updates),
             updates[-1]["seconds"], val["loss"], run_dir / "metrics.jsonl")
