"""DeepSpeed's engine (train.py --engine deepspeed) against the serial run: ZeRO stages 1-3 with
accumulation and clipping, checkpoints that cross between the engines both ways (ZeRO-2 to native
to ZeRO-1), a stop signal and an exact resume (ZeRO-3); the generated config; the refusals.

Every run is 8 steps of global batch 8 (2 steps per epoch, the test model of test_sharded.py),
clipped on every step (the norms are about 0.28) with Adam at a constant rate (so that a run
continued with a larger --num_iters is the same run). The engine's runs take 2 micro-batches per
step. Without DeepSpeed installed (`make deepspeed`) they are skipped, unless REQUIRE_DEEPSPEED
is set (CI): then the last test fails. DeepSpeed's own launcher runs in the course check
(docs/10-deepspeed.md), which checks that it passed --local_rank.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, make_cfg, subprocess_env
from tests.ddp_helpers import WORKER, metrics, run, train_args, write_test_yaml
from tests.dist_spawn import run_ranks
from tests.slurm_harness import free_port
from tests.test_sharded import assert_same_losses
from training import deepspeed_engine
from training.schedule import make_lr_lambda
from training.trainer import EagerStep
from utils.signals import EXIT_STOPPED

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def engine_runs(test):
    """The engine's runs: one worker (they share the module's serial run), and skipped without
    DeepSpeed, except in CI (REQUIRE_DEEPSPEED: the last test fails instead)."""
    for mark in (pytest.mark.deepspeed, pytest.mark.timeout(300), pytest.mark.xdist_group("deepspeed"),
                 pytest.mark.skipif(not HAVE_DEEPSPEED and not os.environ.get("REQUIRE_DEEPSPEED"),
                                    reason="DeepSpeed is not installed (make deepspeed)")):
        test = mark(test)
    return test


COMMON = {"num_iters": 8, "limit_nsamples": 16, "limit_nsamples_val": 33, "grad_clip_norm": 0.05,
          "lr_schedule": "constant", "stop_check_every": 1}
ENGINE = {"engine": "deepspeed", "grad_accum_steps": 2}


def args(yaml: Path, data_dir: Path, expdir: Path, **extra) -> list[str]:
    return train_args(yaml, data_dir, expdir, **{**COMMON, **extra})


def config(yaml: Path, data_dir: Path, expdir: Path, **extra):
    """The Config train.py builds from these flags."""
    from training.launcher import arg_parser, resolve_config

    return resolve_config(arg_parser().parse_args(args(yaml, data_dir, expdir, **extra)))


@pytest.fixture(scope="module")
def test_yaml(tmp_path_factory) -> Path:
    return write_test_yaml(tmp_path_factory.mktemp("ds_yaml") / "ViT.yaml")


@pytest.fixture(scope="module")
def serial(data_dir, test_yaml, tmp_path_factory) -> list[dict]:
    expdir = tmp_path_factory.mktemp("ds_serial")
    result = run(1, args(test_yaml, data_dir, expdir))
    assert result.returncode == 0, result.stderr[-3000:]
    return metrics(expdir / "tiny" / "1GPU" / "00")


def _engines_on_ranks(cfgs: dict, root: Path) -> None:
    """Every run of the list in turn on this rank (2 ranks, gloo): ZeRO-1 from the start; then
    one run folder taken over by ZeRO-2 to step 4, the native engine (DDP) to step 6 and ZeRO-1
    to step 8, each resuming the checkpoint the other wrote."""
    from distributed.mesh import build_mesh
    from training.context import RunContext
    from training.trainer import Trainer

    rank = torch.distributed.get_rank()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")  # what DeepSpeed reads
    mesh = build_mesh({}, cfgs["zero1"].parallel_order, "cpu")
    for name, folder in (("zero1", "zero1"), ("zero2_to_4", "chain"), ("native_to_6", "chain"),
                         ("zero1_to_8", "chain"), ("zero3_onecycle", "onecycle")):
        cfg = cfgs[name]
        ctx = RunContext(device=torch.device("cpu"), run_dir=root / folder, rank=rank, world_size=2,
                         mesh=mesh)
        step = deepspeed_engine.DeepSpeedStep if cfg.engine == "deepspeed" else EagerStep
        trainer = Trainer(cfg, ctx, cfg.global_batch_size // 2, step=step)
        if name == "zero3_onecycle":  # the rate each optimizer step of the engine uses
            rates, engine_step = [], trainer.model.step

            def step(rates=rates, engine_step=engine_step, trainer=trainer):
                if trainer.model.is_gradient_accumulation_boundary():
                    rates.append(trainer.optimizer.param_groups[0]["lr"])
                engine_step()

            trainer.model.step = step
        trainer.fit()
        assert trainer.step == cfg.num_iters
        if name == "zero3_onecycle" and rank == 0:
            (root / "onecycle_rates.json").write_text(json.dumps(rates))


@engine_runs
def test_zero1_and_zero2_log_the_serial_losses_and_checkpoints_cross_between_engines(serial, data_dir,
                                                                                     test_yaml, tmp_path):
    """On 2 ranks with 2 micro-batches and clipping: ZeRO-1 logs the serial run's losses and
    gradient norms; ZeRO-2's checkpoint (step 4) continues in the native engine, whose checkpoint
    (step 6) continues on ZeRO-1, every epoch still the serial run's. ZeRO-3 with the one-cycle
    schedule steps with the project's rates (the engine runs the project's schedules)."""
    cfgs = {"zero1": config(test_yaml, data_dir, tmp_path, **ENGINE, zero_stage=1),
            "zero2_to_4": config(test_yaml, data_dir, tmp_path, **ENGINE, zero_stage=2, num_iters=4),
            "native_to_6": config(test_yaml, data_dir, tmp_path, num_iters=6),
            "zero1_to_8": config(test_yaml, data_dir, tmp_path, **ENGINE, zero_stage=1),
            "zero3_onecycle": config(test_yaml, data_dir, tmp_path, **ENGINE, zero_stage=3,
                                     lr_schedule="onecycle")}
    run_ranks(2, _engines_on_ranks, cfgs, tmp_path)
    onecycle = cfgs["zero3_onecycle"]
    schedule = make_lr_lambda(onecycle.optim)
    assert json.loads((tmp_path / "onecycle_rates.json").read_text()) == pytest.approx(
        [onecycle.lr * schedule(step) for step in range(onecycle.num_iters)], rel=1e-12)
    for folder in ("zero1", "chain"):
        logged = metrics(tmp_path / folder)
        assert [m["step"] for m in logged] == [2, 4, 6, 8], folder
        assert_same_losses(serial, logged)


@engine_runs
def test_a_stop_signal_checkpoints_and_the_rerun_resumes_exactly(serial, data_dir, test_yaml, tmp_path):
    """train.py --engine deepspeed --zero_stage 3 under torchrun, as users run it: a signal in step
    2 stops both ranks at step 4 with the stop status after the checkpoint; the same command again,
    started as srun starts it (SLURM_* variables only, no RANK or LOCAL_RANK, which DeepSpeed
    reads), resumes there; every epoch logs the serial run's losses; ds_config.json says what ran."""
    flags = args(test_yaml, data_dir, tmp_path, **ENGINE, zero_stage=3)
    first = run(2, flags, DDP_TEST_SIGNAL_AT="0:2")
    out = first.stdout + first.stderr
    assert first.returncode != 0 and f"exitcode  : {EXIT_STOPPED}" in out and "stopping at step 4 of 8" in out
    run_dir = tmp_path / "tiny" / "2GPU_ds3" / "00"
    assert [m["step"] for m in metrics(run_dir)] == [2, 4]
    slurm = {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "MASTER_PORT": str(free_port())}
    ranks = [subprocess.Popen([sys.executable, str(WORKER), *flags], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=subprocess_env(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), **slurm))
             for rank in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0] and "resumed from" in outs[0], outs[0][-3000:]
    logged = metrics(run_dir)
    assert [m["step"] for m in logged] == [2, 4, 6, 8]
    assert_same_losses(serial, logged)
    written = json.loads((run_dir / deepspeed_engine.CONFIG_NAME).read_text())
    assert written["zero_optimization"] == {"stage": 3} and written["gradient_accumulation_steps"] == 2
    assert written["gradient_clipping"] == 0.05 and written["train_batch_size"] == 8


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

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed raises ImportError
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    yaml = write_test_yaml(tmp_path / "ViT.yaml")
    code = main(argv=args(yaml, data_dir, tmp_path / "logs", engine="deepspeed", zero_stage=2))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "make deepspeed" in err[0], err
    assert not (tmp_path / "logs").exists()


def test_model_parallel_and_graph_scripts_refuse_the_engine(data_dir, tmp_path, capsys):
    from training.launcher import main

    yaml = write_test_yaml(tmp_path / "ViT.yaml")
    code = main(argv=args(yaml, data_dir, tmp_path / "logs", engine="deepspeed"), model_parallel=True)
    assert code == 2 and "use train.py --engine deepspeed" in capsys.readouterr().err
    from training.graphs import GraphStep

    code = main(GraphStep, args(yaml, data_dir, tmp_path / "logs", engine="deepspeed"))
    assert code == 2 and "run --engine deepspeed with train.py" in capsys.readouterr().err
    if os.environ.get("REQUIRE_DEEPSPEED"):  # CI installed it: the engine's runs above were not skipped
        assert HAVE_DEEPSPEED, "REQUIRE_DEEPSPEED is set but DeepSpeed is not installed: run make deepspeed"
