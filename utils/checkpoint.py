"""Atomic checkpoints: written to a temporary file, flushed, then renamed into place.

A rename within one directory is atomic on POSIX file systems, so a process killed while
writing leaves the previous checkpoint untouched and loadable.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "checkpoint.pt"
DCP_DIR = "checkpoint_dcp"  # sharded checkpoints (training/sharded_checkpoint.py) live here


def save_atomic(state: dict[str, Any], path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace a small text file in one step (readers see the old or the new content)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: Path, map_location: str | torch.device = "cpu", mmap: bool = False) -> dict[str, Any]:
    """The checkpoint's contents (``mmap``: tensors stay on disk until used)."""
    try:
        return torch.load(path, map_location=map_location, weights_only=False, mmap=mmap)
    except Exception as err:  # a truncated or foreign file: say which and what to do
        raise ValueError(f"checkpoint {path} cannot be read ({err}); delete it to start over") from err


def check_names(expected: Iterable[str], state: dict[str, torch.Tensor]) -> None:
    """A model's checkpoint must hold exactly the serial model's parameters."""
    expected = set(expected)
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit this model (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}); was it written for another model size?")
