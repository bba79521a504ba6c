"""Run a project script as `python SCRIPT ARGS` would, in a process forked from a server that has
already imported torch, torch._dynamo and the project (tests/dist_spawn.py's PRELOAD).

A fresh interpreter spends about 2.5 s of CPU importing those before a script does anything;
the course check runs dozens of single-process scripts, on 2 cores. The child gets what a new
process would: the argument vector, the environment, the working folder, its own process group,
stdout and stderr (to a file here), and the script runs as ``__main__``; its exit status is the
script's. Only modules imported before the script starts are shared (the preloaded ones, never
a run's state), and torch reads OMP_NUM_THREADS when the server imports it: the server is
started with the suite's child environment (one thread per process).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from tests.dist_spawn import PRELOAD


def _child(argv: list[str], env: dict[str, str], cwd: str, out_path: str) -> None:
    os.setpgrp()  # its own process group, as a shell gives a command
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    script = os.path.abspath(argv[0])
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(script))  # as `python SCRIPT` puts the script's folder first
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as err:
        if isinstance(err.code, int) or err.code is None:
            code = err.code or 0
        else:
            print(err.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, then status 1
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # what the interpreter does when a script ends: its exit handlers (DALI's worker pools, logging),
    # then multiprocessing's bootstrap stops this process's own children (DataLoader workers) and
    # exits with the script's status; without them the workers would outlive the command
    atexit._run_exitfuncs()
    sys.exit(code)


def run_script(argv: list[str], env: dict[str, str], cwd: Path,
               timeout: float) -> subprocess.CompletedProcess:
    """``python argv[0] argv[1:]`` in a forked child; stdout and stderr together in ``stdout``."""
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")  # for a server started now
    try:
        multiprocessing.set_forkserver_preload(PRELOAD)
        ctx = multiprocessing.get_context("forkserver")
        with tempfile.NamedTemporaryFile(suffix=".out") as out:
            child = ctx.Process(target=_child, args=(argv, env, str(cwd), out.name))
            child.start()
            child.join(timeout)
            if child.exitcode is None:
                child.kill()
                child.join()
                raise subprocess.TimeoutExpired(argv, timeout)
            text = Path(out.name).read_text(errors="replace")
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old
    return subprocess.CompletedProcess(argv, child.exitcode, text, "")
