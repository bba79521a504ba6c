"""Stop signals in one process: checkpoint at the next step, exact resume, second signal kills.
(The multi-rank agreement is tested with torchrun in test_ddp.py, Slurm in test_slurm.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from distributed.stop import StopAgreement
from tests.conftest import REPO, subprocess_env
from training.context import RunContext
from training.trainer import Callback, Trainer
from utils import signals as preemption


class SignalAt(Callback):
    """Sends this process SIGUSR1 as the step ``at`` starts."""

    def __init__(self, at: int) -> None:
        self.at = at

    def step_start(self, trainer) -> None:
        if trainer.step == self.at:
            os.kill(os.getpid(), signal.SIGUSR1)


@pytest.fixture
def handlers():
    preemption.install_handlers()
    yield
    preemption.restore_handlers()


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.model_state().items()}


def test_signal_checkpoints_at_next_step_and_resume_is_exact(cfg_factory, tmp_path, handlers):
    cfg = cfg_factory(num_iters=8)
    reference = Trainer(cfg, RunContext(torch.device("cpu"), tmp_path / "ref"), 4)
    reference.fit()

    ctx = RunContext(torch.device("cpu"), tmp_path / "run")
    first = Trainer(cfg, ctx, 4, callbacks=[SignalAt(2)])  # the signal arrives during step 2; one
    # process stops after it
    first.fit()
    assert first.stopped_early and first.step == 3
    assert preemption.received() == "SIGUSR1"
    assert torch.load(first.checkpoint_path, weights_only=False)["step"] == 3

    preemption.restore_handlers()
    preemption.install_handlers()
    second = Trainer(cfg, ctx, 4)
    second.fit()
    assert not second.stopped_early and second.step == 8
    for name, w in weights(reference).items():
        torch.testing.assert_close(weights(second)[name], w, rtol=0, atol=0, msg=name)


def test_without_a_signal_nothing_stops(cfg_factory, tmp_path, handlers):
    trainer = Trainer(cfg_factory(num_iters=3), RunContext(torch.device("cpu"), tmp_path), 4)
    trainer.fit()
    assert not trainer.stopped_early and trainer.step == 3 and preemption.received() is None


def test_check_interval_must_be_positive():
    with pytest.raises(ValueError, match="stop_check_every must be at least 1"):
        StopAgreement(torch.device("cpu"), check_every=0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_repeat_is_one_signal_and_a_later_second_kills(sig):
    """The launcher's forwarded copy (within REPEAT_WINDOW_S) counts once; a stuck run can still
    be stopped by a second signal after that."""
    code = ("import os, signal, time; from utils import signals; signals.install_handlers(); "
            f"os.kill(os.getpid(), {int(sig)}); os.kill(os.getpid(), {int(sig)}); time.sleep(0.2); "
            f"assert signals.received() == '{sig.name}'; print('survived', flush=True); "
            "time.sleep(signals.REPEAT_WINDOW_S); "
            f"os.kill(os.getpid(), {int(sig)}); time.sleep(5); print('still alive')")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=subprocess_env(),
                            capture_output=True, text=True, timeout=50)
    assert result.stdout.split() == ["survived"], result.stderr
    assert result.returncode == -sig


@pytest.mark.timeout(120)
def test_ctrl_c_checkpoints_and_exits_without_a_traceback(data_dir, tmp_path):
    from tests.ddp_helpers import run_dir, train_args, write_test_yaml

    args = train_args(write_test_yaml(tmp_path / "t.yaml"), data_dir, tmp_path / "logs",
                      num_iters=6, stop_check_every=1)
    marker = tmp_path / ".stopped-1"  # scripts/slurm_common.sh's: the batch script requeues on it
    env = subprocess_env(DDP_TEST_SIGNAL_AT="0:2", DDP_TEST_SIGNAL="INT", DDP_TEST_SIGNAL_TWICE="1",
                         TRAINING_STOPPED_FILE=str(marker))
    result = subprocess.run([sys.executable, str(REPO / "tests" / "ddp_worker.py"), *args], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=100)
    assert result.returncode == preemption.EXIT_STOPPED, result.stderr[-2000:]
    assert "Traceback" not in result.stderr + result.stdout
    assert "stop signal (SIGINT): stopping at step 3 of 6" in result.stdout
    assert torch.load(run_dir(tmp_path / "logs", 1) / "checkpoint.pt", weights_only=False)["step"] == 3
    assert marker.read_text() == "step 3\n"  # written once the checkpoint is


def test_loader_workers_survive_a_stop_signal(cfg_factory, handlers):
    """Slurm signals every process of the job: a SIGTERM reaching the DataLoader's workers
    must not break the loader, so that the training process can still checkpoint."""
    from utils.data_loader import get_data_loader

    loader, _, _ = get_data_loader(cfg_factory(num_data_workers=1), "train", 4, train=True)
    batches = iter(loader)
    next(batches)  # the worker is running
    for worker in batches._workers:
        os.kill(worker.pid, signal.SIGTERM)
    time.sleep(0.5)
    assert sum(1 for _ in batches) > 0  # without ignore_in_worker: "DataLoader worker exited unexpectedly"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_group_signal_to_a_dali_run_with_spawned_workers_checkpoints_and_resumes(data_dir, tmp_path):
    """Slurm's USR1 reaches every process of the job, DALI's workers too. On a GPU DALI spawns
    them (fresh interpreters with the default action for USR1: death); here they are spawned
    as well (with workers that die, this run hung waiting for them). The run must checkpoint
    after the signalled step, exit with the stop status, and resume to the losses of a run
    that was never stopped."""
    pytest.importorskip("nvidia.dali")
    from tests.ddp_helpers import metrics, run_dir, train_args, write_test_yaml

    yaml = write_test_yaml(tmp_path / "t.yaml")

    def train(expdir, **flags) -> subprocess.CompletedProcess:
        args = train_args(yaml, data_dir, expdir, num_iters=8, stop_check_every=4, **flags)
        return subprocess.run([sys.executable, str(REPO / "tests" / "ddp_worker.py"), *args], cwd=REPO,
                              env=subprocess_env(**signalled), capture_output=True, text=True, timeout=90,
                              start_new_session=True)  # its own process group, as a Slurm step

    signalled = {}
    reference = train(tmp_path / "ref")  # the PyTorch loader gives DALI's bits (test_dali.py)
    assert reference.returncode == 0, reference.stderr[-2000:]
    dali = {"data_loader_config": "dali", "num_data_workers": 2, "dali_start_method": "spawn"}
    signalled = {"DDP_TEST_SIGNAL_AT": "0:2", "DDP_TEST_SIGNAL_GROUP": "1"}
    first = train(tmp_path / "logs", **dali)
    assert first.returncode == preemption.EXIT_STOPPED, first.stdout[-2000:] + first.stderr[-2000:]
    assert "stop signal (SIGUSR1): stopping at step 3 of 8" in first.stdout
    signalled = {}
    second = train(tmp_path / "logs", **dali)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from" in second.stdout
    got, want = metrics(run_dir(tmp_path / "logs", 1)), metrics(run_dir(tmp_path / "ref", 1))
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for a, b in zip(got, want):
        assert (a["train_loss"], a["val_loss"]) == (b["train_loss"], b["val_loss"])
