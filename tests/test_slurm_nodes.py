"""The submit scripts on a real two-node Slurm cluster, both nodes on this machine (started once
for the module, tests/slurm_harness.py), in three jobs of 2 nodes x 2 tasks (4 ranks), each
training the conftest test model: ranks numbered node by node; tensor-parallel groups inside a
node, data parallelism across (page 5), experts split inside a node (page 9); a stop signal
that reaches every node's tasks and a requeue that resumes; a node lost mid-run.

Needs root and apt (or Slurm already installed); skipped with the reason otherwise.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, subprocess_env
from tests.ddp_helpers import metrics, run_dir, train_args, write_test_yaml
from tests.slurm_harness import SlurmCluster, SlurmUnavailableError, local_cluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(420),
              pytest.mark.xdist_group("slurm")]  # one cluster for the module

# seconds; these jobs ran for 10-35 s here (the requeued one twice that), more on a busy machine
JOB_TIMEOUT = 180
TWO_NODES = ["-N", "2", "--ntasks-per-node", "2"]
NODE_OF_RANK = {0: "n1", 1: "n1", 2: "n2", 3: "n2"}  # srun numbers the tasks node by node
# fp32, the same samples per step: the layouts differ from the serial run only in the order of
# their sums (as in tests/test_ddp.py and tests/test_train_mp.py)
LOSS_RTOL = 1e-5


@pytest.fixture(scope="module")
def slurm():
    try:
        with local_cluster(nodes=2) as cluster:
            yield cluster
    except SlurmUnavailableError as err:
        pytest.skip(f"no local Slurm: {err}")


@pytest.fixture(scope="module")
def test_yaml(tmp_path_factory) -> Path:
    return write_test_yaml(tmp_path_factory.mktemp("slurm_nodes_yaml") / "ViT.yaml")


@pytest.fixture(scope="module")
def serial(data_dir, test_yaml, tmp_path_factory):
    """serial(**flags): the metrics of train.py in one process with the test flags and ``flags``,
    run once per set of flags."""
    expdir, runs = tmp_path_factory.mktemp("serial"), {}

    def run(**flags) -> list[dict]:
        key = tuple(sorted(flags.items()))
        if key not in runs:
            name = f"serial{len(runs)}"
            args = train_args(test_yaml, data_dir, expdir, run_num=name, **flags)
            result = subprocess.run([sys.executable, "train.py", *args], cwd=REPO, env=subprocess_env(),
                                    capture_output=True, text=True, timeout=JOB_TIMEOUT)
            assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
            runs[key] = metrics(run_dir(expdir, 1, name))
        return runs[key]

    return run


def submit(slurm: SlurmCluster, script: str, args: list[str], tmp_path: Path, options=(), **env) -> str:
    """sbatch on 2 nodes x 2 tasks from the repository's top folder, job output into tmp_path."""
    return slurm.sbatch(REPO / script, args, ["-o", f"{tmp_path}/%x-%j.out", *TWO_NODES, *options],
                        cwd=REPO, env=subprocess_env(fast_start=False, **env))


def job_output(tmp_path: Path, job: str) -> str:
    return next(tmp_path.glob(f"*-{job}.out")).read_text()


def completed(slurm: SlurmCluster, job: str, tmp_path: Path, restarts: int = 0) -> str:
    info = slurm.wait(job, JOB_TIMEOUT, restarts=restarts)
    out = job_output(tmp_path, job)
    assert (info["JobState"], info["ExitCode"], int(info["Restarts"])) == ("COMPLETED", "0:0", restarts), \
        out[-3000:]
    return out


def placement(log_text: str, what: str = "parallel") -> dict[int, tuple[str, str]]:
    """Rank -> (node, the rest of its line) from rank 0's '<what> layout rank R on node N: ...'
    lines (distributed/mesh.py, distributed/experts.py)."""
    found = re.findall(rf"{what} layout rank (\d+) on node (\S+): (.*)", log_text)
    return {int(rank): (node, rest) for rank, node, rest in found}


def groups_of(rest: str, name: str) -> tuple[int, ...]:
    """The ranks of the group ``name`` in a placement line ('tp 1/2 of [2, 3]' -> (2, 3))."""
    return tuple(int(r) for r in re.search(rf"\b{name} \d+/\d+ of \[([\d, ]+)\]", rest).group(1).split(","))


def nodes_of(ranks: tuple[int, ...], where: dict[int, tuple[str, str]]) -> set[str]:
    return {where[r][0] for r in ranks}


def assert_serial_losses(got: list[dict], want: list[dict]) -> None:
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for g, w in zip(got, want):
        assert g["train_loss"] == pytest.approx(w["train_loss"], rel=LOSS_RTOL), (g, w)
        assert g["val_loss"] == pytest.approx(w["val_loss"], rel=LOSS_RTOL), (g, w)


def wait_for_training(slurm: SlurmCluster, job: str, log_file: Path, tmp_path: Path) -> None:
    deadline = time.monotonic() + JOB_TIMEOUT
    while not (log_file.exists() and "steps per epoch" in log_file.read_text()):
        assert time.monotonic() < deadline, "training did not start"
        assert slurm.job(job).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), \
            job_output(tmp_path, job)[-3000:]
        time.sleep(0.1)


def test_tensor_parallel_groups_stay_inside_a_node(slurm, serial, data_dir, test_yaml, tmp_path):
    """`submit_pm_mp.sh` on 2 nodes with --tensor_parallel 2 (pages 5 and 3: tp inside a node,
    dp across nodes): each rank reports its node and groups, and the job trains the serial run."""
    args = [*train_args(test_yaml, data_dir, tmp_path / "logs"), "--tensor_parallel=2"]
    job = submit(slurm, "submit_pm_mp.sh", args, tmp_path)
    completed(slurm, job, tmp_path)
    run = tmp_path / "logs" / "tiny" / "4GPU_tp2_cp1_dp2" / "00"
    log_text = (run / "out.log").read_text()
    where = placement(log_text)
    assert {r: node for r, (node, _) in where.items()} == NODE_OF_RANK, log_text[:3000]
    tp = {groups_of(rest, "tp") for _, rest in where.values()}
    dp = {groups_of(rest, "dp") for _, rest in where.values()}
    assert tp == {(0, 1), (2, 3)} and all(len(nodes_of(g, where)) == 1 for g in tp)
    assert dp == {(0, 2), (1, 3)} and all(nodes_of(g, where) == {"n1", "n2"} for g in dp)
    assert "span nodes" not in log_text
    assert_serial_losses(metrics(run), serial())


def test_data_parallel_on_two_nodes_stops_on_a_signal_and_resumes_after_requeue(slurm, serial, data_dir,
                                                                                test_yaml, tmp_path):
    """`sbatch -N 2 submit_pm_dp.sh` with 2 tasks per node: 4 ranks numbered node by node, meeting
    at the first node of the node list (its name resolves, as on a real cluster). Then
    `scancel --signal=USR1` (what `#SBATCH --signal=USR1@90` sends before the time limit) reaches
    the tasks of both nodes; they stop at one step, rank 0 checkpoints once, the job exits 75 and
    REQUEUE=1 puts it back in the queue; it runs again on both nodes and resumes. Its losses are
    the uninterrupted serial run's. (One job for both: an uninterrupted one would prove nothing
    more.)"""
    num_iters = 45  # 5 epochs: the signal (sent as training starts) arrives long before the end
    args = train_args(test_yaml, data_dir, tmp_path / "logs", num_iters=num_iters, stop_check_every=2)
    # the requeued run appends to the job's output (by default it would start it again)
    job = submit(slurm, "submit_pm_dp.sh", args, tmp_path, ["--open-mode=append"], REQUEUE="1")
    log_file = run_dir(tmp_path / "logs", 4) / "out.log"
    wait_for_training(slurm, job, log_file, tmp_path)
    slurm.signal(job, "USR1")
    out = completed(slurm, job, tmp_path, restarts=1)
    log_text = log_file.read_text()
    assert "process group: gloo, world size 4" in out and "local batch 2 on 4 ranks" in log_text
    where = placement(log_text)
    assert {r: node for r, (node, _) in where.items()} == NODE_OF_RANK, log_text[:3000]
    assert groups_of(where[2][1], "dp") == (0, 1, 2, 3)
    # every rank stopped at one step, whether its own signal or another rank's came to the stop
    # agreement first (the nodes' step daemons deliver it at slightly different times) ...
    stops = re.findall(r"(?:\[rank (\d)\] )?\S+ \S+ WARNING stop signal \((\w+|received by another "
                       r"rank)\): stopping at step (\d+)", out)
    assert sorted(int(r or 0) for r, *_ in stops) == [0, 1, 2, 3], out[-3000:]
    step = int(stops[0][2])
    assert {int(s) for *_, s in stops} == {step} and 0 < step < num_iters
    # ... and the signal reached every rank of both nodes itself (each says so as it exits)
    reached = re.findall(r"(?:\[rank (\d)\] )?\S+ \S+ WARNING stopped with the checkpoint of step (\d+); "
                         r"the stop signal reached this rank: (\w+)", out)
    assert sorted((int(r or 0), int(s), sig) for r, s, sig in reached) == \
        [(r, step, "SIGUSR1") for r in range(4)], out[-3000:]
    assert f"requeueing job {job}" in out
    written = re.findall(r"checkpoint at step (\d+) written", log_text)
    assert written == [str(step), str(num_iters)], written  # once at the stop, once at the end
    assert f"at step {step}" in next(line for line in log_text.splitlines() if "resumed from" in line)
    assert_serial_losses(metrics(run_dir(tmp_path / "logs", 4)), serial(num_iters=num_iters))


def test_a_lost_node_ends_the_job_naming_it(slurm, data_dir, test_yaml, tmp_path):
    """Node n2 dies mid-run (its slurmd, step daemon and tasks killed at once). The ranks on n1
    fail their collective at once and name the ranks that stopped and their node (the heartbeat,
    distributed/health.py); Slurm finds the node silent and ends the job (--no-requeue: it would
    otherwise go back to the queue). The job runs page 9's expert layout, whose start is checked
    first: experts split over the ranks of a node, their copies across nodes."""
    args = [*train_args(test_yaml, data_dir, tmp_path / "logs", num_iters=100000),
            "--num_experts=4", "--expert_parallel=2"]
    job = submit(slurm, "submit_pm_mp.sh", args, tmp_path, ["--no-requeue"])
    log_file = tmp_path / "logs" / "tiny" / "4GPU_tp1_cp1_dp4_ep2" / "00" / "out.log"
    wait_for_training(slurm, job, log_file, tmp_path)
    where = placement(log_file.read_text(), "expert")
    assert {r: node for r, (node, _) in where.items()} == NODE_OF_RANK
    for _, rest in where.values():
        split, copies = (tuple(int(r) for r in g.split(",")) for g in re.findall(r"\[([\d, ]+)\]", rest))
        assert len(nodes_of(split, where)) == 1 and nodes_of(copies, where) == {"n1", "n2"}, rest
    try:
        killed_at = time.monotonic()
        slurm.lose_node("n2", job)
        info = slurm.wait(job, 60, poll=0.5)
        ended_after = time.monotonic() - killed_at
    finally:
        slurm.restart_node("n2")
    out = job_output(tmp_path, job)
    assert info["JobState"] == "NODE_FAIL", (info, out[-3000:])
    assert ended_after < 60
    # the ranks on n1 name the ranks that stopped, and their node (the heartbeat): at least the one
    # whose collective waited for them (a rank that only waited for n1's ranks may fail later, when
    # rank 0 and its store have gone)
    lines = re.findall(r"ERROR (rank \d gave up at .*)", out)
    assert lines and {line[5] for line in lines} <= {"0", "1"}, out[-3000:]
    stopped = [[m.group(1) for part in re.split(r"[:;] (?=rank \d)", line)
                if (m := re.match(r"rank (\d) stopped responding .*, node n2 \(host \w+\) pid", part))]
               for line in lines]
    # one line names both of n2's ranks and none of n1's as stopped (a rank of n1 that gives up after
    # its neighbour on n1 has already exited may rightly name that neighbour too)
    naming = [line for line, ranks in zip(lines, stopped) if ranks == ["2", "3"]]
    assert any(not re.search(r"rank [01] stopped responding", line) for line in naming), lines
    assert "srun: error: Node failure on n2" in out
