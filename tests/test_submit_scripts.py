"""scripts/slurm_common.sh without a cluster: what it would start, with srun, nsys and shifter faked.

(tests/test_slurm.py runs the scripts on a real local Slurm; these check the command lines
that only Perlmutter would run.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, subprocess_env


def fake(bin_dir: Path, name: str, log: Path, status: int = 0) -> None:
    """An executable that appends its arguments, one line per call, to ``log``."""
    script = bin_dir / name
    script.write_text(f'#!/bin/bash\necho "{name} $*" >> {log}\nexit {status}\n')
    script.chmod(0o755)


def run_training(tmp_path: Path, entry: str, with_shifter: bool, **env: str) -> list[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "calls.log"
    for name in ("srun", "nsys") + (("shifter",) if with_shifter else ()):
        fake(bin_dir, name, log)
    (tmp_path / "data" / "train").mkdir(parents=True, exist_ok=True)
    environ = subprocess_env(PATH=f"{bin_dir}:{os.environ['PATH']}", LOGDIR=str(tmp_path / "logs"),
                             SLURM_JOB_ID="123", DATADIR=str(tmp_path / "data"), **env)
    script = f'REPO={REPO}; source scripts/slurm_common.sh && run_training {entry} --config tiny'
    result = subprocess.run(["bash", "-c", script], cwd=REPO, env=environ, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize("entry, graph_trace", [("train_graph.py", True), ("train.py", False)])
def test_nsys_traces_graph_nodes_for_graph_runs(tmp_path, entry, graph_trace):
    calls = run_training(tmp_path, entry, with_shifter=False, ENABLE_PROFILING="1")
    srun = [c for c in calls if c.startswith("srun ")]
    assert len(srun) == 1 and " nsys profile " in srun[0] and "-c cudaProfilerApi" in srun[0]
    assert ("--cuda-graph-trace=node" in srun[0]) == graph_trace


def test_the_container_is_a_supported_nersc_image_with_the_nccl_plugin(tmp_path):
    calls = run_training(tmp_path, "train.py", with_shifter=True)
    image = "shifter --image=nersc/pytorch:25.06.01 --module=gpu,nccl-plugin"
    # first the versions line (once, in the container), then the training step
    assert calls[0].startswith(image) and calls[0].endswith("python scripts/versions.py")
    assert calls[1].startswith(f"srun --kill-on-bad-exit=1 -u {image} --volume=")
    calls = run_training(tmp_path / "other", "train.py", with_shifter=True, IMAGE="my/torch:2.11")
    assert calls[-1].startswith("srun --kill-on-bad-exit=1 -u shifter --image=my/torch:2.11 ")


def test_versions_are_printed_before_training_natively(tmp_path):
    calls = run_training(tmp_path, "train.py", with_shifter=False)
    assert [c.split()[0] for c in calls] == ["srun"]  # versions.py ran with the venv's python
    result = subprocess.run([sys.executable, "scripts/versions.py"], cwd=REPO,
                            env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("environment: torch ")


def test_srun_gets_the_allocations_cpus_per_task(tmp_path):
    """Slurm 22.05+: srun does not inherit --cpus-per-task; the script passes it on, bound."""
    calls = run_training(tmp_path, "train.py", with_shifter=False, SLURM_CPUS_PER_TASK="32")
    assert calls[-1].startswith("srun --kill-on-bad-exit=1 -u -c 32 --cpu-bind=cores ")
    calls = run_training(tmp_path / "none", "train.py", with_shifter=False)  # no -c in the job
    assert calls[-1].startswith("srun --kill-on-bad-exit=1 -u bash ")


def test_perlmutter_binds_each_task_to_its_gpus_numa_domain(tmp_path):
    """A whole Perlmutter node: local rank i takes GPU i, which is attached to NUMA domain 3 - i,
    so task i is bound there; the GPUs are not renumbered (srun resets CUDA_VISIBLE_DEVICES,
    tests/test_slurm.py). A shared node (one GPU) or another cluster: cores of its own."""
    node = {"NERSC_HOST": "perlmutter", "SLURM_CPUS_PER_TASK": "32", "SLURM_GPUS_ON_NODE": "4",
            "SLURM_NTASKS_PER_NODE": "4"}
    calls = run_training(tmp_path, "train.py", with_shifter=False, **node)
    assert calls[-1].startswith("srun --kill-on-bad-exit=1 -u -c 32 --cpu-bind=map_ldom:3,2,1,0 ")
    script = f'REPO={REPO}; source scripts/slurm_common.sh && echo "$CUDA_VISIBLE_DEVICES"'
    res = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env=subprocess_env(gpus=True, CUDA_VISIBLE_DEVICES="0,1,2,3", **node))
    assert res.stdout.strip() == "0,1,2,3"  # as Slurm set it
    for other in ({"SLURM_GPUS_ON_NODE": "1", "SLURM_NTASKS_PER_NODE": "1"}, {"NERSC_HOST": "muller"}):
        calls = run_training(tmp_path / str(len(other)), "train.py", with_shifter=False, **{**node, **other})
        assert calls[-1].startswith("srun --kill-on-bad-exit=1 -u -c 32 --cpu-bind=cores ")


def test_native_runs_even_where_shifter_exists(tmp_path):
    calls = run_training(tmp_path, "train.py", with_shifter=True, NATIVE="1")
    assert len(calls) == 1 and "shifter" not in calls[0] and f"{sys.executable} train.py" in calls[0]


def test_a_logdir_that_cannot_be_made_is_one_line_before_srun(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake(bin_dir, "srun", tmp_path / "calls.log")
    (tmp_path / "afile").write_text("x")
    for logdir in ("/proc/no/logs", str(tmp_path / "afile" / "logs")):
        environ = subprocess_env(PATH=f"{bin_dir}:{os.environ['PATH']}", LOGDIR=logdir)
        script = f"REPO={REPO}; source scripts/slurm_common.sh && run_training train.py --config tiny"
        result = subprocess.run(["bash", "-c", script], cwd=REPO, env=environ, capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 2
        assert result.stderr.strip() == (f"error: cannot create LOGDIR={logdir}; set LOGDIR to a "
                                         f"folder you can write")
    assert not (tmp_path / "calls.log").exists()  # srun never started


def test_a_missing_data_folder_is_one_line_before_srun(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake(bin_dir, "srun", tmp_path / "calls.log")
    environ = subprocess_env(PATH=f"{bin_dir}:{os.environ['PATH']}", LOGDIR=str(tmp_path / "logs"),
                             DATADIR=str(tmp_path / "purged"))
    script = f"REPO={REPO}; source scripts/slurm_common.sh && run_training train.py --config tiny"
    result = subprocess.run(["bash", "-c", script], cwd=REPO, env=environ, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().startswith(f"error: DATADIR={tmp_path / 'purged'} has no train/ folder; set "
                                            f"DATADIR to your ERA5 folder"), result.stderr
    assert not (tmp_path / "calls.log").exists()  # srun never started


def test_a_stop_reported_as_another_ranks_kill_is_requeued(tmp_path):
    """With --kill-on-bad-exit, the first rank to exit 75 makes srun kill the others, and srun
    returns 137; rank 0's marker says every rank stopped after the checkpoint: the job requeues."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    (bin_dir / "srun").write_text('#!/bin/bash\necho "step 12" > "$TRAINING_STOPPED_FILE"\nexit 137\n')
    (bin_dir / "srun").chmod(0o755)
    fake(bin_dir, "scontrol", log)
    (tmp_path / "data" / "train").mkdir(parents=True)
    environ = subprocess_env(PATH=f"{bin_dir}:{os.environ['PATH']}", LOGDIR=str(tmp_path / "logs"),
                             DATADIR=str(tmp_path / "data"), SLURM_JOB_ID="123", REQUEUE="1", NATIVE="1")
    script = f"REPO={REPO}; source scripts/slurm_common.sh && run_training train.py --config tiny"
    result = subprocess.run(["bash", "-c", script], cwd=REPO, env=environ, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "srun returned 137, but training stopped on a signal with a checkpoint (step 12)" in result.stdout
    assert [c for c in log.read_text().splitlines() if "requeue" in c] == ["scontrol requeue 123"]
    assert not (tmp_path / "logs" / ".stopped-123").exists()
    environ["REQUEUE"] = "0"  # without REQUEUE the job ends with the stop's status
    result = subprocess.run(["bash", "-c", script], cwd=REPO, env=environ, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 75 and log.read_text().count("requeue") == 1


def test_the_submit_scripts_requeue_and_append_their_log_under_logs():
    for name in ("submit_pm.sh", "submit_pm_dp.sh", "submit_pm_mp.sh"):
        text = (REPO / name).read_text()
        assert "#SBATCH --requeue" in text and "#SBATCH --open-mode=append" in text, name
        assert "#SBATCH -o logs/%x-%j.out" in text, name
    assert (REPO / "logs" / ".gitkeep").is_file()  # Slurm opens the log before the job runs


@pytest.mark.parametrize("with_shifter", [True, False])
def test_nccls_flight_recorder_dumps_into_the_logs(tmp_path, with_shifter):
    """Every rank keeps its last 2000 collectives and writes them, when NCCL's watchdog times one
    out, into a folder of the job under LOGDIR (/logs in the container), made before srun."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    seen = tmp_path / "srun_env"
    (bin_dir / "srun").write_text(f"#!/bin/bash\nenv | grep -E '^TORCH_(NCCL|FR)_' | sort > {seen}\n")
    (bin_dir / "srun").chmod(0o755)
    if with_shifter:
        fake(bin_dir, "shifter", tmp_path / "calls.log")
    logs = tmp_path / "logs"
    environ = subprocess_env(PATH=f"{bin_dir}:{os.environ['PATH']}", LOGDIR=str(logs), SLURM_JOB_ID="123")
    script = f'REPO={REPO}; source scripts/slurm_common.sh && run_training train.py --data_dir=/d'
    result = subprocess.run(["bash", "-c", script], cwd=REPO, env=environ, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    prefix = ("/logs" if with_shifter else str(logs)) + "/flight_recorder/123/rank_"
    assert seen.read_text().splitlines() == [
        "TORCH_FR_DUMP_TEMP_FILE=" + prefix, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE=" + prefix,
        "TORCH_NCCL_DUMP_ON_TIMEOUT=1", "TORCH_NCCL_TRACE_BUFFER_SIZE=2000"]
    assert (logs / "flight_recorder" / "123").is_dir()


def test_srun_pm_runs_a_script_by_hand_in_the_submit_scripts_container(tmp_path):
    """Inside salloc, `bash srun_pm.sh SCRIPT ...` starts what the submit scripts start: srun with the
    container, /data and /logs mounted (a bare `srun python train.py --config short` has neither)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    for name in ("srun", "shifter"):
        fake(bin_dir, name, log)
    environ = subprocess_env(PATH=f"{bin_dir}:{os.environ['PATH']}", LOGDIR=str(tmp_path / "logs"),
                             DATADIR="/my/era5", SLURM_JOB_ID="7", SLURM_CPUS_PER_TASK="32")
    command = ["bash", str(REPO / "srun_pm.sh"), "scripts/lr_range_test.py", "--config", "short"]
    result = subprocess.run(command, cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    calls = log.read_text().splitlines()
    image = "shifter --image=nersc/pytorch:25.06.01 --module=gpu,nccl-plugin"
    assert calls[-1].startswith(f"srun --kill-on-bad-exit=1 -u -c 32 --cpu-bind=cores {image} "
                                f"--volume=/my/era5:/data;{tmp_path / 'logs'}:/logs ")
    assert calls[-1].endswith(" python scripts/lr_range_test.py --config short")
    for env, args, message in (({}, ["train.py"], "srun_pm.sh runs inside an allocation"),
                               ({"SLURM_JOB_ID": "7"}, ["nothere.py"], "usage: bash srun_pm.sh SCRIPT")):
        result = subprocess.run(["bash", str(REPO / "srun_pm.sh"), *args], cwd=tmp_path, capture_output=True,
                                text=True, timeout=60, env=subprocess_env(PATH=environ["PATH"], **env))
        assert result.returncode == 2 and result.stderr.startswith(f"error: {message}"), result.stderr
