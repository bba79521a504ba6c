"""Nothing is lost: NaNs never reach a checkpoint, and a run interrupted at any step of an
epoch (the last included), or during validation, resumes exactly as if it had not stopped."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.conftest import make_cfg
from training.context import RunContext, TrainingError
from training.trainer import Trainer
from utils import checkpoint as ckpt
from utils import signals

STEPS_PER_EPOCH = 4  # 16 samples, batch 4
NUM_ITERS = 8


class KilledError(BaseException):
    """Stands for SIGKILL: nothing after it runs (not an Exception, so nothing catches it)."""


def make_trainer(cfg, run_dir):
    return Trainer(cfg, RunContext(device=torch.device("cpu"), run_dir=run_dir), cfg.global_batch_size)


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


SHORT = dict(limit_nsamples=16, num_iters=NUM_ITERS, checkpoint_every=1, dropout=0.1)


@pytest.fixture
def short_cfg(cfg_factory):
    def make(**overrides):
        return cfg_factory(**{**SHORT, **overrides})

    return make


@pytest.fixture(scope="module")
def straight(data_dir, tmp_path_factory):
    """The uninterrupted run, once for every test of this file that compares with it."""
    folder = tmp_path_factory.mktemp("straight")
    make_trainer(make_cfg(data_dir, folder / "logs", **SHORT), folder / "run").fit()
    return metrics(folder / "run")


def assert_same_run(straight, run_dir):
    resumed = metrics(run_dir)
    assert [r["step"] for r in resumed] == [r["step"] for r in straight] == [4, 8]
    for a, b in zip(straight, resumed):
        assert (a["train_loss"], a["val_loss"]) == (b["train_loss"], b["val_loss"])


@pytest.mark.parametrize("die_at", range(1, NUM_ITERS))
def test_a_kill_at_any_step_resumes_exactly(short_cfg, straight, tmp_path, die_at):
    """Killed when step ``die_at`` starts, with a checkpoint after every step (the epoch's last
    step's after its validation)."""
    cfg = short_cfg()
    run_dir = tmp_path / "run"
    first = make_trainer(cfg, run_dir)
    step = first.train_step

    def die(inp, tar):
        if first.step == die_at:
            raise KilledError
        return step(inp, tar)

    first.train_step = die
    with pytest.raises(KilledError):
        first.fit()
    (run_dir / f".{ckpt.CHECKPOINT_NAME}.tmp-4242").write_bytes(b"half")  # a killed save's leftover
    make_trainer(cfg, run_dir).fit()
    assert_same_run(straight, run_dir)
    assert not list(run_dir.glob(".*.tmp-*"))


def test_a_kill_during_validation_resumes_exactly(short_cfg, straight, tmp_path):
    cfg = short_cfg()
    run_dir = tmp_path / "run"
    first = make_trainer(cfg, run_dir)
    first.validate = lambda: (_ for _ in ()).throw(KilledError())
    with pytest.raises(KilledError):
        first.fit()
    make_trainer(cfg, run_dir).fit()
    assert_same_run(straight, run_dir)


def test_lines_of_the_attempt_that_died_are_dropped(short_cfg, straight, tmp_path):
    """Checkpoint every 3 steps: the epoch line of step 4 is logged, then a kill at step 5 sends
    the run back to step 3; the line must not appear twice."""
    cfg = short_cfg(checkpoint_every=3)
    run_dir = tmp_path / "run"
    first = make_trainer(cfg, run_dir)
    step = first.train_step
    first.train_step = lambda inp, tar: (_ for _ in ()).throw(KilledError()) if first.step == 5 \
        else step(inp, tar)
    with pytest.raises(KilledError):
        first.fit()
    assert [r["step"] for r in metrics(run_dir)] == [4]
    make_trainer(cfg, run_dir).fit()
    assert_same_run(straight, run_dir)


@pytest.mark.parametrize("signal_at", range(1, NUM_ITERS))
def test_a_stop_signal_at_any_step_resumes_exactly(short_cfg, straight, tmp_path, signal_at, monkeypatch):
    cfg = short_cfg(checkpoint_every=0, stop_check_every=1)
    run_dir = tmp_path / "run"
    first = make_trainer(cfg, run_dir)
    step = first.train_step

    def signalled(inp, tar):
        if first.step == signal_at - 1:
            monkeypatch.setattr(signals, "_received", 15)  # SIGTERM arrived during this step
        return step(inp, tar)

    first.train_step = signalled
    first.fit()
    assert first.stopped_early and first.step == signal_at
    monkeypatch.setattr(signals, "_received", None)
    make_trainer(cfg, run_dir).fit()
    assert_same_run(straight, run_dir)


def test_a_nan_never_replaces_the_last_good_checkpoint(short_cfg, tmp_path):
    """A NaN sample in step 3 of an 8-step epoch (checkpoints every 2 steps): the step-2
    checkpoint stays, and the run stops at step 4 with a line that names the step."""
    cfg = short_cfg(checkpoint_every=2, dropout=0.0, limit_nsamples=32)
    run_dir = tmp_path / "run"
    trainer = make_trainer(cfg, run_dir)
    step = trainer.train_step
    trainer.train_step = lambda inp, tar: step(inp.fill_(math.nan) if trainer.step == 2 else inp, tar)
    with pytest.raises(TrainingError, match=r"at step 4 is not finite .*the last good checkpoint .* is kept"):
        trainer.fit()
    state = ckpt.load(run_dir / ckpt.CHECKPOINT_NAME)
    assert state["step"] == 2 and math.isfinite(state["epoch_loss_sum"])
    assert all(torch.isfinite(t).all() for t in state["model"].values())


def test_rerunning_a_finished_run_changes_nothing(short_cfg, tmp_path):
    cfg = short_cfg()
    run_dir = tmp_path / "run"
    make_trainer(cfg, run_dir).fit()
    before = {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()}
    sizes = {p.name: p.stat().st_size for p in run_dir.iterdir()}
    again = make_trainer(cfg, run_dir)
    assert again.fit() == {} and again.step == NUM_ITERS
    assert {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()} == before
    assert {p.name: p.stat().st_size for p in run_dir.iterdir()} == sizes  # TensorBoard not purged
