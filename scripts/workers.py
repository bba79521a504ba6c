"""Starting a script's own ``--worker`` mode on N ranks, for the report scripts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def with_repo_on_path(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the repository first on PYTHONPATH, before the caller's folders, which stay."""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def worker_env(**extra: str) -> dict[str, str]:
    """This process's environment for the ranks a script starts: the repository first on the
    module path, one thread per rank unless OMP_NUM_THREADS says otherwise, and ``extra``."""
    env = with_repo_on_path(dict(os.environ))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def run_worker(script: str, ranks: int, flags: list[str], env: dict[str, str]) -> None:
    """``script --worker FLAGS`` in one process, or on ``ranks`` ranks through torchrun; a failure
    ends the report with the command and the end of its error output."""
    me = [str(Path(script).resolve()), "--worker"]
    cmd = [sys.executable, *me] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *me]
    result = subprocess.run(cmd + flags, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"error: {' '.join(cmd + flags)} failed:\n{result.stderr[-2000:]}")
