"""Stop cleanly on SIGTERM or an early-warning signal, checkpoint, optionally requeue.

Slurm sends SIGTERM at the time limit (and on preemption or ``scancel``), then SIGKILL
``KillWait`` seconds later; ``#SBATCH --signal=USR1@90`` adds a warning 90 s before the
limit. torchrun forwards a SIGTERM it receives to its workers and waits 30 s before
SIGKILL. Training has that long to write a checkpoint.

Three parts (the first and last here):

* :func:`install_handlers` makes TERM, INT (Ctrl-C), USR1 and USR2 set a flag instead of
  killing the process; DataLoader workers ignore them (:func:`ignore_in_worker`), so a
  signal sent to every process of the job does not kill them. A second stop signal kills
  the process as by default (srun --kill-on-bad-exit, torchrun and Slurm's time limit then
  end a rank that no longer responds), unless it is the same signal within
  :data:`REPEAT_WINDOW_S` of the first: the launcher forwarding what the rank already got.
* :class:`distributed.stop.StopAgreement` turns the per-process flag into a decision every
  rank shares (see there).
* After the checkpoint, the process exits with :data:`EXIT_STOPPED` (75, EX_TEMPFAIL of
  sysexits.h: "try again"). The submit scripts requeue the job on that status when
  ``REQUEUE=1``; re-running the same command finds checkpoint.pt and resumes.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

log = logging.getLogger(__name__)

EXIT_STOPPED = 75  # stopped by a signal, checkpoint written: run again to continue
# Ctrl-C (SIGINT) stops like TERM: a checkpoint, then exit 75, no KeyboardInterrupt traceback
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
# A signal sent to a whole torchrun (or srun) process group reaches each worker twice: once
# directly and once forwarded by the launcher, milliseconds apart. A repeat of the first
# signal within this window is that echo and counts once; a later one means "stop now".
REPEAT_WINDOW_S = 1.0

_received: int | None = None  # the first stop signal this process received
_received_at = 0.0
_previous: dict[int, Any] = {}  # handlers before install_handlers, put back by restore_handlers


def _handler(signum: int, frame) -> None:
    global _received, _received_at
    if _received is None:
        _received, _received_at = signum, time.monotonic()
        return
    if signum == _received and time.monotonic() - _received_at < REPEAT_WINDOW_S:
        return  # the launcher's forwarded copy of the same signal
    signal.signal(signum, signal.SIG_DFL)  # a second stop signal: stop waiting, die as by default
    os.kill(os.getpid(), signum)


def ignore_stop_signals() -> None:
    """In a loader's worker process: stop signals are the training process's business. Slurm
    signals every process of the step; a worker that died of it (the default action of TERM
    and USR1) fails the loader before the checkpoint can be written."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def ignore_in_worker(worker_id: int) -> None:
    """DataLoader ``worker_init_fn`` (torch's own worker handler would end a worker on SIGTERM)."""
    ignore_stop_signals()


def install_handlers(signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
    """Catch the stop signals in this process (call from the main thread)."""
    global _received
    _received = None
    for sig in signals:
        _previous.setdefault(sig, signal.getsignal(sig))
        signal.signal(sig, _handler)


def restore_handlers() -> None:
    """Put back the handlers install_handlers replaced (Python's KeyboardInterrupt for SIGINT)."""
    global _received
    for sig, handler in _previous.items():
        signal.signal(sig, handler)
    _previous.clear()
    _received = None


def received() -> str | None:
    """Name of the stop signal received by this process, if any."""
    return None if _received is None else signal.Signals(_received).name
