"""A fork server for the interpreters the suite starts: each `python SCRIPT` (a project script),
`python -m torch.distributed.run` (and DeepSpeed's launcher) and every rank they start is a fork
of this process, which has imported torch, its compiler front end and the project once.

Why: on a 2-core machine a new interpreter spends 3 to 7 s of CPU importing torch and
torch._dynamo (every optimizer's constructor imports it) before a script does anything; the
suite starts a few hundred, most of them torchrun ranks, and those imports were most of its
time. The client is `sitecustomize.py` beside this file: an interpreter started with this folder
on PYTHONPATH and FAST_START_SOCKET set sends its command line, environment, working folder and
standard streams here and becomes a stand-in that relays signals to the real process and exits
as it exits. Anything this server cannot reproduce (interpreter options other than -u, another
interpreter, environment variables read when torch or Python start) is refused, and the
interpreter then starts as usual.

One request, three processes: this server forks a *waiter* per request (so that the server
itself never waits), and the waiter forks the *child* that runs the command. The child starts a
session of its own, as torchrun starts each rank (`start_new_session`), so the stand-in can
relay a signal to the child and its workers at once (torchrun stops a rank with `killpg`). The
waiter sends the child's pid, then its wait status, and kills the child's session if the
stand-in dies first (torchrun's SIGKILL of a rank that does not stop).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import socket
import struct
import sys
import tempfile
import threading
import traceback

# what a run imports, so that a child does not: torch, its compiler front end, the launcher, the
# distributed layers, TensorBoard's writer and the project's trainer and parallel layers
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.distributed.launcher.api",
           "torch.nn.parallel", "torch.distributed.fsdp", "torch.distributed.tensor",
           "torch.distributed.checkpoint", "torch.distributed.pipelining", "torch.utils.tensorboard", "h5py",
           "training.trainer", "training.launcher", "training.pipelined", "training.sharded_checkpoint",
           "distributed.parallelize", "distributed.layers", "distributed.pipeline", "distributed.experts",
           "distributed.sharding", "distributed.consolidate"]

# environment variables read as a process, Python, torch or its thread pools start (glibc's
# MALLOC_* tunables, TORCH_DISTRIBUTED_DEBUG, TORCH_LOGS, ...): a request that sets them otherwise
# than this server had them starts as usual. Those a launcher sets for its ranks, read later, those
# a child sets for itself (below), and the compiler's cache folders, read when it compiles (torch
# sets TORCHINDUCTOR_CACHE_DIR in the environment of a process that has compiled: a test process
# that has would otherwise find every later command refused), do not count.
STARTUP_PREFIXES = ("PYTHON", "TORCH", "PYTORCH", "LD_", "MALLOC_", "OMP_", "KMP_", "GOMP_", "MKL_")
RUNTIME = ("PYTHONUNBUFFERED", "OMP_NUM_THREADS", "TORCHELASTIC_", "TORCH_NCCL_", "TORCHINDUCTOR_CACHE_DIR",
           "TRITON_CACHE_DIR")
HEADER = struct.Struct("!I")  # the request's length, sent with the three standard streams


def startup_env(env: dict[str, str]) -> dict[str, str]:
    found = {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES) and not k.startswith(RUNTIME)}
    if "PYTHONPATH" in found:  # the same folders in the same order make the same module path
        folders = [p for p in found["PYTHONPATH"].split(os.pathsep) if p]
        found["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(folders))
    return found


class Server:
    def __init__(self, path: str) -> None:
        self.env = startup_env(os.environ)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)  # before the imports: a client that comes early waits for them
        self.listener.listen(128)
        for name in PRELOAD:
            importlib.import_module(name)
        import torch

        self.threads = torch.get_num_threads()  # torch's own choice, without OMP_NUM_THREADS
        self.parent = os.getppid()

    def serve(self) -> None:
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the waiters are reaped by the kernel
        self.listener.settimeout(1.0)
        while True:
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                if os.getppid() != self.parent:  # the test process is gone: so is the suite
                    return
                continue
            if os.fork() == 0:
                self.listener.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the waiter waits for its child
                code = 1
                try:
                    code = self.wait_for(conn)
                finally:
                    os._exit(code)
            conn.close()

    def refusal(self, request: dict) -> str | None:
        if request["executable"] != sys.executable:
            return f"another interpreter ({request['executable']})"
        wanted = startup_env(request["env"])
        if wanted != self.env:
            differ = sorted(k for k in {*wanted, *self.env} if wanted.get(k) != self.env.get(k))
            return f"variables read at start-up differ: {', '.join(differ)}"
        return None

    def wait_for(self, conn: socket.socket) -> int:
        """The waiter: read the request, fork the child, relay its pid and its end."""
        conn.settimeout(None)
        data, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3)
        (length,) = HEADER.unpack(data)
        payload = b""
        while len(payload) < length:
            chunk = conn.recv(length - len(payload))
            if not chunk:
                return 1
            payload += chunk
        request = json.loads(payload)
        reason = self.refusal(request)
        if reason or len(fds) != 3:
            conn.sendall(f"no {reason or 'standard streams missing'}\n".encode())
            return 0
        pid = os.fork()
        if pid == 0:
            conn.close()
            run_child(request, fds, self.threads)  # never returns
        for fd in fds:
            os.close(fd)
        conn.sendall(f"pid {pid}\n".encode())
        pidfd = os.pidfd_open(pid)
        poll = select.poll()
        poll.register(pidfd, select.POLLIN)
        poll.register(conn, select.POLLIN)
        while True:
            ready = dict(poll.poll())
            if pidfd in ready:
                break
            if conn.fileno() in ready:  # the stand-in is gone (killed): so must be the command
                kill_session(pid, signal.SIGKILL)
                poll.unregister(conn)
        _, status = os.waitpid(pid, 0)
        with contextlib.suppress(OSError):  # the stand-in is gone: nobody to tell
            conn.sendall(f"status {status}\n".encode())
        return 0


def kill_session(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except OSError:  # not yet its own group: the child alone
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


def run_child(request: dict, fds: list[int], default_threads: int) -> None:
    """Become the command: its session, streams, folder, environment, arguments, then its code."""
    code = 1
    try:
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # found again from TMPDIR
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD,
                    signal.SIGQUIT, signal.SIGALRM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        unbuffered = request["unbuffered"] or bool(request["env"].get("PYTHONUNBUFFERED"))
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True, write_through=unbuffered)
        import torch

        threads = request["env"].get("OMP_NUM_THREADS", "")
        torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else default_threads)
        code = run_command(request)
    except BaseException:  # noqa: BLE001 - the set-up itself failed: say so, status 1
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed pipe: nothing left to say
                stream.flush()
        os._exit(code)


def run_command(request: dict) -> int:
    """Run the script or module as `__main__`, then end as an interpreter ends: wait for its
    non-daemon threads, run its exit handlers (DALI's worker pools, logging, multiprocessing's
    stop of its own children); the exit status is the script's."""
    code = 0
    try:
        if "script" in request:
            script = request["script"]
            sys.argv = [script, *request["args"]]
            sys.path[0] = os.path.dirname(os.path.realpath(script))  # as `python SCRIPT` does
            runpy.run_path(script, run_name="__main__")
        else:
            sys.argv = ["-m", *request["args"]]
            sys.path[0] = os.getcwd()  # as `python -m` does
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as err:
        if isinstance(err.code, int) or err.code is None:
            code = err.code or 0
        else:
            print(err.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:  # as the interpreter reports it: the traceback, then death by SIGINT
        traceback.print_exc()
        finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, then status 1
        traceback.print_exc()
        code = 1
    finish()
    return code


def finish() -> None:
    threading._shutdown()  # the interpreter's own wait for non-daemon threads at exit
    atexit._run_exitfuncs()


if __name__ == "__main__":
    Server(sys.argv[1]).serve()
