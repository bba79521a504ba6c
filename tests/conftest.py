"""Shared fixtures: a small synthetic ERA5 data set and configs that train on it fast."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# Tests that train in the pytest process run torch on one thread (read when torch starts, so set
# before anything imports it). Under `make test` the other worker's ranks use the other core, and
# torch's OpenMP threads waiting for a busy core made such a test 20x slower (1.2 s alone, 23 s
# in the suite). Subprocesses get the same from subprocess_env.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from utils.config import DEFAULT_YAML, Config, load_config, with_overrides  # noqa: E402
from utils.device import cuda_available  # noqa: E402
from utils.synthetic_era5 import generate  # noqa: E402

TEST_IMG = (16, 32)
TEST_SAMPLES_PER_YEAR = 40


def pytest_configure(config):
    """Every interpreter this test process starts, with whatever environment a test or a script
    gives it, starts from the fork server (tests/fast_start/); not in pytest-xdist's controller,
    which runs no tests."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        path = [p for p in (os.environ.get("PYTHONPATH"), str(FAST_START)) if p]
        os.environ.update(FAST_START_SOCKET=fast_start_server(), FAST_START_ROOT=str(REPO),
                          PYTHONPATH=os.pathsep.join(path))


@pytest.hookimpl(trylast=True)  # after pytest-xdist has added its group names to the node ids
def pytest_collection_modifyitems(config, items):
    check_xdist_groups(config, items)
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def check_xdist_groups(config, items) -> None:
    """Under `make test` (-n 2 --dist loadgroup) every test marked xdist_group must carry its group
    in its node id, or the scheduler splits the group over the workers: the course's pages would
    run out of order in two folders, and module fixtures that start ranks would run twice."""
    if not getattr(config.option, "loadgroup", False):
        return
    lost = [item.nodeid for item in items
            if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if lost:
        raise pytest.UsageError(f"pytest-xdist could not group {lost[0]} (and {len(lost) - 1} more): this "
                                f"pytest and pytest-xdist do not work together; install the versions "
                                f"requirements.txt pins (make venv)")


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """Two training years, one validation and one test year of 40 steps on a 16 x 32 grid."""
    out = tmp_path_factory.mktemp("era5")
    years = {"train": [2016, 2017], "valid": [2018], "test": [2019]}
    generate(out, TEST_IMG, TEST_SAMPLES_PER_YEAR, years, seed=1)
    return out


def make_cfg(data_dir: Path, expdir: Path, /, **overrides) -> Config:
    """The `tiny` config shrunk to the test grid: 2 blocks of width 32, batch 4."""
    base = load_config(DEFAULT_YAML, "tiny")
    values = dict(img_size=TEST_IMG, patch_size=4, embed_dim=32, depth=2, num_heads=4,
                  global_batch_size=4, num_iters=6, warmup=0, checkpoint_every=0,
                  limit_nsamples_val=None, data_dir=str(data_dir), expdir=str(expdir))
    values.update(overrides)
    return with_overrides(base, **values)


@pytest.fixture
def cfg_factory(data_dir, tmp_path):
    def factory(**overrides) -> Config:
        return make_cfg(data_dir, tmp_path / "logs", **overrides)

    return factory


def subprocess_env(gpus: bool = False, fast_start: bool = True, **extra: str) -> dict[str, str]:
    """Environment for running the project's scripts in a child process. Without ``gpus`` the
    GPUs are hidden: the CPU tests start several ranks, which must not share one GPU. With
    ``fast_start`` the project's scripts, torchrun and its ranks start as forks of a server that
    has imported torch (tests/fast_start/server.py); without it, as new interpreters (for tests
    of what an interpreter does as it starts, or of processes under a real Slurm)."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items()
           if k not in launcher and not k.startswith(("SLURM_", "FAST_START_"))}
    # PYTHON: the submit scripts' interpreter outside a container; this one, so that the suite run
    # with another torch (make test-compat) tests that torch there too
    env.update({"PYTHONPATH": f"{REPO}{os.pathsep}{FAST_START}", "OMP_NUM_THREADS": "1",
                "PYTHON": sys.executable}, **extra)
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    if fast_start:  # extra may name another socket or root (tests/test_fast_start.py)
        env.setdefault("FAST_START_ROOT", str(REPO))
        if "FAST_START_SOCKET" not in extra:
            env["FAST_START_SOCKET"] = fast_start_server()
    return env


FAST_START = REPO / "tests" / "fast_start"
_server: list = []  # this test process's fork server: [process, socket path]


def fast_start_server() -> str:
    """The socket of this test process's fork server, started on first use (it imports torch
    and the project once, in about as long as one new interpreter takes)."""
    if not _server:
        # a Unix socket's path has at most 107 bytes: a long TMPDIR gives way to /tmp
        short = None if len(tempfile.gettempdir()) <= 60 else "/tmp"
        folder = tempfile.mkdtemp(prefix="fast-start-", dir=short)
        path = os.path.join(folder, "socket")
        env = subprocess_env(fast_start=False)
        env.pop("OMP_NUM_THREADS")  # the server learns torch's own default; each child sets its own
        proc = subprocess.Popen([sys.executable, str(FAST_START / "server.py"), path], env=env, cwd=REPO,
                                stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not os.path.exists(path) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        atexit.register(_stop_server, proc, folder)
        _server.extend([proc, path])
    return _server[1]


def _stop_server(proc: subprocess.Popen, folder: str) -> None:
    proc.terminate()
    proc.wait(10)
    shutil.rmtree(folder, ignore_errors=True)
