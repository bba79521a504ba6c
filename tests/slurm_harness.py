"""A throw-away Slurm cluster of one or more nodes on this machine, for the tests of the submit
scripts, and for a learner who wants to try them (``python tests/slurm_harness.py start --nodes 2
DIR``, as root; ``stop DIR`` ends it).

Needs root (the daemons, ``mknod``, /etc/hosts) and the Debian packages slurmctld, slurmd,
slurm-client and munge; :func:`ensure_installed` installs them with apt when missing
(about 15 s). Everything else lives under one folder: munge key and socket, slurm.conf,
state, spool, logs, PID files. Daemons run on free ports, so two clusters (two test
sessions) can share a machine; :meth:`SlurmCluster.stop` ends them by their PID files.

Each node declares what the Perlmutter directives ask for on a small machine: 128 CPUs
(``SlurmdParameters=config_overrides`` lets it claim more than it has), four GPUs backed
by fake character devices (gres/gpu drops GPUs without a device file), and the feature
``gpu`` (for ``-C gpu``). Without slurmdbd, ``-q`` and ``-A`` are accepted and ignored.
``cred_expire=5`` lets a requeued job start again after 5 s instead of Slurm's default 120 s.
Tasks see CUDA_VISIBLE_DEVICES but no GPU exists: training runs on the CPU.

Several nodes are several ``slurmd -N NAME`` daemons (Debian's Slurm is built to allow that),
each with its own port, spool folder, PID file and log (``%n`` in slurm.conf), all at
127.0.0.1: the tasks of every node share the machine's CPUs, and a node is lost by killing
its daemon and its tasks (:meth:`SlurmCluster.lose_node`).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("sbatch", "squeue", "scontrol", "scancel", "sinfo", "slurmctld", "slurmd", "munged",
            "mungekey")
# A node that does not answer for SLURMD_TIMEOUT_S is set down and its jobs fail; each try to reach
# it takes up to MESSAGE_TIMEOUT_S. Slurm's defaults are 300 s and 10 s; with these a lost node's
# job ended 15 s after the kill here (25 s with a MessageTimeout of 10 s).
SLURMD_TIMEOUT_S = 10
MESSAGE_TIMEOUT_S = 5
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                   "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


class SlurmUnavailableError(RuntimeError):
    """Slurm cannot be run here; the message says why (the tests skip with it)."""


def _missing() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]


def ensure_installed(timeout: float = 600) -> None:
    if not _missing():
        return
    if os.geteuid() != 0:
        raise SlurmUnavailableError(f"Slurm is not installed ({', '.join(_missing())} missing) and "
                               f"installing it needs root")
    if shutil.which("apt-get") is None:
        raise SlurmUnavailableError("Slurm is not installed and apt-get is not available to install it")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    apt = ["apt-get", "-o", "DPkg::Lock::Timeout=120"]  # wait for another apt (a parallel test run)
    for cmd in ([*apt, "update", "-q"], [*apt, "install", "-y", "-q", "--no-install-recommends", *PACKAGES]):
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise SlurmUnavailableError(f"`{' '.join(cmd)}` failed: {result.stderr.strip()[-500:]}")
    if _missing():
        raise SlurmUnavailableError(f"still missing after apt-get install: {', '.join(_missing())}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sbin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


HOSTS = Path("/etc/hosts")
HOSTS_TAG = "# test Slurm cluster "  # + its folder: which cluster added the line


def _edit_hosts(edit: Callable[[list[str]], list[str]], hosts: Path = HOSTS) -> None:
    """Rewrite the hosts file in place (it may be a bind mount, which a rename would not
    replace), locked against another cluster's harness doing the same."""
    with open(hosts, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        lines = f.read().splitlines()
        new = edit(lines)
        if new != lines:
            f.seek(0)
            f.write("".join(line + "\n" for line in new))
            f.truncate()


def _ours(line: str) -> str | None:
    """The folder of the cluster that added this line of the hosts file (None: not a cluster's)."""
    return line.split(HOSTS_TAG, 1)[1].strip() if HOSTS_TAG in line else None


def add_hosts_entry(names: list[str], tag: str, hosts: Path = HOSTS) -> None:
    """Make ``names`` resolve to 127.0.0.1, as a node's name resolves on a real cluster (a
    MASTER_ADDR taken from the job's node list must be an address). Lines left by clusters whose
    folder is gone (a test session that was killed) are dropped on the way."""
    line = f"127.0.0.1 {' '.join(names)} {HOSTS_TAG}{tag}"
    try:
        _edit_hosts(lambda lines: [x for x in lines if _ours(x) is None or Path(_ours(x)).exists()] + [line],
                    hosts)
    except OSError as err:
        raise SlurmUnavailableError(f"cannot add the node names to {hosts} ({err})") from None
    wrong = [n for n in names if not _resolves_here(n)]
    if wrong and hosts == HOSTS:
        remove_hosts_entry(tag, hosts)
        raise SlurmUnavailableError(f"the node names {', '.join(wrong)} do not resolve to 127.0.0.1 "
                                    f"through {hosts} (an earlier line names them, or the resolver "
                                    f"does not read it)")


def _resolves_here(name: str) -> bool:
    try:
        return socket.gethostbyname(name) == "127.0.0.1"
    except OSError:
        return False


def remove_hosts_entry(tag: str, hosts: Path = HOSTS) -> None:
    if hosts.exists():
        _edit_hosts(lambda lines: [x for x in lines if _ours(x) != tag], hosts)


def _wait_gone(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except OSError:
                break
            time.sleep(0.1)


def _parent(pid: int) -> int | None:
    try:  # /proc/PID/stat: "pid (comm) state ppid ...", comm may hold spaces
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _job_processes(conf: Path) -> list[int]:
    """Processes of the jobs of the cluster configured by ``conf``: with SLURM_CONF=conf and a
    SLURM_JOB_ID in their environment (a shell that only set SLURM_CONF is not one)."""
    wanted, found = f"SLURM_CONF={conf}".encode(), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                env = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if wanted in env and any(v.startswith(b"SLURM_JOB_ID=") for v in env):
                found.append(int(entry.name))
    return found


class SlurmCluster:
    """``nodes`` Slurm nodes on this machine. One node is named as the machine (``hostname -s``);
    several are named n1, n2, ..., each its own ``slurmd -N nI`` on a port of its own, with the
    machine's address (NodeAddr=127.0.0.1) and its host name (NodeHostname), and their names
    resolve through a line of /etc/hosts that :meth:`start` adds and :meth:`stop` removes."""

    def __init__(self, base: Path, nodes: int = 1) -> None:
        if nodes < 1:
            raise ValueError(f"a cluster needs at least one node, not {nodes}")
        self.base = Path(base)
        self.host = socket.gethostname().split(".")[0]  # a single node's name must equal `hostname -s`
        self.nodes = [self.host] if nodes == 1 else [f"n{i}" for i in range(1, nodes + 1)]
        self.conf = self.base / "etc" / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """Add to a client's environment (sbatch, squeue, ...)."""
        return {"SLURM_CONF": str(self.conf)}

    def _run(self, cmd: list[str], timeout: float = 30, check: bool = True,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        full_env = dict(os.environ if env is None else env, **self.env)
        result = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    # ------------------------------------------------------------------ daemons ---
    def start(self, timeout: float = 30) -> None:
        b = self.base
        for sub in ("etc", "state", "log", "run", "munge", *(f"spool/{n}" for n in self.nodes),
                    *(f"dev/{n}" for n in self.nodes)):
            (b / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(b, 0o755)
        os.chmod(b / "munge", 0o755)  # munged wants its socket folder traversable
        key = b / "munge" / "munge.key"
        if not key.exists():
            subprocess.run([_sbin("mungekey"), "--create", f"--keyfile={key}"], check=True, timeout=30)
            os.chmod(key, 0o400)
        subprocess.run([_sbin("munged"), f"--socket={b}/munge/munge.sock", f"--key-file={key}",
                        f"--pid-file={b}/munge/munged.pid", f"--seed-file={b}/munge/munged.seed",
                        f"--log-file={b}/munge/munged.log"], check=True, timeout=30)
        for node in self.nodes:
            for i in range(4):  # fake GPUs: character devices with the NVIDIA major number
                dev = b / "dev" / node / f"nvidia{i}"
                if not dev.exists():
                    os.mknod(dev, 0o666 | 0o020000, os.makedev(195, i))
        self._write_config()
        if len(self.nodes) > 1:
            add_hosts_entry(self.nodes, tag=str(b))
        self._run([_sbin("slurmctld"), "-c"])
        for node in self.nodes:
            self._run([_sbin("slurmd"), "-N", node])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = self.node_states()
            if set(states) == set(self.nodes) and set(states.values()) == {"idle"}:
                return
            time.sleep(0.1)
        logs = "".join(f"\n{p.name}:\n{p.read_text()[-1500:]}"
                       for p in sorted((b / "log").glob("slurmd-*.log")))
        raise RuntimeError(f"the Slurm nodes did not become idle ({states}); slurmd logs:{logs}")

    def node_states(self) -> dict[str, str]:
        """Each node's state as sinfo gives it: 'idle', 'allocated', 'down*', ..."""
        out = self._run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def _write_config(self) -> None:
        b = self.base
        ctld_port = free_port()
        nodes = "\n".join(
            f"NodeName={n} NodeAddr=127.0.0.1 NodeHostname={self.host} Port={free_port()} CPUs=128 "
            f"Boards=1 SocketsPerBoard=1 CoresPerSocket=64 ThreadsPerCore=2 RealMemory=256000 Gres=gpu:4 "
            f"Feature=gpu State=UNKNOWN" for n in self.nodes)
        self.conf.write_text(f"""\
ClusterName=testcluster
SlurmctldHost={self.host}(127.0.0.1)
SlurmUser=root
SlurmctldPort={ctld_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={b}/munge/munge.sock,cred_expire=5
StateSaveLocation={b}/state
SlurmdSpoolDir={b}/spool/%n
SlurmctldPidFile={b}/run/slurmctld.pid
SlurmdPidFile={b}/run/slurmd-%n.pid
SlurmctldLogFile={b}/log/slurmctld.log
SlurmdLogFile={b}/log/slurmd-%n.log
PlugStackConfig={b}/etc/plugstack.conf
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MinJobAge=300
KillWait=30
SlurmdTimeout={SLURMD_TIMEOUT_S}
MessageTimeout={MESSAGE_TIMEOUT_S}
SlurmdParameters=config_overrides
GresTypes=gpu
{nodes}
PartitionName=debug Nodes={",".join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
""")
        (b / "etc" / "gres.conf").write_text("AutoDetect=off\n" + "".join(
            f"NodeName={n} Name=gpu File={b}/dev/{n}/nvidia[0-3]\n" for n in self.nodes))
        (b / "etc" / "plugstack.conf").write_text("")

    def stop(self) -> None:
        """Cancel the jobs, end the daemons by their PID files, remove the /etc/hosts line."""
        if self.conf.exists() and (self.base / "run" / "slurmctld.pid").exists():
            ids = self._run(["squeue", "-h", "-o", "%i"], check=False, timeout=10).stdout.split()
            if ids:
                self._run(["scancel", *ids], check=False, timeout=10)
        pids = []
        pidfiles = [*sorted((self.base / "run").glob("slurmd-*.pid")), self.base / "run" / "slurmctld.pid",
                    self.base / "munge" / "munged.pid"]
        for path in pidfiles:
            try:
                pid = int(path.read_text().strip())
                os.kill(pid, signal.SIGTERM)
                pids.append(pid)
            except (OSError, ValueError):
                continue
        _wait_gone(pids, 15)
        # what a lost node's job can leave (its srun waiting for a node that never answers)
        leftovers = _job_processes(self.conf)
        for pid in leftovers:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        _wait_gone(leftovers, 5)
        remove_hosts_entry(tag=str(self.base))

    def node_pid(self, node: str) -> int:
        return int((self.base / "run" / f"slurmd-{node}.pid").read_text())

    def lose_node(self, node: str, job_id: str) -> list[int]:
        """What a node's sudden death does to a job, as far as one machine can: the node's slurmd,
        the job's step daemons there (slurmstepd) and their tasks end at once (SIGKILL) and the
        node answers no more. Returns the task PIDs it killed."""
        listed = self._run(["scontrol", "listpids", job_id, node], timeout=10).stdout.split("\n")[1:]
        tasks = [int(line.split()[0]) for line in listed if line.strip()]
        steps = {p for p in map(_parent, tasks) if p is not None and _name(p).startswith("slurmstepd")}
        for pid in [self.node_pid(node), *steps, *tasks]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        return tasks

    def restart_node(self, node: str, timeout: float = 30) -> None:
        """Start a lost node's slurmd again and wait until it takes jobs (ReturnToService=2)."""
        self._run([_sbin("slurmd"), "-N", node])
        deadline = time.monotonic() + timeout
        while self.node_states().get(node) != "idle":
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {node} did not come back: {self.node_states()}")
            time.sleep(0.2)

    # --------------------------------------------------------------------- jobs ---
    def sbatch(self, script: Path, args: list[str] = (), options: list[str] = (),
               cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
        """Submit from ``cwd`` and return the job ID (the job's environment is ``env``)."""
        full_env = dict(os.environ if env is None else env, **self.env)
        result = subprocess.run(["sbatch", "--parsable", *options, str(script), *args], cwd=cwd,
                                env=full_env, capture_output=True, text=True, timeout=30)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch {Path(script).name} failed: {result.stderr.strip()}")
        return result.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, StdOut, ...)."""
        out = self._run(["scontrol", "show", "job", "-o", job_id], check=False, timeout=10).stdout
        fields = {}
        for item in out.split():
            key, _, value = item.partition("=")
            fields.setdefault(key, value)
        return fields

    def wait(self, job_id: str, timeout: float, restarts: int = 0, poll: float = 0.25
             ) -> dict[str, str]:
        """Wait until the job has ended after ``restarts`` requeues; scancel it and raise
        TimeoutError after ``timeout`` seconds. (While a job requeues itself it passes
        through an ended state, so the expected number of restarts must be given.)"""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in TERMINAL_STATES and int(info.get("Restarts", 0)) >= restarts:
                return info
            time.sleep(poll)
        self._run(["scancel", job_id], check=False, timeout=10)
        raise TimeoutError(f"job {job_id} did not finish in {timeout:.0f} s: {self.job(job_id)}")

    def signal(self, job_id: str, sig: str) -> None:
        """Send ``sig`` to every task of the job's steps (not to the batch shell), as
        ``#SBATCH --signal`` does before the time limit."""
        self._run(["scancel", f"--signal={sig}", job_id], timeout=10)


@contextlib.contextmanager
def local_cluster(nodes: int = 1) -> Iterator[SlurmCluster]:
    """A started cluster in a new folder under /tmp, stopped and removed after. (Not under
    pytest's folders: munged wants every parent of its socket folder traversable, and those are
    0700.) Raises SlurmUnavailableError when Slurm cannot run here."""
    ensure_installed()
    base = Path(tempfile.mkdtemp(prefix="slurm-test-", dir="/tmp"))
    cluster = SlurmCluster(base, nodes)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(base, ignore_errors=True)


def arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="A throw-away Slurm cluster on this machine (run as "
                                     "root). start prints the line that points sbatch, squeue and "
                                     "scontrol at it.")
    sub = parser.add_subparsers(dest="action", required=True)
    start = sub.add_parser("start", help="install Slurm with apt if missing, start the daemons")
    start.add_argument("folder", type=Path, help="everything but the packages goes here")
    start.add_argument("--nodes", type=int, default=1, help="number of nodes (n1, n2, ... when more than 1)")
    stop = sub.add_parser("stop", help="cancel the jobs, end the daemons, remove the /etc/hosts line")
    stop.add_argument("folder", type=Path)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser()
    args = parser.parse_args(argv)
    folder = args.folder.resolve()
    try:
        if os.geteuid() != 0:
            raise SlurmUnavailableError("the daemons, the fake GPU devices and /etc/hosts need root: "
                                        "run this as root")
        if args.action == "stop":
            SlurmCluster(folder).stop()
            return 0
        ensure_installed()
        cluster = SlurmCluster(folder, args.nodes)
        try:
            cluster.start()
        except BaseException:
            cluster.stop()  # what did start
            raise
        print(f"export SLURM_CONF={cluster.conf}")
    except (RuntimeError, ValueError, OSError, subprocess.SubprocessError) as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
