"""--memory_snapshot (utils/profiling.py, MemoryRecord) and scripts/plot_memory.py."""

import json

import pytest
import torch

from tests.conftest import REPO  # noqa: F401  (puts the repository on sys.path)
from training.context import RunContext
from training.trainer import Trainer


@pytest.fixture(scope="module")
def recorded(data_dir, tmp_path_factory):
    from tests.conftest import make_cfg

    tmp = tmp_path_factory.mktemp("memory")
    cfg = make_cfg(data_dir, tmp / "logs", memory_snapshot=True, num_iters=3)
    trainer = Trainer(cfg, RunContext(device=torch.device("cpu"), run_dir=tmp / "run"), 4)
    trainer.fit()
    return trainer, tmp / "run"


def test_one_step_by_kind(recorded):
    trainer, run_dir = recorded
    files = sorted(p.name for p in (run_dir / "memory").iterdir())
    assert files == ["memory_phases_rank0.json"]  # CPU: no allocator history
    record = json.loads((run_dir / "memory" / files[0]).read_text())
    assert record["step"] == 1  # the second step: Adam's state exists
    phases = {p["phase"]: p for p in record["phases"]}
    assert list(phases) == ["start", "forward", "backward", "optimizer"]
    weights = 4 * trainer.n_params  # fp32
    assert all(p["parameters"] == weights for p in phases.values())
    # Adam: two moments per parameter, and a step count per tensor
    assert all(p["optimizer_state"] >= 2 * weights for p in phases.values())
    assert phases["start"]["gradients"] == 0 and phases["backward"]["gradients"] == weights
    assert phases["optimizer"]["gradients"] == 0  # zero_grad(set_to_none) ends the range
    assert phases["forward"]["activations"] > weights  # kept for backward...
    assert phases["backward"]["activations"] == 0  # ...and released by it
    assert record["activations_peak"] >= phases["forward"]["activations"]
    assert record["process_peak"] > 0


def test_plot_and_its_one_line_error(recorded, tmp_path, capsys):
    from scripts.plot_memory import main

    _, run_dir = recorded
    assert main([str(run_dir), str(run_dir), "--out", str(tmp_path / "m.png")]) == 0
    assert (tmp_path / "m.png").stat().st_size > 0
    assert main([str(tmp_path), "--out", str(tmp_path / "n.png")]) == 2
    assert capsys.readouterr().err.startswith("error: ") and not (tmp_path / "n.png").exists()


def test_the_allocator_history_keeps_python_stacks_only(monkeypatch):
    """C++ frames would be symbolised one by one when the snapshot is written (minutes for a
    step's events), inside a training step that the heartbeat watches: Python stacks only."""
    from utils import compat

    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kwargs: calls.append(kwargs))
    compat.cuda_memory_history(True)
    compat.cuda_memory_history(False)
    assert calls[0] == {"max_entries": 100_000, "enabled": "all", "stacks": "python"}
    assert calls[1]["enabled"] is None


@pytest.mark.cuda
def test_a_gpu_step_is_recorded_with_python_frames_only(data_dir, tmp_path):
    import pickle
    import time

    from tests.conftest import make_cfg

    cfg = make_cfg(data_dir, tmp_path / "logs", memory_snapshot=True, num_iters=3)
    trainer = Trainer(cfg, RunContext(device=torch.device("cuda", 0), run_dir=tmp_path / "run"), 4)
    start = time.monotonic()
    trainer.fit()
    assert time.monotonic() - start < 60
    snapshot = pickle.loads((tmp_path / "run" / "memory" / "memory_snapshot_rank0.pickle").read_bytes())
    frames = [f for trace in snapshot["device_traces"] for event in trace for f in event.get("frames", [])]
    assert frames and all(f["filename"].endswith(".py") or f["filename"].startswith("<") for f in frames), \
        sorted({f["filename"] for f in frames})[:20]
