"""The spine a learner follows, counted: the project files that define the functions one training
step calls, and the project modules a run of train.py imports, on one device and with DDP on two
ranks. Pages 1 and 3 state these numbers; the tests hold the pages to them (a change that adds a
file to the step, or an import to every run, fails here until the page says so)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, subprocess_env
from tests.test_training import SINGLE_DEVICE_MODULES, project_modules, write_test_yaml

# what one step of a single-device run calls, file by file (the step: forward, loss, backward,
# optimizer step), and what a step of DDP on two ranks adds
STEP_FILES_ONE_DEVICE = {"training/trainer.py", "training/context.py", "networks/vit.py", "utils/metrics.py",
                         "networks/backbone.py", "utils/device.py", "training/schedule.py"}
STEP_FILES_DDP = STEP_FILES_ONE_DEVICE | {"distributed/health.py"}
# the project's modules a run of train.py imports (python -X importtime), train.py itself not counted
IMPORTED_ONE_DEVICE = SINGLE_DEVICE_MODULES  # measured by test_training.py's run of train.py
IMPORTED_DDP = 30


def files_a_step_calls(trainer, batch) -> set[str]:
    """The repository's files whose Python functions run during one ``trainer.train_step``."""
    from tests.ddp_worker import project_calls

    seen: set[str] = set()
    sys.setprofile(project_calls(seen))
    try:
        trainer.train_step(*batch)
    finally:
        sys.setprofile(None)
    return seen


def test_one_step_on_one_device_calls_these_files(cfg_factory, tmp_path):
    from training.context import RunContext
    from training.trainer import Trainer

    cfg = cfg_factory(num_iters=2, limit_nsamples=8)
    trainer = Trainer(cfg, RunContext(device=torch.device("cpu"), run_dir=tmp_path / "one"), 2)
    batches = iter(trainer.train_data)
    trainer.train_step(*next(batches))
    assert files_a_step_calls(trainer, next(batches)) == STEP_FILES_ONE_DEVICE


@pytest.mark.slow
def test_a_ddp_run_imports_these_modules_and_its_step_calls_these_files(cfg_factory, tmp_path):
    """Two torchrun ranks of train.py (with the tests' callbacks, tests/ddp_worker.py, which
    imports nothing more of the project), each a new interpreter timing its imports; step 1 of
    each rank is traced."""
    cfg = cfg_factory(num_iters=2, limit_nsamples=8, limit_nsamples_val=2, global_batch_size=4)
    yaml = write_test_yaml(tmp_path / "t.yaml", cfg)
    env = subprocess_env(PYTHONPROFILEIMPORTTIME="1", DDP_TEST_TRACE=f"1:{tmp_path / 'step'}")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc_per_node=2", str(REPO / "tests" / "ddp_worker.py"), "--yaml_config",
                             str(yaml), "--config", "e2e"],
                            capture_output=True, text=True, env=env, timeout=240, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = project_modules(result.stderr)  # both ranks' lines: the same modules
    assert "distributed.parallelize" in loaded and "training.pipelined" not in loaded
    assert len(loaded) == IMPORTED_DDP, sorted(loaded)
    for rank in (0, 1):
        assert set((tmp_path / f"step.rank{rank}").read_text().split()) == STEP_FILES_DDP


@pytest.mark.parametrize("page, numbers", [
    ("01-single-device.md", (len(STEP_FILES_ONE_DEVICE), IMPORTED_ONE_DEVICE)),
    ("03-data-parallel.md", (len(STEP_FILES_DDP), IMPORTED_DDP)),
])
def test_the_pages_state_the_counts(page, numbers):
    text = " ".join((REPO / "docs" / page).read_text().split())
    files, modules = numbers
    assert re.search(rf"\b{files} files\b", text) and \
        re.search(rf"\b{modules} of the project's modules\b", text), \
        f"{page} must say: one step calls functions of {files} files; a run imports {modules} of the " \
        f"project's modules"
