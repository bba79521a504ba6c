"""Which rank did not arrive: a heartbeat per rank, read when a collective gives up.

A collective waits until every rank of its group has joined it. When one rank never does (it
crashed without the launcher noticing, was stopped, hangs in I/O, or skipped the collective),
the others wait until the process group's timeout (``--collective_timeout_s``) and then fail
with the backend's message: gloo's "Timed out waiting 20000ms for recv operation" or NCCL's
watchdog timeout, neither of which says who is missing.

So every rank runs a small thread that writes, every ``PERIOD_S`` seconds, where it is (step,
phase of the step, time, host, Slurm node, pid) into the rendezvous key-value store (the TCPStore
that torchrun's agent, or rank 0, serves; a connection of its own). A rank that is stopped,
frozen or killed stops writing; a rank that is alive but somewhere else (another step,
validation) says where. When a collective fails, the rank that noticed waits until every live
rank has written again (a rank killed a moment ago, whose connections closed and failed the
collective at once, writes nothing new) and logs one line:

    rank 0 gave up at step 13 in backward (DDP's gradient all-reduce): rank 1 stopped
    responding (no sign of life for 24 s; last seen at step 13 in forward, host nid001 pid 4242)

(``node n2 (host vm)`` instead of the host where the node's name is not the host's: several
Slurm nodes on one machine, as in the tests.)

The thread costs one small store write every few seconds; ``mark`` (called by the trainer
as it moves through a step) only stores two values.

The same thread is a watchdog (:func:`deadlines`): a phase of a training step that lasts too
long is diagnosed by the heartbeat itself. On gloo the collective raises at its timeout and the
launcher logs the line; the watchdog is only a fallback. NCCL's own watchdog instead ends the
process at the timeout (``TORCH_NCCL_ASYNC_ERROR_HANDLING`` defaults to 3) before any Python
code can say anything, so on NCCL the heartbeat logs the line at ``--collective_timeout_s`` and
the process group's timeout is set ``NCCL_MARGIN_S`` later: NCCL then ends the process (and
writes its Flight Recorder dump, where the Slurm scripts ask for one).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from utils.device import node_name

log = logging.getLogger(__name__)

PERIOD_S = 2.0  # seconds between a rank's entries
STALE_S = 3 * PERIOD_S + 1  # no entry for this long: the rank is stopped or frozen
# phases of a training step: none of them can take longer than the collective timeout (a collective
# waiting that long has failed); validation and checkpoints, which can, are not watched
WATCHED = ("forward", "backward", "optimizer step", "stop check", "epoch end")
# backends whose own watchdog ends the process when a collective times out, without a Python error
ENDS_PROCESS_AT_TIMEOUT = ("nccl",)
# on those, the process group's timeout comes this long after the heartbeat's diagnosis: time to
# notice (a heartbeat), write the line (a heartbeat, then one store read per rank) and flush it
NCCL_MARGIN_S = 30.0


@dataclass(frozen=True)
class Deadlines:
    """Seconds a collective, or a watched phase of a step, may last before each thing happens."""

    process_group_s: float  # the backend gives up on the collective (init_process_group's timeout)
    report_s: float  # the heartbeat logs the diagnosis
    end_s: float  # the heartbeat ends the process (if nothing else has)
    # NCCL: collectives run on the GPU after the host has queued them, and the host may be a step
    # or more ahead of the stuck one when it notices: the step named is the latest it can be
    host_runs_ahead: bool = False


def deadlines(collective_timeout_s: float, backend: str) -> Deadlines:
    """The heartbeat's deadlines and the process group's timeout for ``--collective_timeout_s``.

    gloo raises at the timeout and the launcher names the missing rank; the heartbeat reports and
    ends the process two heartbeats later, in case the collective never returns (torch 2.8's DDP
    on gloo). NCCL ends the process at its timeout: the heartbeat reports at the timeout, NCCL
    gives up ``NCCL_MARGIN_S`` later, and the heartbeat ends the process only if NCCL has not."""
    late = 2 * PERIOD_S
    if any(name in backend for name in ENDS_PROCESS_AT_TIMEOUT):
        return Deadlines(collective_timeout_s + NCCL_MARGIN_S, collective_timeout_s,
                         collective_timeout_s + NCCL_MARGIN_S + late, host_runs_ahead=True)
    return Deadlines(collective_timeout_s, collective_timeout_s + late, collective_timeout_s + late)


class Heartbeat:
    """This rank's entry in the store, written every ``period_s`` by a daemon thread."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, prefix: str,
                 period_s: float = PERIOD_S, limits: Deadlines | None = None) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.prefix, self.period_s = prefix, period_s
        self.step, self.phase = 0, "start-up"
        self.collectives: dict[str, str] = {}  # phase -> the collectives it runs in this layout
        # the watchdog: a step phase that lasts longer than limits.report_s is diagnosed, one that
        # lasts longer than limits.end_s ends the process (see watch); None: no watchdog
        self.limits, self.changed, self.first_step = limits, time.monotonic(), None
        self.reporting = False  # a diagnosis is being written: the watchdog stands down
        self.reported: float | None = None  # the phase (its start) the watchdog has diagnosed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        # torchrun starts its ranks in sessions of their own: killed, it leaves them running on
        # (and, waiting for each other, they would never end); the heartbeat watches for it
        self.launcher = os.getppid() if os.environ.get("TORCHELASTIC_RUN_ID") else None

    def start(self) -> Heartbeat:
        self._write()
        self._thread.start()
        return self

    def mark(self, step: int, phase: str) -> None:
        self.step, self.phase, self.changed = step, phase, time.monotonic()
        if self.first_step is None:
            self.first_step = step

    def where(self, step: int, phase: str) -> str:
        what = self.collectives.get(phase)
        return f"step {step} in {phase}" + (f" ({what})" if what else "")

    def _write(self) -> None:
        entry = {"time": time.time(), "step": self.step, "phase": self.phase,
                 "host": socket.gethostname(), "node": node_name(), "pid": os.getpid()}
        self.store.set(f"{self.prefix}{self.rank}", json.dumps(entry))

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            if self.launcher is not None and os.getppid() != self.launcher:
                self.launcher_gone()
            try:
                self._write()
            except Exception:  # the store went away (the job is ending, or torchrun with it)
                if self.launcher is not None and not self._stop.wait(self.period_s) \
                        and os.getppid() != self.launcher:
                    self.launcher_gone()
                return
            if self.stuck():
                self.watch()

    def launcher_gone(self) -> None:
        """torchrun died (killed, or its node lost it): this rank ends at once, in one line. Its
        last checkpoint is whole (they are written atomically), so the run can be started again."""
        log.error("rank %d: its launcher (torchrun, pid %d) is gone: stopping at step %d; the last "
                  "checkpoint written is complete", self.rank, self.launcher, self.step)
        for handler in logging.getLogger().handlers:  # flushed, not closed: other threads may log
            handler.flush()
        os._exit(1)

    def stuck(self) -> bool:
        """Whether this rank has been in one phase of a training step for longer than the watchdog
        allows. The process group's timeout should have ended the collective before; on some
        torch versions it does not (torch 2.8's DDP on gloo waits for a frozen peer for ever).
        The first step of a process is not watched (compilation may take minutes)."""
        return (self.limits is not None and not self.reporting and self.phase in WATCHED
                and self.first_step is not None and self.step > self.first_step
                and time.monotonic() - self.changed > self.limits.report_s)

    def watch(self) -> None:
        """A phase has lasted too long: the diagnosis line, once per phase; then, past the end
        deadline, the process ends (the launcher stops the rest)."""
        changed, limits = self.changed, self.limits
        if self.reported != changed:
            line = self.diagnosis()
            waited = time.monotonic() - changed
            if waited < limits.end_s:  # NCCL: its watchdog ends the process at its timeout
                log.error("%s (no progress for %.0f s; the process group times out in %.0f s)", line,
                          waited, max(0.0, limits.process_group_s - waited))
            else:
                log.error("%s (no progress for %.0f s, longer than the collective timeout: the "
                          "collective did not end by itself)", line, waited)
            for handler in logging.getLogger().handlers:
                handler.flush()
            self.reported, self.reporting = changed, False
        if time.monotonic() - changed >= limits.end_s:
            logging.shutdown()
            os._exit(1)

    def stop(self) -> None:
        self._stop.set()

    def others(self, read_timeout_s: float = 5.0, ranks: list[int] | None = None
               ) -> dict[int, dict[str, Any] | None]:
        """Every other rank's last entry, or those of ``ranks`` (None: it never wrote one, or the
        store did not answer)."""
        self.store.set_timeout(datetime.timedelta(seconds=read_timeout_s))
        entries: dict[int, dict[str, Any] | None] = {}
        for r in range(self.world_size) if ranks is None else ranks:
            if r == self.rank:
                continue
            try:
                entries[r] = json.loads(self.store.get(f"{self.prefix}{r}"))
            except Exception:
                entries[r] = None
        return entries

    def diagnosis(self, now: float | None = None) -> str:
        """One line: where this rank gave up, and which ranks did not arrive and where they are
        (never raises: the diagnosis must not hide the error it explains)."""
        self.reporting = True
        try:
            return self._diagnosis(now)
        except Exception as err:
            return f"rank {self.rank}: no diagnosis ({type(err).__name__}: {err})"

    def _diagnosis(self, now: float | None) -> str:
        me = f"rank {self.rank} gave up at {self.where(self.step, self.phase)}"
        ahead = self.limits is not None and self.limits.host_runs_ahead
        note = (" (the stuck collective is of that step or an earlier one: the host queues NCCL's "
                "collectives ahead of the GPU; the Flight Recorder dump names it)") if ahead else ""
        first = self.others()
        entries = self._news(first)
        now = time.time() if now is None else now
        missing = []
        for r, e in sorted(entries.items()):
            if e is None:
                missing.append(f"rank {r} never reported (it did not start, or the store on rank 0 "
                               f"is not answering)")
                continue
            age = now - e["time"]
            where = f"host {e['host']}" if e.get("node", e["host"]) == e["host"] else \
                f"node {e['node']} (host {e['host']})"
            seen = f"{self.where(e['step'], e['phase'])}, {where} pid {e['pid']}"
            if age > STALE_S or e == first[r]:
                missing.append(f"rank {r} stopped responding (no sign of life for {age:.0f} s; last "
                               f"seen at {seen})")
            elif (e["step"], e["phase"]) != (self.step, self.phase):
                missing.append(f"rank {r} did not arrive: it is alive at {seen}")
        if not missing:
            return (f"{me}; every other rank is alive at the same step and phase (a collective they "
                    f"called differently, or a slow network: see docs/04-communication.md){note}")
        return f"{me}: " + "; ".join(missing) + note

    def _news(self, first: dict[int, dict[str, Any] | None]) -> dict[int, dict[str, Any] | None]:
        """Every rank's entry once each live rank has written a new one: after one period, or for
        ranks still silent then, up to three (a rank killed a moment ago, whose last entry is not
        old yet, writes none; a live one late by a busy CPU writes within them)."""
        time.sleep(self.period_s + 0.5)
        entries = self.others()
        deadline = time.monotonic() + 2 * self.period_s + 0.5
        while time.monotonic() < deadline:
            silent = [r for r, e in entries.items() if e is not None and e == first[r]]
            if not silent:
                break
            time.sleep(min(0.5, self.period_s))
            entries.update(self.others(ranks=silent))
        return entries


def collectives_by_phase(ddp: bool, fsdp: bool, zero1: bool, model_parallel: bool, pipeline: bool,
                         clipping: bool) -> dict[str, str]:
    """What each phase of a training step waits for in this layout (named in the diagnosis)."""
    def joined(*parts: str | None) -> str:
        return ", ".join(p for p in parts if p)

    split = "tensor/context-parallel collectives" if model_parallel else None
    return {
        "forward": joined("pipeline sends and receives" if pipeline else None,
                          "FSDP's all-gather of the weights" if fsdp else None, split),
        "backward": joined("FSDP's all-gather and gradient reduce-scatter" if fsdp else None,
                           "DDP's gradient all-reduce" if ddp else None, split),
        "optimizer step": joined("the gradient norm's all-reduce" if clipping else None,
                                 "ZeRO-1's parameter broadcast" if zero1 else None),
        "stop check": "the stop-signal all-reduce",
        "epoch end": "the training loss all-reduce",
        "validation": "the validation metrics' all-reduce",
        "checkpoint": "the checkpoint's gathers",
    }


def start(master_addr: str, master_port: int, rank: int, world_size: int,
          limits: Deadlines | None = None) -> Heartbeat | None:
    """Start this rank's heartbeat on its own connection to the rendezvous store (a failure to
    connect only costs the diagnosis: logged, never fatal); with ``limits``, its watchdog."""
    try:
        store = dist.TCPStore(master_addr, master_port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    except Exception as err:
        log.warning("no heartbeat (the store at %s:%d: %s); a hang will not be diagnosed",
                    master_addr, master_port, str(err).splitlines()[0] if str(err) else type(err).__name__)
        return None
    # a restart under torchrun (--max_restarts) must not read the previous attempt's entries
    prefix = f"era5_heartbeat/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    return Heartbeat(store, rank, world_size, prefix, limits=limits).start()
