"""train.py with fault injection, for the distributed tests (launched by torchrun).

Environment variables (all optional):
  DDP_TEST_RAISE_AT=R:S   rank R raises RuntimeError in its step S (0-based)
  DDP_TEST_NAN_AT=R:S     rank R reports a NaN loss for its step S (its gradients stay finite)
  DDP_TEST_SIGNAL_AT=R:S  rank R sends itself SIGUSR1 during its step S
  DDP_TEST_SIGNAL=INT     ... that signal instead (TERM, INT, USR1, USR2)
  DDP_TEST_SIGNAL_TWICE=1 ... twice in a row, as a launcher forwarding a group signal does
  DDP_TEST_SIGNAL_GROUP=1 ... to its whole process group (loader workers included)
  DDP_TEST_MODEL_PARALLEL=1  run as train_mp.py (model-parallel sizes allowed)
  DDP_TEST_READONLY=DIR   every rank but 0 fails if it opens a file under DIR for writing
  DDP_TEST_EXIT_AT=R:S    rank R exits at once (status 1, nothing cleaned up) in its step S, in the
                          first attempt only (torchrun's TORCHELASTIC_RESTART_COUNT 0)
  DDP_TEST_FREEZE_AT=R:S  rank R stops itself (SIGSTOP) in the backward of its step S, while DDP's
                          gradient all-reduce runs: frozen, as a rank on a failing node is
  DDP_TEST_DIE_BEFORE_LATEST=S  the process dies when its sharded checkpoint of step S is on
                          disk but not yet named by LATEST (a save killed midway)
  DDP_TEST_TRACE=S:PATH   every rank writes to PATH.rankR the repository's files whose functions
                          its step S calls (tests/test_spine.py)
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from training.launcher import main  # noqa: E402
from training.trainer import Callback  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))


def _at(name: str) -> int | None:
    """The step at which this rank should misbehave, from NAME=rank:step."""
    value = os.environ.get(name)
    if not value:
        return None
    rank, step = value.split(":")
    return int(step) if int(rank) == RANK else None


def forbid_writes_under(root: str) -> None:
    """Make any open-for-writing below ``root`` raise (an audit hook sees every open())."""
    root = os.path.realpath(root)

    def hook(event: str, args: tuple) -> None:
        if event != "open" or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        path, mode, flags = args
        writing = (mode is not None and any(c in mode for c in "wax+")) or \
            (mode is None and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        if writing and os.path.realpath(os.fsdecode(path)).startswith(root):
            raise PermissionError(f"rank {RANK} tried to write {path}")

    sys.addaudithook(hook)


class Faults(Callback):
    raise_at = _at("DDP_TEST_RAISE_AT")
    nan_at = _at("DDP_TEST_NAN_AT")
    signal_at = _at("DDP_TEST_SIGNAL_AT")
    freeze_at = _at("DDP_TEST_FREEZE_AT")
    exit_at = _at("DDP_TEST_EXIT_AT") if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" else None

    def inject(self, trainer) -> None:
        if trainer.step == self.exit_at:
            os._exit(1)
        if trainer.step == self.freeze_at:  # the first parameter's gradient is among the last in backward
            first = next(trainer.model.parameters())
            first.register_post_accumulate_grad_hook(lambda p: os.kill(os.getpid(), signal.SIGSTOP))
        if trainer.step == self.raise_at:
            raise RuntimeError(f"injected failure on rank {RANK} at step {trainer.step}")
        if trainer.step == self.signal_at:
            sig = signal.Signals["SIG" + os.environ.get("DDP_TEST_SIGNAL", "USR1")]
            for _ in range(2 if os.environ.get("DDP_TEST_SIGNAL_TWICE") else 1):
                if os.environ.get("DDP_TEST_SIGNAL_GROUP"):  # as Slurm does: every process of the job
                    os.killpg(os.getpgrp(), sig)
                else:
                    os.kill(os.getpid(), sig)

    trace = os.environ.get("DDP_TEST_TRACE", "").split(":", 1)

    def step_start(self, trainer) -> None:
        self.inject(trainer)
        if len(self.trace) == 2 and trainer.step == int(self.trace[0]):
            self.called: set[str] = set()
            sys.setprofile(project_calls(self.called))

    fit_end_file = os.environ.get("DDP_TEST_FIT_END")

    def fit_end(self, trainer) -> None:
        if self.fit_end_file:  # a line per rank each time a run ends (tests/test_freezing.py)
            with open(self.fit_end_file, "a") as f:
                f.write(f"rank {RANK} step {trainer.step}\n")

    def step_end(self, trainer, loss: torch.Tensor) -> torch.Tensor | None:
        if len(self.trace) == 2 and trainer.step == int(self.trace[0]):
            sys.setprofile(None)
            Path(f"{self.trace[1]}.rank{RANK}").write_text("\n".join(sorted(self.called)))
        if trainer.step == self.nan_at:
            return torch.full_like(loss, float("nan"))
        return None


def project_calls(seen: set[str]):
    """A sys.setprofile function adding to ``seen`` the repository file (relative path) of every
    Python function called, the tests' and the installed packages' left out."""
    root = str(Path(__file__).resolve().parents[1]) + "/"

    def profile(frame, event, arg) -> None:
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(root) and "/.venv" not in name and "/tests/" not in name:
            seen.add(name[len(root):])

    return profile


def die_before_latest(step: int) -> None:
    from utils import checkpoint

    write = checkpoint.write_text_atomic

    def dying_write(path, text: str) -> None:
        if text == f"step_{step:08d}":
            os._exit(1)
        write(path, text)

    checkpoint.write_text_atomic = dying_write


if __name__ == "__main__":
    if os.environ.get("DDP_TEST_DIE_BEFORE_LATEST"):
        die_before_latest(int(os.environ["DDP_TEST_DIE_BEFORE_LATEST"]))
    if RANK != 0 and os.environ.get("DDP_TEST_READONLY"):
        forbid_writes_under(os.environ["DDP_TEST_READONLY"])
    sys.exit(main(callbacks=[Faults()], description="train.py with fault injection",
                  model_parallel=os.environ.get("DDP_TEST_MODEL_PARALLEL") == "1"))
