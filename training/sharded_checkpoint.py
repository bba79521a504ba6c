"""Sharded checkpoints (``data_parallel fsdp``): every rank writes its own shards with
``torch.distributed.checkpoint`` (DCP), and a later run reads them at any number of ranks.

In the run directory::

    checkpoint_dcp/LATEST             names the newest complete checkpoint (replaced atomically)
    checkpoint_dcp/step_00000012/     DCP's files (.metadata and one .distcp per rank) and
                                      trainer.pt: everything but the model and optimizer tensors

A save writes a new step folder, waits for every rank, then rank 0 replaces LATEST and
removes the older folders: a save killed at any moment leaves LATEST naming the previous
complete checkpoint. DCP stores each tensor with its global shape and each rank's slice;
loading plans which slices every rank of the new run needs, so the number of ranks may
change (resharding). ``read_consolidated`` turns a sharded checkpoint into the
single-file form (scripts/convert_checkpoint.py, and runs that are not FSDP).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from utils import checkpoint as ckpt

log = logging.getLogger(__name__)

DCP_DIR = ckpt.DCP_DIR
LATEST = "LATEST"
TRAINER_FILE = "trainer.pt"


def latest(run_dir: Path) -> Path | None:
    """The newest complete sharded checkpoint in ``run_dir`` (a step folder), or None."""
    pointer = Path(run_dir) / DCP_DIR / LATEST
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    if not (path / TRAINER_FILE).is_file():
        raise ValueError(f"{pointer} names {path.name}, which is incomplete; delete {pointer.parent} "
                         f"to start over")
    return path


def read_trainer_file(path: Path, mmap: bool = False) -> dict[str, Any]:
    return ckpt.load(Path(path) / TRAINER_FILE, mmap=mmap)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(run_dir: Path, step: int, tensors: dict[str, Any], rest: dict[str, Any], is_main: bool) -> Path:
    """Write a sharded checkpoint (collective: every rank calls it with its own ``tensors``)."""
    import torch.distributed.checkpoint as dcp

    folder = Path(run_dir) / DCP_DIR / f"step_{step:08d}"
    if is_main and folder.exists():  # a save of this step that was killed: start it afresh
        shutil.rmtree(folder)
    _barrier()
    dcp.save(tensors, checkpoint_id=str(folder))  # every rank writes its shards; rank 0 .metadata
    if is_main:
        ckpt.save_atomic(rest, folder / TRAINER_FILE)
    _barrier()  # every rank's shards are on disk: only now may LATEST name the folder
    if is_main:
        ckpt.write_text_atomic(folder.parent / LATEST, folder.name)
        remove_stale(run_dir)
    return folder


def remove_stale(run_dir: Path) -> None:
    """Step folders other than the one LATEST names: older ones and those of killed saves."""
    root = Path(run_dir) / DCP_DIR
    pointer = root / LATEST
    keep = pointer.read_text().strip() if pointer.is_file() else None
    for folder in root.glob("step_*"):
        if folder.name != keep:
            shutil.rmtree(folder, ignore_errors=True)
            log.info("removed %s (an older or unfinished sharded checkpoint)", folder.name)


def remove_all(run_dir: Path) -> None:
    shutil.rmtree(Path(run_dir) / DCP_DIR, ignore_errors=True)


def model_and_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's shards, keyed by the parameters' (serial) names: what DCP saves and loads into."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state}


def load_into(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Read the shards this rank needs (any number of ranks may have written them)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    tensors = model_and_optimizer(model, optimizer)
    dcp.load(tensors, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=tensors["model"],
                   optim_state_dict=tensors["optimizer"])


def read_consolidated(path: Path) -> dict[str, Any]:
    """The whole checkpoint in the single-file form (whole tensors, the optimizer's state keyed
    by parameter index as ``Optimizer.state_dict`` keys it), read by this process alone."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / "whole.pt"
        dcp_to_torch_save(str(path), str(whole))
        tensors = torch.load(whole, map_location="cpu", weights_only=False)
    state = read_trainer_file(path)
    state["model"] = tensors["model"]
    state["optimizer"] = optimizer_by_index(tensors["optimizer"])
    return state


def optimizer_by_index(state: dict[str, Any]) -> dict[str, Any]:
    """DCP keys optimizer state by parameter name; ``Optimizer.load_state_dict`` by position."""
    groups, index = [], {}
    for group in state["param_groups"]:
        names = group["params"]
        index.update({name: len(index) + i for i, name in enumerate(names)})
        groups.append({**group, "params": [index[n] for n in names]})
    return {"state": {index[name]: s for name, s in state["state"].items()}, "param_groups": groups}
