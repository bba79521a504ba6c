"""Helpers shared by test_ddp.py, test_slurm.py and test_plot_scaling.py."""

from __future__ import annotations

import json
from pathlib import Path

from ruamel.yaml import YAML

from tests.conftest import TEST_IMG
from utils.config import DEFAULT_YAML, load_config


def write_test_yaml(path: Path) -> Path:
    """A YAML file whose config `tiny` is the conftest test model (flags cannot change the
    model): embed 32, depth 2, 4 heads, patch 4 on the 16 x 32 test grid."""
    values = load_config(DEFAULT_YAML, "tiny").to_dict()
    values.update(img_size=list(TEST_IMG), patch_size=4, embed_dim=32, depth=2, num_heads=4, warmup=0)
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
