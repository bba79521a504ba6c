"""Pipeline parallelism against the serial run (same seed, data and global batch), launched by
torchrun as users do, and the pieces it is built from.

Every run: the test model with 4 blocks, 6 steps of global batch 8 (2 steps per epoch),
33 validation samples.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from distributed.pipeline import describe_split, rank_stages, split_blocks
from networks.vit import ViT, build_vit
from tests.conftest import make_cfg
from tests.ddp_helpers import metrics, run, run_dir, train_args, write_test_yaml
from tests.test_sharded import assert_same_losses, flags_to_args, ok
from utils.checkpoint import CHECKPOINT_NAME

pytestmark = pytest.mark.timeout(300)

COMMON = {"limit_nsamples": 16, "limit_nsamples_val": 33}
MP = {"DDP_TEST_MODEL_PARALLEL": "1"}  # the worker runs as train_mp.py


@pytest.fixture(scope="module")
def test_yaml(tmp_path_factory) -> Path:
    """The test model with 4 blocks, so that 4 stages (or 2 ranks x 2 interleaved) fit."""
    path = write_test_yaml(tmp_path_factory.mktemp("pipeline_yaml") / "ViT.yaml", depth=4)
    return path


def args(yaml: Path, data_dir: Path, expdir: Path, **extra) -> list[str]:
    valued, switches = flags_to_args({**COMMON, **extra})
    return train_args(yaml, data_dir, expdir, **valued) + switches


@pytest.fixture(scope="module")
def serial(data_dir, test_yaml, tmp_path_factory) -> list[dict]:
    expdir = tmp_path_factory.mktemp("serial")
    ok(run(1, args(test_yaml, data_dir, expdir)))
    return metrics(run_dir(expdir, 1))


# ------------------------------------------------------------------ the pieces ---
def test_blocks_split_into_contiguous_stages():
    assert split_blocks(4, 2) == [range(0, 2), range(2, 4)]
    assert split_blocks(4, 4) == [range(i, i + 1) for i in range(4)]
    # uneven: the middle stages take the extra blocks (the ends hold the embedding and head)
    assert [len(r) for r in split_blocks(5, 3)] == [2, 2, 1]
    assert [len(r) for r in split_blocks(10, 4)] == [2, 3, 3, 2]
    assert [len(r) for r in split_blocks(7, 3)] == [2, 3, 2]
    # interleaving: rank r holds stages r, r + p, ...
    assert rank_stages(1, 2, 2) == [1, 3] and rank_stages(0, 4, 1) == [0]


def test_a_stage_keeps_its_parts_under_the_serial_names(cfg_factory):
    cfg = cfg_factory(depth=4)
    names = [n for n, _ in build_vit(cfg.model).named_parameters()]
    kept = []
    for s, blocks in enumerate(split_blocks(4, 3)):
        stage = build_vit(cfg.model).cut(blocks, s == 0, s == 2)
        own = [n for n, _ in stage.named_parameters()]
        assert ("pos_embed" in own) == (s == 0) and ("head.weight" in own) == (s == 2)
        kept += own
    assert sorted(kept) == sorted(names)  # every parameter in exactly one stage, names unchanged
    assert describe_split(split_blocks(4, 2), 2, ViT.LABELS) == (
        "stage 0 (rank 0 of the pipeline): embedding + blocks 0-1; "
        "stage 1 (rank 1 of the pipeline): blocks 2-3 + head")


@pytest.mark.parametrize("flags, message", [
    ({"pipeline_parallel": 3}, "pipeline_parallel 3 stages for 2 transformer blocks"),
    ({"pipeline_parallel": 2, "depth": 2, "pipeline_schedule": "interleaved_1f1b"},
     "pipeline_parallel 2 x stages_per_rank 2 = 4 stages for 2 transformer blocks"),
    ({"pipeline_parallel": 2, "num_microbatches": 1}, "1f1b schedule needs at least as many micro-batches"),
    ({"pipeline_parallel": 2, "depth": 4, "num_microbatches": 5, "pipeline_schedule": "interleaved_1f1b"},
     "must be a multiple of 2"),
    ({"pipeline_parallel": 2, "amp_mode": "fp16"}, "fp16 is not supported with pipeline_parallel"),
    ({"pipeline_parallel": 2, "context_parallel": 2}, "does not combine with context_parallel"),
    ({"pipeline_parallel": 2, "grad_accum_steps": 2}, "use --num_microbatches instead"),
    ({"pipeline_parallel": 2, "depth": 4, "pipeline_schedule": "zero_bubble", "data_parallel": "fsdp"},
     "zero_bubble schedule with data_parallel fsdp"),
    ({"pipeline_parallel": 2, "depth": 4, "pipeline_schedule": "zero_bubble", "enable_jit": True},
     "torch.compile'd blocks do not allow"),
])
def test_impossible_pipelines_are_refused(flags, message, data_dir, tmp_path):
    with pytest.raises(ValueError, match=message):
        make_cfg(data_dir, tmp_path, depth=flags.pop("depth", 2), **flags)


def test_micro_batches_must_divide_the_local_batch(data_dir, test_yaml, tmp_path):
    result = run(2, args(test_yaml, data_dir, tmp_path, pipeline_parallel=2, num_microbatches=3),
                 **MP)
    # each rank exits 2 with the one line (no traceback of ours); torchrun then reports the
    # failure with status 1 and its own traceback
    assert result.returncode != 0 and "ValueError" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors and "does not split into --num_microbatches 3" in errors[0]


def test_pipeline_flags_need_train_mp(data_dir, test_yaml, tmp_path):
    result = run(1, args(test_yaml, data_dir, tmp_path, pipeline_parallel=2))
    assert result.returncode == 2
    assert "pipeline_parallel=2: model parallel runs use train_mp.py" in result.stderr


# ------------------------------------------------------- the serial run's losses ---
PP2 = {"pipeline_parallel": 2}
CLIP = 0.05  # below every step's gradient norm here
# with clipping, against the same serial run (LAMB's rate is relative: 0.05 trains visibly here)
LAMB = {"optimizer_type": "LAMB", "weight_decay": 0.01, "lr": 0.05}
# Every schedule is proven in one run, combined with another dimension where it can be
# (gpipe with tp, 1f1b at 4 stages, zero bubble with dp and checkpointing).
VARIANTS = {  # name: (ranks, flags)
    "interleaved_1f1b": (2, {**PP2, "pipeline_schedule": "interleaved_1f1b"}),
    "pp4_1f1b": (4, {"pipeline_parallel": 4}),
    # the stages average their gradients over dp themselves (2 micro-batches on 2 stages: where
    # DDP inside torch's stages failed intermittently), here with zero bubble's split backward
    # and every block recomputed
    "pp2_x_dp2_zero_bubble_checkpointing": (4, {**PP2, "num_microbatches": 2,
                                                "pipeline_schedule": "zero_bubble",
                                                "activation_checkpointing": "full"}),
    "pp2_x_dp2_fsdp": (4, {**PP2, "data_parallel": "fsdp"}),
    # clipped: the norm's squares summed over the stages and the tp slices
    # and LAMB: its per-tensor norms summed over the tp slices (each stage holds its own tensors)
    "pp2_x_tp2_clipped_lamb": (4, {**PP2, "tensor_parallel": 2, "pipeline_schedule": "gpipe",
                                   "grad_clip_norm": CLIP, **LAMB}),
}


@pytest.fixture(scope="module")
def serial_clipped(data_dir, test_yaml, tmp_path_factory) -> list[dict]:
    expdir = tmp_path_factory.mktemp("serial_clipped")
    ok(run(1, args(test_yaml, data_dir, expdir, grad_clip_norm=CLIP, **LAMB)))
    logged = metrics(run_dir(expdir, 1))
    assert all(m["grad_norm_mean"] > CLIP for m in logged)  # clipping acts on the steps
    return logged


@pytest.mark.parametrize("name", VARIANTS)
def test_pipeline_logs_the_serial_losses(name, data_dir, test_yaml, tmp_path, request):
    ranks, flags = VARIANTS[name]
    serial = request.getfixturevalue("serial_clipped" if "grad_clip_norm" in flags else "serial")
    ok(run(ranks, args(test_yaml, data_dir, tmp_path, **flags), timeout=240, **MP))
    layout = next((tmp_path / "tiny").iterdir())
    assert layout.name.endswith(f"_pp{flags['pipeline_parallel']}")
    logged = metrics(layout / "00")
    assert [m["step"] for m in logged] == [2, 4, 6]
    assert_same_losses(serial, logged)


# ------------------------------------------------------------------ checkpoints ---
@pytest.fixture(scope="module")
def interrupted(data_dir, test_yaml, tmp_path_factory) -> Path:
    """A pp=2 run with a consolidated checkpoint at step 3 (mid-epoch), then a failure."""
    expdir = tmp_path_factory.mktemp("interrupted")
    result = run(2, args(test_yaml, data_dir, expdir, checkpoint_every=3, **PP2),
                 DDP_TEST_RAISE_AT="1:4", **MP)
    assert result.returncode != 0
    folder = next((expdir / "tiny").iterdir()) / "00"
    assert (folder / CHECKPOINT_NAME).is_file()
    return folder


@pytest.mark.parametrize("ranks, script, layout, flags", [
    (1, "train.py", "1GPU", {}),  # pp = 1 (train_mp.py at pp 1 runs the same code in another folder)
    (4, "train_mp.py", "4GPU_tp1_cp1_dp1_pp4", {"pipeline_parallel": 4}),
])
def test_a_pipeline_checkpoint_resumes_in_any_layout(interrupted, serial, data_dir, test_yaml,
                                                     tmp_path, ranks, script, layout, flags):
    target = tmp_path / "tiny" / layout / "00"
    target.mkdir(parents=True)
    shutil.copy(interrupted / CHECKPOINT_NAME, target / CHECKPOINT_NAME)
    env = MP if script == "train_mp.py" else {}
    ok(run(ranks, args(test_yaml, data_dir, tmp_path, **flags), timeout=240, **env))
    resumed = metrics(target)
    assert [m["step"] for m in resumed] == [4, 6]
    assert_same_losses(serial, resumed)


def test_a_serial_checkpoint_resumes_in_a_pipeline(serial, data_dir, test_yaml, tmp_path):
    first = tmp_path / "first"  # a checkpoint at step 3, then a failure
    assert run(1, args(test_yaml, data_dir, first, checkpoint_every=3),
               DDP_TEST_RAISE_AT="0:4").returncode != 0
    target = tmp_path / "tiny" / "2GPU_tp1_cp1_dp1_pp2" / "00"
    target.mkdir(parents=True)
    shutil.copy(run_dir(first, 1) / CHECKPOINT_NAME, target / CHECKPOINT_NAME)
    ok(run(2, args(test_yaml, data_dir, tmp_path, pipeline_schedule="interleaved_1f1b", **PP2),
           timeout=240, **MP))
    assert [m["step"] for m in metrics(target)] == [4, 6]
    assert_same_losses(serial, metrics(target))


# ------------------------------------------------------------------- the report ---
def test_saved_tensor_meter_counts_what_backward_holds():
    import torch

    from utils.profiling import SavedTensorMeter

    meter = SavedTensorMeter()
    w = torch.nn.Parameter(torch.ones(256, 256))
    x = torch.ones(64, 256, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        y = (x @ w).relu()  # matmul saves x (and w, a parameter: not counted), relu its output
        held = meter.now
        y.sum().backward()
    del y
    assert held == 2 * 64 * 256 * 4 and meter.peak == held
    assert meter.now == 0  # released once backward is done with them


def test_report_records_every_micro_batch_of_every_stage(data_dir, test_yaml, tmp_path):
    import json
    import subprocess
    import sys

    from tests.conftest import REPO, subprocess_env

    out = tmp_path / "report"
    result = subprocess.run(
        [sys.executable, "scripts/pipeline_report.py", "--config", "tiny", "--yaml_config", str(test_yaml),
         "--schedules", "1f1b", "--stages", "2", "--microbatches", "4", "--steps", "2", "--batch", "8",
         "--timeline", "2:4", "--out", str(out), "--", "--data_dir", str(data_dir)],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=240)
    ok(result)
    (row,) = json.loads((out / "pipeline.json").read_text())
    assert row["bubble_on_paper"] == pytest.approx(1 / 5)  # (p - 1) / (m + p - 1)
    assert 0 < row["bubble_measured"] < 1 and all(mib > 0 for mib in row["saved_MiB"])
    for lane in row["timeline"]:
        runs = sorted((kind, mb) for kind, _, mb, _, _ in lane["events"])
        assert runs == sorted((k, mb) for k in "FB" for mb in range(4)), lane["rank"]
    assert (out / "pipeline_timeline.png").stat().st_size > 10_000


@pytest.mark.parametrize("first, last, validating, moved", [
    (True, False, False, ("inp",)), (False, False, False, ()), (False, True, False, ("tar",)),
    (False, True, True, ("inp", "tar")), (True, True, False, ("inp", "tar")),
])
def test_a_stage_copies_only_what_it_reads(first, last, validating, moved):
    """The batch goes to a stage's device only where the stage reads it (the meta device stands
    in for a GPU: a tensor moved there is no longer on the CPU)."""
    from types import SimpleNamespace

    from training.pipelined import PipelineStep

    fake = SimpleNamespace(device=torch.device("meta"), model=SimpleNamespace(is_first=first, is_last=last))
    inp, tar = PipelineStep(fake).to_device(torch.zeros(2, 3), torch.zeros(2, 3), validating=validating)
    assert tuple(n for n, t in (("inp", inp), ("tar", tar)) if t.is_meta) == moved
