"""Every rank stops at the same step when a stop signal reaches some of them.

A signal may reach only some ranks, or reach them at different steps; if each rank
stopped on its own, the others would wait forever in their next collective. Every
``check_every`` steps each rank contributes its flag (utils/signals.py) to an all-reduce
(MAX) over all ranks, and the result is read one step later, so the reduction itself is
never waited for (reading it on a GPU still waits for the step queued meanwhile: one
short bubble every ``check_every`` steps). Every rank reads the same result at the same
step, so all stop together.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from utils import signals


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
            return signals.received() is not None
        if self._work is not None and step >= self._read_at:
            self._work.wait()
            self._work = None
            if self._flag.item() > 0:  # host sync, once per check_every steps
                return True
        if self._work is None and step % self.check_every == 0:
            self._flag.fill_(0 if signals.received() is None else 1)
            self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group,
                                         async_op=True)
            self._read_at = step + 1
        return False

    def drain(self) -> None:
        """Finish an outstanding reduction (before the process group goes away)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
