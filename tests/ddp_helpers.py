"""Helpers shared by test_ddp.py, test_slurm.py and test_plot_scaling.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ruamel.yaml import YAML

from tests.conftest import REPO, TEST_IMG, subprocess_env
from utils.config import DEFAULT_YAML, load_config


def write_test_yaml(path: Path, depth: int = 2) -> Path:
    """A YAML file whose config `tiny` is the conftest test model (flags cannot change the
    model): embed 32, ``depth`` blocks (4: pipelines of 2 x 2 stages), 4 heads, patch 4 on the
    16 x 32 test grid."""
    values = load_config(DEFAULT_YAML, "tiny").to_dict()
    values.update(img_size=list(TEST_IMG), patch_size=4, embed_dim=32, depth=depth, num_heads=4, warmup=0)
    with open(path, "w") as f:
        YAML().dump({"tiny": values}, f)
    return path


def train_args(yaml: Path, data_dir: Path | None, expdir: Path | None, **extra) -> list[str]:
    """Flags for the test model: 9 steps of global batch 8 per epoch of 78 samples."""
    values = {"yaml_config": yaml, "config": "tiny", "data_dir": data_dir, "expdir": expdir,
              "num_iters": 6, "global_batch_size": 8, "limit_nsamples_val": 39, "checkpoint_every": 0}
    values.update(extra)
    return [f"--{k}={v}" for k, v in values.items() if v is not None]


def run_dir(expdir: Path, ranks: int, run_num: str = "00") -> Path:
    return Path(expdir) / "tiny" / f"{ranks}GPU" / run_num


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(path) / "metrics.jsonl").read_text().splitlines()]


WORKER = REPO / "tests" / "ddp_worker.py"
RUN_TIMEOUT = 120  # seconds for one torchrun job; a healthy one takes 10-20 s here


def run(nproc: int, args: list[str], timeout: float = RUN_TIMEOUT, max_restarts: int = 0,
        **env: str) -> subprocess.CompletedProcess:
    """The fault-injecting train.py (tests/ddp_worker.py; train_mp.py with
    DDP_TEST_MODEL_PARALLEL=1) on ``nproc`` ranks, through torchrun when there are several."""
    if nproc == 1:
        cmd = [sys.executable, str(WORKER)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", f"--max_restarts={max_restarts}", str(WORKER)]
    return subprocess.run(cmd + args, cwd=REPO, env=subprocess_env(**env), capture_output=True,
                          text=True, timeout=timeout)
