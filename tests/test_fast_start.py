"""The suite's fork server (tests/fast_start/): a command handed to it behaves as the same
command in a new interpreter would, as its caller sees it: arguments, environment, folder,
streams, exit status, death by a signal, signals relayed, and nothing left running when its
stand-in is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import subprocess_env

SCRIPT = """
import os, signal, sys, time
# one string, one write: two ranks share torchrun's stdout, unbuffered (print's pieces would interleave)
origin = "preloaded" if "torch" in sys.modules else "new interpreter"
print(f"{origin} {os.environ.get('FAST_START_REFUSED', '')}", flush=True)
print("argv", sys.argv[1:], "cwd", os.getcwd(), "env", os.environ.get("FAST_START_TEST"), flush=True)
torch = sys.modules.get("torch")  # a new interpreter does not import it: 3 s saved per run here
print("path0", sys.path[0], "threads", torch.get_num_threads() if torch else None, flush=True)
print("to stderr", file=sys.stderr, flush=True)
mode = sys.argv[1]
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "raise":
    raise ValueError("a bad value")
if mode == "signal":
    os.kill(os.getpid(), signal.SIGUSR2)
if mode in ("wait", "wait_handled"):
    if mode == "wait_handled":
        signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM", flush=True), sys.exit(7)))
    with open(sys.argv[2], "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)
"""


def write_script(folder: Path) -> Path:
    path = folder / "child.py"
    path.write_text(SCRIPT)
    return path


def env_for(folder: Path, **extra: str) -> dict[str, str]:
    values = {"FAST_START_TEST": "yes", "FAST_START_ROOT": str(folder), "OMP_NUM_THREADS": "1", **extra}
    return subprocess_env(**values)


def run(folder: Path, *args: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-u", str(write_script(folder)), *args], cwd=folder,
                          env=env_for(folder, **extra), capture_output=True, text=True, timeout=60)


def wait_for_pid(path: Path, proc: subprocess.Popen) -> int:
    deadline = time.monotonic() + 30
    while not path.exists() or not path.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    return int(path.read_text())


def test_a_command_runs_forked_as_a_new_interpreter_would(tmp_path):
    # a test process that has compiled has TORCHINDUCTOR_CACHE_DIR set (torch sets it), read only
    # when a process compiles: its commands are forked all the same
    result = run(tmp_path, "exit", "3", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    assert result.returncode == 3, result
    assert result.stdout.splitlines() == [
        "preloaded ", f"argv ['exit', '3'] cwd {tmp_path} env yes", f"path0 {tmp_path} threads 1"]
    assert result.stderr == "to stderr\n"
    raised = run(tmp_path, "raise")
    assert raised.returncode == 1 and raised.stderr.rstrip().endswith("ValueError: a bad value"), raised
    killed = run(tmp_path, "signal")
    assert killed.returncode == -signal.SIGUSR2, killed


def test_start_up_variables_or_other_scripts_start_a_new_interpreter(tmp_path):
    assert run(tmp_path, "exit", "0", PYTHONHASHSEED="1").stdout.startswith("new interpreter")
    assert run(tmp_path, "exit", "0", FAST_START_ROOT=str(tmp_path / "elsewhere")).stdout.startswith(
        "new interpreter")


def test_signals_reach_the_command_and_a_killed_stand_in_takes_it_along(tmp_path):
    script, pid_file = write_script(tmp_path), tmp_path / "pid"
    stand_in = subprocess.Popen([sys.executable, str(script), "wait_handled", str(pid_file)], cwd=tmp_path,
                                env=env_for(tmp_path), stdout=subprocess.PIPE, text=True)
    command = wait_for_pid(pid_file, stand_in)
    assert command != stand_in.pid
    stand_in.send_signal(signal.SIGTERM)  # relayed: the command's handler exits with 7
    assert stand_in.wait(30) == 7 and "got SIGTERM" in stand_in.stdout.read()
    pid_file.unlink()
    stand_in = subprocess.Popen([sys.executable, str(script), "wait", str(pid_file)], cwd=tmp_path,
                                env=env_for(tmp_path), stdout=subprocess.DEVNULL)
    command = wait_for_pid(pid_file, stand_in)
    stand_in.kill()  # as torchrun kills a rank that does not stop
    stand_in.wait(30)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{command}").exists() and "zombie" not in status_of(command):
        assert time.monotonic() < deadline, "the command outlived its killed stand-in"
        time.sleep(0.05)


def status_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return "gone"


def test_without_the_server_a_command_starts_as_usual(tmp_path):
    result = run(tmp_path, "exit", "0", FAST_START_SOCKET=str(tmp_path / "no-server"))
    assert result.returncode == 0 and result.stdout.startswith("new interpreter"), result


def test_torchruns_ranks_are_forked_and_scripts_keep_the_callers_path(tmp_path, monkeypatch):
    """Both ranks torchrun starts come from the server; the scripts that start ranks keep the
    caller's PYTHONPATH after the repository's (it is how their ranks reach the server)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    result = subprocess.run([*torchrun, str(write_script(tmp_path)), "exit", "0"], cwd=tmp_path,
                            env=env_for(tmp_path), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("preloaded ") == 2, result.stdout
    from scripts.workers import REPO, worker_env

    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.delenv("OMP_NUM_THREADS")
    env = worker_env(MALLOC_ARENA_MAX="2")
    assert env["PYTHONPATH"] == f"{REPO}{os.pathsep}/elsewhere"
    assert env["OMP_NUM_THREADS"] == "1" and env["MALLOC_ARENA_MAX"] == "2"
