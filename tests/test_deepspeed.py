"""DeepSpeed's engine (train.py --engine deepspeed) against the serial run: ZeRO stages 1-3 with
accumulation and clipping, a stop signal and an exact resume, checkpoints that cross between the
engines both ways, DeepSpeed's own launcher; the generated config; the refusals.

The runs are train.py's (the fault-injecting tests/ddp_worker.py), 6 steps of global batch 8 as
test_sharded.py's, clipped (every step: the norms are about 0.28) with Adam. Without DeepSpeed
installed (`make deepspeed`) the engine's runs are skipped, unless REQUIRE_DEEPSPEED is set (CI).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, make_cfg, subprocess_env
from tests.ddp_helpers import metrics, run, train_args, write_test_yaml
from tests.test_sharded import assert_same_losses
from training import deepspeed_engine
from utils.checkpoint import CHECKPOINT_NAME
from utils.signals import EXIT_STOPPED

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def engine_runs(test):
    """The engine's multi-rank runs: one worker (they share the module's reference runs), and
    skipped without DeepSpeed, except in CI (REQUIRE_DEEPSPEED: the last test fails instead)."""
    for mark in (pytest.mark.deepspeed, pytest.mark.timeout(300), pytest.mark.xdist_group("deepspeed"),
                 pytest.mark.skipif(not HAVE_DEEPSPEED and not os.environ.get("REQUIRE_DEEPSPEED"),
                                    reason="DeepSpeed is not installed (make deepspeed)")):
        test = mark(test)
    return test
COMMON = {"limit_nsamples": 16, "limit_nsamples_val": 33, "grad_clip_norm": 0.05, "stop_check_every": 1}
ENGINE = {"engine": "deepspeed", "grad_accum_steps": 2}


def args(yaml: Path, data_dir: Path, expdir: Path, **extra) -> list[str]:
    return train_args(yaml, data_dir, expdir, **{**COMMON, **extra})


def ok(result: subprocess.CompletedProcess, code: int = 0) -> None:
    assert result.returncode == code, result.stdout[-3000:] + result.stderr[-3000:]


def folder(expdir: Path, ranks: int, stage: int | None = None) -> Path:
    return Path(expdir) / "tiny" / (f"{ranks}GPU" + ("" if stage is None else f"_ds{stage}")) / "00"


@pytest.fixture(scope="module")
def test_yaml(tmp_path_factory) -> Path:
    return write_test_yaml(tmp_path_factory.mktemp("ds_yaml") / "ViT.yaml")


@pytest.fixture(scope="module")
def serial(data_dir, test_yaml, tmp_path_factory) -> list[dict]:
    expdir = tmp_path_factory.mktemp("ds_serial")
    ok(run(1, args(test_yaml, data_dir, expdir)))
    return metrics(folder(expdir, 1))


@pytest.fixture(scope="module")
def native_stopped(data_dir, test_yaml, tmp_path_factory) -> Path:
    """A native run (one process) stopped by a signal in step 3: its checkpoint at step 4."""
    expdir = tmp_path_factory.mktemp("ds_native_stopped")
    ok(run(1, args(test_yaml, data_dir, expdir), DDP_TEST_SIGNAL_AT="0:3"), EXIT_STOPPED)
    return folder(expdir, 1)


@engine_runs
def test_zero3_stops_resumes_exactly_and_continues_in_the_native_engine(serial, data_dir, test_yaml,
                                                                        tmp_path):
    """ZeRO-3 on 2 ranks: a signal in step 2 checkpoints (step 4) and exits with the stop status;
    the rerun resumes; every logged loss is the serial run's. Its step-4 checkpoint, copied to a
    native one-process run, continues to the serial run's last loss too."""
    stage = 3
    flags = args(test_yaml, data_dir, tmp_path, **ENGINE, zero_stage=stage)
    first = run(2, flags, DDP_TEST_SIGNAL_AT="0:2")
    assert first.returncode != 0 and "stopping at step 4 of 6" in first.stdout + first.stderr
    run_dir = folder(tmp_path, 2, stage)
    assert [m["step"] for m in metrics(run_dir)] == [2, 4]
    native = folder(tmp_path / "native", 1)
    native.mkdir(parents=True)
    shutil.copy(run_dir / CHECKPOINT_NAME, native / CHECKPOINT_NAME)
    ok(run(2, flags))
    logged = metrics(run_dir)
    assert [m["step"] for m in logged] == [2, 4, 6]
    assert_same_losses(serial, logged)
    written = json.loads((run_dir / deepspeed_engine.CONFIG_NAME).read_text())
    assert written["zero_optimization"] == {"stage": stage} and written["gradient_accumulation_steps"] == 2
    ok(run(1, args(test_yaml, data_dir, tmp_path / "native")))
    continued = metrics(native)
    assert [m["step"] for m in continued] == [6]
    assert_same_losses(serial, continued)


@engine_runs
def test_native_checkpoint_continues_on_zero1_and_the_deepspeed_launcher_runs_zero2(
        serial, native_stopped, data_dir, test_yaml, tmp_path):
    """A native checkpoint (step 4) continues on DeepSpeed at ZeRO-1 (2 ranks, torchrun) with the
    serial run's losses; ZeRO-2 started by DeepSpeed's launcher (`deepspeed --num_gpus 2`, which
    passes --local_rank) logs the serial run's losses from the start."""
    target = folder(tmp_path / "zero1", 2, 1)
    target.mkdir(parents=True)
    shutil.copy(native_stopped / CHECKPOINT_NAME, target / CHECKPOINT_NAME)
    ok(run(2, args(test_yaml, data_dir, tmp_path / "zero1", **ENGINE, zero_stage=1)))
    assert_same_losses(serial, metrics(target))
    assert [m["step"] for m in metrics(target)] == [6]

    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
                str(REPO / "tests" / "ddp_worker.py")]
    result = subprocess.run(launcher + args(test_yaml, data_dir, tmp_path / "zero2", **ENGINE, zero_stage=2),
                            cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=240)
    ok(result)
    assert "--local_rank=1" in result.stdout + result.stderr  # the launcher's own way was taken
    assert_same_losses(serial, metrics(folder(tmp_path / "zero2", 2, 2)))


# ----------------------------------------------------------------- no ranks needed ---
def test_generated_config_maps_the_keys(data_dir, tmp_path):
    cfg = make_cfg(data_dir, tmp_path, engine="deepspeed", zero_stage=3, cpu_offload=True, amp_mode="bf16",
                   grad_accum_steps=4, grad_clip_norm=1.0)
    ds = deepspeed_engine.ds_config(cfg, local_batch=8, dp_size=4, device=torch.device("cpu"))
    assert ds["train_batch_size"] == 32 and ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 4 and ds["gradient_clipping"] == 1.0
    assert ds["bf16"] == {"enabled": True}
    host = {"device": "cpu", "pin_memory": False}
    assert ds["zero_optimization"] == {"stage": 3, "offload_optimizer": host, "offload_param": host}
    two = deepspeed_engine.ds_config(make_cfg(data_dir, tmp_path, engine="deepspeed", zero_stage=2,
                                              cpu_offload=True), 4, 2, torch.device("cpu"))
    assert two["zero_optimization"] == {"stage": 2, "offload_optimizer": host}
    assert two["bf16"] == {"enabled": False} and two["gradient_clipping"] == 0.0


@pytest.mark.parametrize("overrides, message", [
    ({"zero_stage": 2}, "--zero_stage is DeepSpeed's: add --engine deepspeed"),
    ({"engine": "deepspeed", "zero_stage": 4}, "'zero_stage' must be 0, 1, 2 or 3"),
    ({"engine": "deepspeed", "data_parallel": "fsdp"}, "does not run --data_parallel fsdp"),
    ({"engine": "deepspeed", "optimizer_type": "LAMB"}, "does not run --optimizer LAMB"),
    ({"engine": "deepspeed", "amp_mode": "fp16"}, "does not run --amp_mode fp16"),
    ({"engine": "deepspeed", "cpu_offload": True}, "--cpu_offload at --zero_stage 0"),
])
def test_what_the_engine_refuses_is_one_line(data_dir, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        make_cfg(data_dir, tmp_path, **overrides)


def test_without_deepspeed_the_flag_stops_in_one_line(data_dir, tmp_path, monkeypatch, capsys):
    """As if DeepSpeed were not installed (its import fails): exit 2, one line naming make deepspeed,
    nothing written."""
    from training.launcher import main
    from training.trainer import Trainer

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed raises ImportError
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    yaml = write_test_yaml(tmp_path / "ViT.yaml")
    code = main(Trainer, args(yaml, data_dir, tmp_path / "logs", engine="deepspeed", zero_stage=2))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "make deepspeed" in err[0], err
    assert not (tmp_path / "logs").exists()


def test_model_parallel_and_graph_scripts_refuse_the_engine(data_dir, tmp_path, capsys):
    from training.launcher import main
    from training.trainer import Trainer

    yaml = write_test_yaml(tmp_path / "ViT.yaml")
    code = main(Trainer, args(yaml, data_dir, tmp_path / "logs", engine="deepspeed"), model_parallel=True)
    assert code == 2 and "use train.py --engine deepspeed" in capsys.readouterr().err
    from training.graphs import GraphTrainer

    code = main(GraphTrainer, args(yaml, data_dir, tmp_path / "logs", engine="deepspeed"))
    assert code == 2 and "run --engine deepspeed with train.py" in capsys.readouterr().err
    if os.environ.get("REQUIRE_DEEPSPEED"):  # CI installed it: the engine's runs above were not skipped
        assert HAVE_DEEPSPEED, "REQUIRE_DEEPSPEED is set but DeepSpeed is not installed: run make deepspeed"
