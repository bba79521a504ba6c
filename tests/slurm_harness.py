"""A throw-away single-node Slurm cluster for the tests of the submit scripts.

Needs root (the daemons, ``mknod``) and the Debian packages slurmctld, slurmd,
slurm-client and munge; :func:`ensure_installed` installs them with apt when missing
(about 15 s). Everything else lives under one folder: munge key and socket, slurm.conf,
state, spool, logs, PID files. Daemons run on free ports, so two clusters (two test
sessions) can share a machine; :meth:`SlurmCluster.stop` ends them by their PID files.

The node declares what the Perlmutter directives ask for on a small machine: 128 CPUs
(``SlurmdParameters=config_overrides`` lets it claim more than it has), four GPUs backed
by fake character devices (gres/gpu drops GPUs without a device file), and the feature
``gpu`` (for ``-C gpu``). Without slurmdbd, ``-q`` and ``-A`` are accepted and ignored.
``cred_expire=5`` lets a requeued job start again after 5 s instead of Slurm's default 120 s.
Tasks see CUDA_VISIBLE_DEVICES but no GPU exists: training runs on the CPU.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("sbatch", "squeue", "scontrol", "scancel", "sinfo", "slurmctld", "slurmd", "munged",
            "mungekey")
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


class SlurmCluster:
    def __init__(self, base: Path) -> None:
        self.base = Path(base)
        self.host = socket.gethostname().split(".")[0]  # NodeName must equal `hostname -s`
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
        for sub in ("etc", "state", "spool", "log", "run", "munge", "dev"):
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
        for i in range(4):  # fake GPUs: character devices with the NVIDIA major number
            dev = b / "dev" / f"nvidia{i}"
            if not dev.exists():
                os.mknod(dev, 0o666 | 0o020000, os.makedev(195, i))
        self._write_config()
        self._run([_sbin("slurmctld"), "-c"])
        self._run([_sbin("slurmd")])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self._run(["sinfo", "-h", "-n", self.host, "-o", "%T"], check=False).stdout.strip()
            if state == "idle":
                return
            time.sleep(0.1)
        log = (b / "log" / "slurmd.log").read_text()[-2000:] if (b / "log" / "slurmd.log").exists() else ""
        raise RuntimeError(f"the Slurm node did not become idle (state {state!r}); slurmd log:\n{log}")

    def _write_config(self) -> None:
        b = self.base
        ctld_port, d_port = free_port(), free_port()
        self.conf.write_text(f"""\
ClusterName=testcluster
SlurmctldHost={self.host}(127.0.0.1)
SlurmUser=root
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={b}/munge/munge.sock,cred_expire=5
StateSaveLocation={b}/state
SlurmdSpoolDir={b}/spool
SlurmctldPidFile={b}/run/slurmctld.pid
SlurmdPidFile={b}/run/slurmd.pid
SlurmctldLogFile={b}/log/slurmctld.log
SlurmdLogFile={b}/log/slurmd.log
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
SlurmdParameters=config_overrides
GresTypes=gpu
NodeName={self.host} NodeAddr=127.0.0.1 CPUs=128 Boards=1 SocketsPerBoard=1 CoresPerSocket=64 \
ThreadsPerCore=2 RealMemory=256000 Gres=gpu:4 Feature=gpu State=UNKNOWN
PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP
""")
        (b / "etc" / "gres.conf").write_text(
            f"AutoDetect=off\nNodeName={self.host} Name=gpu File={b}/dev/nvidia[0-3]\n")
        (b / "etc" / "plugstack.conf").write_text("")

    def stop(self) -> None:
        if self.conf.exists() and (self.base / "run" / "slurmctld.pid").exists():
            ids = self._run(["squeue", "-h", "-o", "%i"], check=False, timeout=10).stdout.split()
            if ids:
                self._run(["scancel", *ids], check=False, timeout=10)
        pids = []
        for pidfile in ("run/slurmd.pid", "run/slurmctld.pid", "munge/munged.pid"):
            path = self.base / pidfile
            try:
                pid = int(path.read_text().strip())
                os.kill(pid, signal.SIGTERM)
                pids.append(pid)
            except (OSError, ValueError):
                continue
        deadline = time.monotonic() + 15
        for pid in pids:
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except OSError:
                    break
                time.sleep(0.1)

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
