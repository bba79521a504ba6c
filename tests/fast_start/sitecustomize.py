"""The client of tests/fast_start/server.py, run by every interpreter the suite starts with this
folder on PYTHONPATH (Python imports `sitecustomize` as it starts, before the script).

With FAST_START_SOCKET set, an interpreter about to run a project script (a `.py` file under
FAST_START_ROOT), `-m torch.distributed.run` or DeepSpeed's launcher (MODULES) hands its
command to the server, which runs it in
a process forked from one that has imported torch already. This interpreter stays as the
command's stand-in for whoever started it (torchrun, a test, a shell): it relays the signals it
gets to the command's session and ends as the command ends, with its exit status or by its
signal. Anything else, or a refusal, or no server: the interpreter goes on as usual.
"""

import os

MODULES = ("torch.distributed.run", "deepspeed.launcher.runner", "deepspeed.launcher.launch")
RELAYED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGCONT")


def _command(argv: list[str], root: str) -> dict | None:
    """{script | module, args, unbuffered} for `[-u] SCRIPT ARGS` or `[-u] -m MODULE ARGS`."""
    unbuffered = False
    while argv and argv[0] == "-u":
        unbuffered, argv = True, argv[1:]
    if len(argv) >= 2 and argv[0] == "-m" and argv[1] in MODULES:
        return {"module": argv[1], "args": argv[2:], "unbuffered": unbuffered}
    if argv and argv[0].endswith(".py") and not argv[0].startswith("-"):
        path = os.path.realpath(argv[0])
        if path.startswith(root + os.sep) and os.path.isfile(path):
            return {"script": argv[0], "args": argv[1:], "unbuffered": unbuffered}
    return None


def _hand_over(path: str, root: str) -> None:
    import sys

    command = _command(list(sys.orig_argv[1:]), root)
    if command is None:
        return
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            return
    import contextlib
    import json
    import signal
    import socket
    import struct

    relayed = {getattr(signal, name) for name in RELAYED}
    # held back until the command's pid is known (then relayed), or until this start is refused
    signal.pthread_sigmask(signal.SIG_BLOCK, relayed)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:  # no server (any more): start as usual
        conn.close()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, relayed)
        return
    command.update(executable=sys.executable, env=dict(os.environ), cwd=os.getcwd(), umask=os.umask(0o022))
    os.umask(command["umask"])
    payload = json.dumps(command).encode()
    socket.send_fds(conn, [struct.pack("!I", len(payload))], [0, 1, 2])
    conn.sendall(payload)
    replies = conn.makefile("r")
    first = replies.readline().split(" ", 1)
    if first[0] != "pid":  # refused ("no REASON") or the server broke: start as usual
        conn.close()
        os.environ["FAST_START_REFUSED"] = first[-1].strip() or "no reply"  # for a test to show
        signal.pthread_sigmask(signal.SIG_UNBLOCK, relayed)
        return
    pid = int(first[1])

    def relay(sig: int, frame: object) -> None:
        try:
            os.killpg(pid, sig)  # the command and its workers, as torchrun's killpg of a rank would
        except OSError:  # not yet a session of its own: the command alone
            with contextlib.suppress(OSError):
                os.kill(pid, sig)

    for sig in relayed:
        signal.signal(sig, relay)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, relayed)
    last = replies.readline().split(" ", 1)
    status = int(last[1]) if last[0] == "status" else None
    if status is None:
        os._exit(1)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


if os.environ.get("FAST_START_SOCKET") and os.environ.get("FAST_START_ROOT"):
    _hand_over(os.environ["FAST_START_SOCKET"], os.environ["FAST_START_ROOT"])
