"""The run directory: checked before anything is written, compared with the run it already
holds, and locked while a run trains in it.

Order in the launcher: the name and the place are checked, the previous checkpoint (if any)
is read and compared with the new settings, the trainer is built, and only then is the
directory locked and written to. A run that has nothing to do, or that fails before
training, changes nothing on disk.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

from training.checkpointing import find, read_summary
from utils.config import MAY_CHANGE_ON_RESUME, Config

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"


def check_run_num(run_num: str) -> None:
    """The run name is one folder inside the config's folder, never a way out of it."""
    if not run_num or run_num in (".", "..") or "/" in run_num or os.sep in run_num:
        raise ValueError(f"--run_num must be a plain folder name (for example 01 or bs64-lr2), "
                         f"got {run_num!r}")


def check_can_create(run_dir: Path) -> None:
    """The first existing folder on the way to ``run_dir`` must be a writable folder."""
    path = run_dir
    while not path.exists():
        path = path.parent
    if not path.is_dir():
        raise ValueError(f"cannot create the run directory {run_dir}: {path} is a file, not a folder; "
                         f"choose another --expdir")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"cannot create the run directory {run_dir}: {path} is not writable; "
                         f"choose another --expdir")
    try:  # what access() cannot tell: /proc, a read-only mount seen by root, a full quota
        os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=path))
    except OSError as err:
        raise ValueError(f"cannot create the run directory {run_dir}: {path} does not take new "
                         f"folders ({err.strerror}); choose another --expdir") from None


def previous_run(run_dir: Path) -> dict[str, Any] | None:
    """Step and settings of the checkpoint in ``run_dir``, or None (tensors are not read in)."""
    path = find(run_dir)
    return None if path is None else read_summary(path)


def other_settings(previous: dict[str, Any], cfg: Config) -> list[str]:
    """The settings that change the mathematics and differ from the checkpoint's; the others
    (loader, profiling, checkpoint interval, layout, num_iters to extend the run) may change."""
    now = cfg.to_dict()
    return [f"{key} {value!r} there, {now[key]!r} now" for key, value in previous["config"].items()
            if key in now and key not in MAY_CHANGE_ON_RESUME and _norm(value) != _norm(now[key])]


def check_same_run(previous: dict[str, Any], cfg: Config, run_dir: Path) -> None:
    """A run named with --run_num continues the run in its folder, or is refused."""
    differ = other_settings(previous, cfg)
    if differ:
        raise ValueError(f"{run_dir} holds a checkpoint (step {previous['step']}) of a run with other "
                         f"settings: {'; '.join(differ)}. Continue it with its settings, or start a "
                         f"new run with another --run_num")


def free_run_dir(run_dir: Path, cfg: Config) -> Path:
    """For a run that named no --run_num: ``run_dir`` if it is empty or holds this run (same
    settings), else the first numbered folder beside it (01, 02, ...) that is. Rerunning the
    same command then finds the same folder again, and resumes there."""
    candidate, number = run_dir, 0
    while True:
        previous = previous_run(candidate)
        if previous is None or not other_settings(previous, cfg):
            return candidate
        number += 1
        candidate = run_dir.with_name(f"{number:02d}")


def _norm(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


class RunLock:
    """An exclusive lock on the run directory (flock on RUN_DIR/.lock), held while training.

    The kernel releases it when its process dies, so a lock left by a killed run is taken
    over (with a message); the file names the holder for the error a second run prints.
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_NAME
        self.file = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")  # noqa: SIM115 (held open for the whole run)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                # a file system without flock (some NFS or Lustre mounts): run unlocked, say so
                log.warning("cannot lock %s (%s); two runs in this folder would not be detected",
                            self.path, err.strerror)
                f.close()
                return
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise ValueError(f"{self.path.parent} is in use by {holder}; wait for that run to end, "
                             f"or train in another folder with --run_num") from None
        f.seek(0)
        previous = f.read().strip()
        if previous:
            log.info("took over the run directory's lock from %s, which is no longer running", previous)
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        self.file = f

    def release(self) -> None:
        if self.file is not None:
            self.file.seek(0)
            self.file.truncate()  # a clean end: nobody to take over from
            self.file.close()
            self.file = None
