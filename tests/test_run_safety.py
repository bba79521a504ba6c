"""Every user mistake and every rerun gets a safe outcome: one line, and nothing on disk changed.

Run-directory names and places, two runs in one folder, reruns with other settings, finished
runs, unreadable checkpoints, bad launcher variables, ranks that never meet, bad data files
and a full disk.
"""

from __future__ import annotations

import errno
import socket
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from tests.conftest import REPO, subprocess_env
from tests.ddp_helpers import run_dir, train_args, write_test_yaml
from tests.slurm_harness import free_port
from training import run_dir as rundir
from training.context import RunContext, TrainingError
from training.launcher import main
from training.trainer import Trainer
from utils.era5 import DataError, find_year_files, load_stats


@pytest.fixture
def launch(data_dir, tmp_path, capsys):
    """main() in this process: returns (exit code, last stderr line, stdout) for train.py's flags."""
    yaml = write_test_yaml(tmp_path / "t.yaml")

    def run(**flags):
        values = {"expdir": tmp_path / "logs", "data_dir": data_dir, "num_iters": 4, **flags}
        expdir, data = values.pop("expdir"), values.pop("data_dir")
        code = main(argv=train_args(yaml, data, expdir, **values))
        out = capsys.readouterr()
        err = out.err.strip().splitlines()
        return code, err[-1] if err else "", out.out

    return run


def snapshot(folder):
    return {p.relative_to(folder): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", ["..", "", "a/b", "."])
def test_a_run_name_cannot_leave_the_config_folder(launch, tmp_path, name):
    code, err, _ = launch(run_num=name)
    assert code == 2 and err.startswith("error: --run_num must be a plain folder name")
    assert not (tmp_path / "logs").exists()


def test_an_expdir_that_is_a_file(launch, tmp_path):
    (tmp_path / "afile").write_text("x")
    code, err, _ = launch(expdir=tmp_path / "afile" / "logs")
    assert code == 2 and f"{tmp_path / 'afile'} is a file, not a folder" in err


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="no /proc here")
def test_an_expdir_where_no_folder_can_be_made(launch):
    """/proc looks writable to root, but takes no new folders: one line, not a traceback."""
    code, err, _ = launch(expdir=Path("/proc/no/logs"))
    assert code == 2 and err.startswith("error: cannot create the run directory /proc/no/logs/")
    assert "/proc does not take new folders" in err


def test_a_second_run_in_the_same_folder_stops_with_the_holder(launch, tmp_path):
    folder = run_dir(tmp_path / "logs", 1)
    lock = rundir.RunLock(folder)
    lock.acquire()  # a run that is training there now
    try:
        before = snapshot(folder)
        code, err, _ = launch()
        assert code == 2 and f"{folder} is in use by pid " in err and "--run_num" in err
        assert snapshot(folder) == before  # no config.yaml, no out.log, no checkpoint
    finally:
        lock.release()
    assert launch()[0] == 0  # free again


def test_the_lock_of_a_dead_run_is_taken_over(launch, tmp_path):
    folder = run_dir(tmp_path / "logs", 1)
    folder.mkdir(parents=True)
    (folder / rundir.LOCK_NAME).write_text("pid 999999 on somehost\n")  # killed: no flock held
    code, _, out = launch()
    assert code == 0 and "took over the run directory's lock from pid 999999 on somehost" in out


def test_a_named_rerun_with_other_settings_changes_nothing(launch, tmp_path):
    assert launch(checkpoint_every=2, num_iters=2, run_num="00")[0] == 0
    folder = run_dir(tmp_path / "logs", 1)
    before = snapshot(folder)
    code, err, _ = launch(lr=0.002, seed=3, run_num="00")
    assert code == 2 and "holds a checkpoint (step 2) of a run with other settings" in err
    assert "lr 0.001 there, 0.002 now" in err and "seed 0 there, 3 now" in err
    assert snapshot(folder) == before
    code, err, _ = launch(data_dir="/nonexistent/era5")  # may change, but fails: still nothing written
    assert code == 2 and snapshot(folder) == before
    # a key that may change (how often the ranks check for a stop signal): it resumes. (Not the
    # loader's workers: their processes, left to the garbage collector of this process, took
    # 5 s each to stop in a later test)
    assert launch(stop_check_every=5)[0] == 0


def test_an_unnamed_run_with_other_settings_goes_to_the_next_free_number(launch, tmp_path):
    """A learner who gives no --run_num is never refused for a clash of settings; rerunning
    the same command finds its folder again (resumes, or does nothing when finished)."""
    assert launch(num_iters=2)[0] == 0
    first = run_dir(tmp_path / "logs", 1)
    before = snapshot(first)
    code, _, out = launch(num_iters=2, lr=0.002)
    second = run_dir(tmp_path / "logs", 1, "01")
    assert code == 0 and f"{first} holds a run with other settings; this run goes to {second}" in out
    assert snapshot(first) == before and (second / "checkpoint.pt").exists()
    code, _, out = launch(num_iters=2, seed=3)  # 00 and 01 both hold other settings
    assert code == 0 and f"this run goes to {run_dir(tmp_path / 'logs', 1, '02')}" in out
    code, _, out = launch(num_iters=2, lr=0.002)  # the second command again: its folder, finished
    assert code == 0 and f"{second} already took all 2 steps; nothing to do" in out
    assert len(list((tmp_path / "logs" / "tiny" / "1GPU").iterdir())) == 3


def test_a_finished_run_rerun_changes_nothing(launch, tmp_path):
    assert launch()[0] == 0
    folder = run_dir(tmp_path / "logs", 1)
    before = snapshot(folder)
    code, _, out = launch()
    assert code == 0 and "already took all 4 steps; nothing to do, nothing changed" in out
    assert snapshot(folder) == before  # config.yaml, events (no purge), metrics, checkpoint


def test_an_unreadable_checkpoint_is_one_line(launch, tmp_path):
    folder = run_dir(tmp_path / "logs", 1)
    folder.mkdir(parents=True)
    (folder / "checkpoint.pt").write_bytes(b"truncated")
    code, err, _ = launch()
    assert code == 2 and "cannot be read" in err and "delete it to start over" in err
    assert [p.name for p in folder.iterdir()] == ["checkpoint.pt"]


@pytest.mark.parametrize("env, message", [
    ({"RANK": "0", "WORLD_SIZE": "abc"}, "environment variable WORLD_SIZE='abc' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "the world size (WORLD_SIZE or SLURM_NTASKS) is 0"),
    ({"RANK": "3", "WORLD_SIZE": "2"}, "rank 3 (RANK or SLURM_PROCID) is outside a world of 2 ranks"),
])
def test_bad_launcher_variables_are_one_line(data_dir, tmp_path, env, message):
    args = train_args(write_test_yaml(tmp_path / "t.yaml"), data_dir, tmp_path / "logs")
    start = time.monotonic()
    result = subprocess.run([sys.executable, "train.py", *args], cwd=REPO, env=subprocess_env(**env),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [f"error: {message}"] \
        or message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and time.monotonic() - start < 30


@pytest.mark.parametrize("port_in_use", [False, True])
def test_ranks_that_never_meet_end_in_one_line(data_dir, tmp_path, port_in_use):
    """Rank 0 of 2 alone (its partner never starts), or its port taken by another program."""
    args = train_args(write_test_yaml(tmp_path / "t.yaml"), data_dir, tmp_path / "logs",
                      rendezvous_timeout_s=3)
    with socket.socket() as blocker:
        port = free_port()
        if port_in_use:
            blocker.bind(("127.0.0.1", port))
            blocker.listen()
        env = subprocess_env(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        result = subprocess.run([sys.executable, "train.py", *args], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=60)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: rank 0 of 2 could not meet the others at 127.0.0.1:{port} within 3 s")
    assert not (tmp_path / "logs").exists()


def _year(path, data, name="fields"):
    with h5py.File(path, "w") as f:
        f.create_dataset(name, data=data)


@pytest.mark.parametrize("case, message", [
    ("float64", "holds float64, not float32; convert the year files to float32"),
    ("grids", "hold different grids (2000.h5 16 x 32, 2001.h5 20 x 36)"),
])
def test_data_that_does_not_fit_is_refused(cfg_factory, tmp_path, case, message):
    (tmp_path / "train").mkdir()
    if case == "float64":
        _year(tmp_path / "train" / "2000.h5", np.zeros((3, 20, 16, 32)))
    else:
        _year(tmp_path / "train" / "2000.h5", np.zeros((3, 20, 16, 32), np.float32))
        _year(tmp_path / "train" / "2001.h5", np.zeros((3, 20, 20, 36), np.float32))
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")):
        find_year_files(tmp_path, "train", cfg_factory())


def test_a_larger_grid_is_cropped_and_said_once(cfg_factory, tmp_path, caplog):
    (tmp_path / "train").mkdir()
    for year in (2000, 2001):
        _year(tmp_path / "train" / f"{year}.h5", np.zeros((3, 20, 20, 36), np.float32))
    with caplog.at_level("INFO"):
        find_year_files(tmp_path, "train", cfg_factory())
    assert caplog.text.count("holds 20 x 36 fields; training on their top-left 16 x 32") == 1


@pytest.mark.parametrize("name, value", [("global_means", np.nan), ("global_stds", np.inf),
                                         ("global_stds", 0.0)])
def test_bad_statistics_are_refused(tmp_path, name, value):
    (tmp_path / "stats").mkdir()
    for stat in ("global_means", "global_stds"):
        np.save(tmp_path / "stats" / f"{stat}.npy", np.ones((1, 20, 1, 1), np.float32))
    bad = np.ones((1, 20, 1, 1), np.float32)
    bad[0, 3] = value
    np.save(tmp_path / "stats" / f"{name}.npy", bad)
    with pytest.raises(DataError, match="recompute the statistics"):
        load_stats(tmp_path, 20)


def test_a_full_disk_keeps_the_previous_checkpoint(cfg_factory, tmp_path, monkeypatch):
    trainer = Trainer(cfg_factory(num_iters=2), RunContext(device=torch.device("cpu"), run_dir=tmp_path), 4)
    trainer.fit()

    def full(obj, f):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(TrainingError, match="No space left on device; the previous checkpoint is kept"):
        trainer.save_checkpoint()
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=False)["step"] == 2


def test_a_file_system_without_locks_runs_unlocked(tmp_path, monkeypatch, caplog):
    import fcntl

    def no_locks(f, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    lock = rundir.RunLock(tmp_path / "run")
    with caplog.at_level("WARNING"):
        lock.acquire()  # no error: the run goes on
    assert "two runs in this folder would not be detected" in caplog.text
    lock.release()
