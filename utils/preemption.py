"""Stop cleanly on SIGTERM or an early-warning signal, checkpoint, optionally requeue.

Slurm sends SIGTERM at the time limit (and on preemption or ``scancel``), then SIGKILL
``KillWait`` seconds later; ``#SBATCH --signal=USR1@90`` adds a warning 90 s before the
limit. torchrun forwards a SIGTERM it receives to its workers and waits 30 s before
SIGKILL. Training has that long to write a checkpoint.

Three parts:

* :func:`install_handlers` makes TERM, USR1 and USR2 set a flag instead of killing the
  process; DataLoader workers ignore them (:func:`ignore_in_worker`), so a signal sent to
  every process of the job does not kill them. A second
  stop signal of any kind kills the process as by default (srun --kill-on-bad-exit,
  torchrun and Slurm's time limit then end a rank that no longer responds).
* :class:`StopAgreement` turns the per-process flag into a decision every rank shares.
  A signal may reach only some ranks, or reach them at different steps; if each rank
  stopped on its own, the others would wait forever in their next collective. Every
  ``check_every`` steps each rank contributes its flag to an all-reduce (MAX) over all
  ranks, and the result is read one step later, so the reduction itself is never
  waited for (reading it on a GPU still waits for the step queued meanwhile: one short
  bubble every ``check_every`` steps). Every rank reads the same result at the same
  step, so all stop together.
* After the checkpoint, the process exits with :data:`EXIT_STOPPED` (75, EX_TEMPFAIL of
  sysexits.h: "try again"). The submit scripts requeue the job on that status when
  ``REQUEUE=1``; re-running the same command finds checkpoint.pt and resumes.
"""

from __future__ import annotations

import logging
import os
import signal

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

EXIT_STOPPED = 75  # stopped by a signal, checkpoint written: run again to continue
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)

_received: int | None = None  # the first stop signal this process received


def _handler(signum: int, frame) -> None:
    global _received
    if _received is not None:  # a second stop signal: stop waiting, die as by default
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _received = signum


def ignore_in_worker(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: stop signals are the training process's business. Slurm
    signals every process of the step, and torch's worker handler would end a worker on
    SIGTERM, which fails the loader before the checkpoint can be written."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def install_handlers(signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
    """Catch the stop signals in this process (call from the main thread)."""
    global _received
    _received = None
    for sig in signals:
        signal.signal(sig, _handler)


def restore_handlers(signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
    global _received
    for sig in signals:
        signal.signal(sig, signal.SIG_DFL)
    _received = None


def received() -> str | None:
    """Name of the stop signal received by this process, if any."""
    return None if _received is None else signal.Signals(_received).name


class StopAgreement:
    """Decides, identically on every rank, at which step to stop.

    ``poll(step)`` is called after every optimizer step with the number of steps done.
    Without a process group it answers from the local flag at once (no cost); with one
    it starts an asynchronous MAX all-reduce of the flag at steps that are multiples of
    ``check_every`` and returns its result at the following step.
    """

    def __init__(self, device: torch.device, check_every: int = 10,
                 group: dist.ProcessGroup | None = None) -> None:
        if check_every < 1:
            raise ValueError(f"--stop_check_every must be at least 1, got {check_every}")
        self.check_every = check_every
        self.group = group
        self.distributed = dist.is_initialized() and dist.get_world_size(group) > 1
        self._flag = torch.zeros(1, dtype=torch.int32, device=device)
        self._work = None
        self._read_at = -1

    def poll(self, step: int) -> bool:
        if not self.distributed:
            return _received is not None
        if self._work is not None and step >= self._read_at:
            self._work.wait()
            self._work = None
            if self._flag.item() > 0:  # host sync, once per check_every steps
                return True
        if self._work is None and step % self.check_every == 0:
            self._flag.fill_(0 if _received is None else 1)
            self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group,
                                         async_op=True)
            self._read_at = step + 1
        return False

    def drain(self) -> None:
        """Finish an outstanding reduction (before the process group goes away)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
