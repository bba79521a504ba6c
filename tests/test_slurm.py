"""The submit scripts, submitted to a real single-node Slurm that this module starts.

Needs root and apt (or Slurm already installed); skipped with the reason otherwise. The
jobs train the conftest test model on CPU for a few steps; every wait has a timeout.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.conftest import REPO, subprocess_env
from tests.ddp_helpers import metrics, run_dir, train_args, write_test_yaml
from tests.slurm_harness import SlurmCluster, SlurmUnavailableError, local_cluster

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240), pytest.mark.xdist_group("slurm")]  # one cluster

JOB_TIMEOUT = 120  # seconds; these jobs take 5-20 s here


@pytest.fixture(scope="module")
def slurm():
    try:
        with local_cluster(nodes=1) as cluster:
            yield cluster
    except SlurmUnavailableError as err:
        pytest.skip(f"no local Slurm: {err}")


@pytest.fixture(scope="module")
def test_yaml(tmp_path_factory) -> Path:
    return write_test_yaml(tmp_path_factory.mktemp("slurm_yaml") / "ViT.yaml")


def submit(slurm: SlurmCluster, script: str, args: list[str], tmp_path: Path, options=(), **env) -> str:
    """sbatch from the repository's top folder (as users do), job output into tmp_path."""
    return slurm.sbatch(REPO / script, args, ["-o", f"{tmp_path}/%x-%j.out", *options], cwd=REPO,
                        env=subprocess_env(fast_start=False, **env))


def job_output(tmp_path: Path, job: str) -> str:
    return next(tmp_path.glob(f"*-{job}.out")).read_text()


def test_signal_checkpoints_and_requeued_job_resumes(slurm, data_dir, test_yaml, tmp_path):
    """`scancel --signal=USR1` is what `#SBATCH --signal=USR1@90` sends before the time limit.
    With REQUEUE=1 the job goes back to the queue, runs again and resumes from the checkpoint.
    DATADIR and LOGDIR come from the environment; every script argument reaches train.py. (One
    rank here; submit_pm_dp.sh's ranks over gloo, on two nodes: test_slurm_nodes.py; ranks that
    disagree about the signal: test_ddp.py.)"""
    num_iters = 27  # 3 epochs: the signal (sent as training starts) arrives long before the end
    logdir = tmp_path / "logs"
    args = train_args(test_yaml, None, None, num_iters=num_iters, stop_check_every=2, run_num="args_passed")
    job = submit(slurm, "submit_pm.sh", args, tmp_path, ["-n", "1"], REQUEUE="1", DATADIR=str(data_dir),
                 LOGDIR=str(logdir))
    run = run_dir(logdir, 1, "args_passed")
    log_file = run / "out.log"
    deadline = time.monotonic() + JOB_TIMEOUT
    while not (log_file.exists() and "steps per epoch" in log_file.read_text()):
        assert time.monotonic() < deadline, "training did not start"
        assert slurm.job(job).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), \
            job_output(tmp_path, job)[-3000:]
        time.sleep(0.1)
    slurm.signal(job, "USR1")
    info = slurm.wait(job, JOB_TIMEOUT, restarts=1)
    log_text, out = log_file.read_text(), job_output(tmp_path, job)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), \
        log_text[-2000:] + out[-3000:]
    stopped = [line for line in log_text.splitlines() if "stopping at step" in line]
    assert len(stopped) == 1 and "stop signal (SIGUSR1)" in stopped[0]
    step = int(stopped[0].split("stopping at step ")[1].split()[0])
    assert 0 < step < num_iters
    assert f"at step {step}" in next(line for line in log_text.splitlines() if "resumed from" in line)
    assert metrics(run)[-1]["step"] == num_iters
    assert f"num_iters: {num_iters}" in (run / "config.yaml").read_text()
    assert "config tiny on cpu, 1 rank(s)" in log_text  # fake GPUs: CUDA_VISIBLE_DEVICES, no CUDA
    # the script echoes its srun line: the batch allocation's CPUs per task passed on, bound
    assert "srun --kill-on-bad-exit=1 -u -c 32 --cpu-bind=cores" in out


def test_a_stopped_job_is_requeued_though_srun_reports_a_killed_rank(slurm, tmp_path):
    """With --kill-on-bad-exit, the first rank to exit 75 makes srun kill the others, and srun's
    status is then their kill's; rank 0's marker (every rank stopped after the checkpoint) still
    puts the job back in the queue. The job asks for --requeue, as the submit scripts do."""
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\nREPO={REPO}\nsource $REPO/scripts/slurm_common.sh\n"
                      f"run_training tests/slurm_stop_entry.py\n")
    options = ["-o", f"{tmp_path}/%x-%j.out", "-n", "2", "--requeue", "--open-mode=append"]
    env = subprocess_env(fast_start=False, REQUEUE="1", NATIVE="1", LOGDIR=str(tmp_path / "logs"))
    job = slurm.sbatch(script, [], options, cwd=REPO, env=env)
    info = slurm.wait(job, JOB_TIMEOUT, restarts=1)
    out = job_output(tmp_path, job)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), out[-3000:]
    assert f"requeueing job {job}" in out and "requeued run done" in out, out[-3000:]
    # srun's own status is the killed rank's (143 here): the marker is what requeued the job
    assert "srun returned 1" in out and "but training stopped on a signal with a checkpoint (step 3)" in out


def test_srun_gives_its_tasks_the_steps_gpus_whatever_the_batch_script_exported(slurm, tmp_path):
    """Why scripts/slurm_common.sh binds each task's CPUs to its GPU instead of renumbering the
    GPUs (as SC23's scripts did with CUDA_VISIBLE_DEVICES=3,2,1,0): srun sets the variable for
    every step's tasks itself, so an exported value never reaches them. (Fake GPU devices here.)"""
    script = tmp_path / "gpus.sh"
    script.write_text("#!/bin/bash\nexport CUDA_VISIBLE_DEVICES=3,2,1,0\n"
                      "srun bash -c 'echo all $SLURM_LOCALID $CUDA_VISIBLE_DEVICES'\n"
                      "srun --gpus-per-task=1 bash -c 'echo own $SLURM_LOCALID $CUDA_VISIBLE_DEVICES'\n")
    options = ["-n", "2", "-c", "2", "--gpus-per-node", "4", "-o", f"{tmp_path}/%x-%j.out"]
    job = slurm.sbatch(script, [], options, cwd=tmp_path, env=subprocess_env(gpus=True, fast_start=False))
    info = slurm.wait(job, JOB_TIMEOUT)
    out = job_output(tmp_path, job)
    assert info["JobState"] == "COMPLETED", out
    lines = sorted(line for line in out.splitlines() if line.startswith(("all ", "own ")))
    assert lines == ["all 0 0,1,2,3", "all 1 0,1,2,3", "own 0 0", "own 1 1"], out


def test_profiling_without_nsys_is_a_one_line_error(slurm, data_dir, tmp_path):
    job = submit(slurm, "submit_pm.sh", ["--config=tiny"], tmp_path, ["-n", "1"], DATADIR=str(data_dir),
                 ENABLE_PROFILING="1", PROFILE_OUTPUT="p", PATH="/usr/bin:/bin")
    info = slurm.wait(job, JOB_TIMEOUT)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0")
    assert "error: ENABLE_PROFILING=1 needs Nsight Systems (nsys) on PATH" in job_output(tmp_path, job)


def test_a_missing_data_folder_fails_the_job_in_one_line_before_srun(slurm, tmp_path):
    job = submit(slurm, "submit_pm.sh", ["--config=tiny"], tmp_path, ["-n", "1"],
                 DATADIR=str(tmp_path / "purged"))
    info = slurm.wait(job, JOB_TIMEOUT)
    out = job_output(tmp_path, job)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0"), out[-2000:]
    assert f"error: DATADIR={tmp_path / 'purged'} has no train/ folder" in out and "+ srun" not in out
