"""train_mp.py end to end: tensor parallel training equals serial training, and its checkpoints
hold consolidated tensors that load into any layout.

One train.py run (1 rank) and one train_mp.py run (torchrun, 2 ranks, tp=2) are made once
for the module; both use the same seed, data and global batch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ruamel.yaml import YAML

from distributed.consolidate import load_full_state
from distributed.mesh import ParallelMesh, build_mesh
from distributed.parallelize import apply_model_parallel
from networks.vit import build_vit
from tests.conftest import REPO, make_cfg, subprocess_env
from tests.dist_spawn import run_ranks
from utils.checkpoint import load
from utils.config import Config

pytestmark = [pytest.mark.timeout(240), pytest.mark.xdist_group("train_mp")]  # module fixture runs once

# fp32 with the same data order: only the summation order differs (split matmuls and
# all-reduces), about 1e-7 relative per step; 1e-5 leaves room for 6 Adam steps.
LOSS_RTOL = 1e-5


def _write_yaml(cfg: Config, path: Path) -> Path:
    with open(path, "w") as f:
        YAML().dump({"test": cfg.to_dict()}, f)
    return path


def _run(cmd: list[str], timeout: int = 180) -> None:
    result = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                            timeout=timeout)
    if result.returncode:
        raise AssertionError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stderr[-3000:]}")


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory):
    """(config, serial run dir, tp=2 run dir): 6 steps of global batch 4, 2 steps per epoch."""
    tmp = tmp_path_factory.mktemp("mp")
    cfg = make_cfg(data_dir, tmp / "logs", num_iters=6, limit_nsamples=8, limit_nsamples_val=8)
    yaml = _write_yaml(cfg, tmp / "test.yaml")
    common = ["--yaml_config", str(yaml), "--config", "test"]
    _run([sys.executable, "train.py", *common])
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
          "train_mp.py", *common, "--tensor_parallel", "2"])
    return cfg, tmp / "logs" / "test" / "1GPU" / "00", tmp / "logs" / "test" / "2GPU_tp2_cp1_dp1" / "00"


def test_tp2_logs_the_serial_losses(runs):
    _, serial_dir, tp2_dir = runs
    serial, tp2 = _metrics(serial_dir), _metrics(tp2_dir)
    assert [m["step"] for m in tp2] == [m["step"] for m in serial] == [2, 4, 6]
    for s, t in zip(serial, tp2):
        assert t["train_loss"] == pytest.approx(s["train_loss"], rel=LOSS_RTOL)
        assert t["val_loss"] == pytest.approx(s["val_loss"], rel=LOSS_RTOL)
    assert "Memory per rank (MiB): parameters" in (tp2_dir / "out.log").read_text()


def test_memory_per_rank_in_tensorboard(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg, _, tp2_dir = runs
    events = EventAccumulator(str(tp2_dir))
    events.Reload()
    logged = events.Scalars("Memory/parameters_MiB")
    assert [e.step for e in logged] == [2, 4, 6]
    with torch.device("meta"):  # the tp=2 shard's size, from the model itself
        mesh = ParallelMesh(sizes={"tp": 2, "cp": 1, "dp": 1}, coords={"tp": 0})
        shard = apply_model_parallel(build_vit(cfg.model), mesh)
    want = sum(p.numel() * 4 for p in shard.parameters()) / 2**20
    whole = sum(p.numel() * 4 for p in build_vit(cfg.model).parameters()) / 2**20
    assert logged[-1].value == pytest.approx(want) and want < 0.8 * whole  # embeddings, head stay whole
    steps = len(list(shard.parameters())) * 4  # Adam's per-parameter step counters
    assert events.Scalars("Memory/optimizer_MiB")[-1].value == pytest.approx(2 * want + steps / 2**20)


def test_tp2_checkpoint_is_consolidated(runs):
    cfg, serial_dir, tp2_dir = runs
    serial, tp2 = load(serial_dir / "checkpoint.pt"), load(tp2_dir / "checkpoint.pt")
    assert tp2["step"] == serial["step"] == 6
    model = build_vit(cfg.model)
    model.load_state_dict(tp2["model"])  # strict: every tensor whole, serial names
    # Adam's moments are gathered too, and equal the serial run's (the same fp32 tolerance
    # argument as for the losses; the floor covers moments of gradients that are rounding
    # noise, like the key bias's, which are ~1e-20 of the largest)
    for i, (name, p) in enumerate(model.named_parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            got, want = tp2["optimizer"]["state"][i][key], serial["optimizer"]["state"][i][key]
            assert got.shape == p.shape, name
            largest = max(s[key].abs().max() for s in serial["optimizer"]["state"].values())
            assert torch.allclose(got, want, rtol=1e-3, atol=1e-4 * largest), f"{key} of {name}"


def _outputs_agree_across_layouts(cfg: Config, tp2_ckpt: Path, tp1_ckpt: Path) -> None:
    mesh = build_mesh({"tp": 2, "cp": 1})
    x = torch.randn(2, cfg.n_in_channels, *cfg.img_size, generator=torch.Generator().manual_seed(3))
    for written_by, path in (("tp=2", tp2_ckpt), ("tp=1", tp1_ckpt)):
        state = load(path)["model"]
        serial = build_vit(cfg.model)
        serial.load_state_dict(state)
        par = apply_model_parallel(build_vit(cfg.model), mesh)
        load_full_state(par, state, mesh)
        with torch.no_grad():
            want, got = serial(x), par(x)
        # same weights, fp32: only summation order differs
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item()):
            raise AssertionError(f"checkpoint written with {written_by}: tp=2 and tp=1 outputs differ "
                                 f"by {(got - want).abs().max().item()}")


def test_checkpoint_loads_across_layouts(runs):
    cfg, serial_dir, tp2_dir = runs
    run_ranks(2, _outputs_agree_across_layouts, cfg, tp2_dir / "checkpoint.pt", serial_dir / "checkpoint.pt")


@pytest.mark.slow
def test_resume_tp2_from_a_serial_checkpoint(runs, tmp_path):
    """A tp=1 checkpoint (train.py, step 6) continues with tp=2 and sequence parallelism (the tokens
    between the tensor-parallel layers split over the 2 ranks) to step 8 exactly as train.py would."""
    import shutil

    cfg, serial_dir, _ = runs
    yaml = _write_yaml(cfg, tmp_path / "test.yaml")
    common = ["--yaml_config", str(yaml), "--config", "test", "--num_iters", "8", "--expdir",
              str(tmp_path / "logs")]
    for sub in ("1GPU", "2GPU_tp2_cp1_dp1"):
        (tmp_path / "logs" / "test" / sub / "00").mkdir(parents=True)
        shutil.copy(serial_dir / "checkpoint.pt", tmp_path / "logs" / "test" / sub / "00" / "checkpoint.pt")
    _run([sys.executable, "train.py", *common])
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
          "train_mp.py", *common, "--tensor_parallel", "2", "--sequence_parallel"])
    serial = _metrics(tmp_path / "logs" / "test" / "1GPU" / "00")
    tp2 = _metrics(tmp_path / "logs" / "test" / "2GPU_tp2_cp1_dp1" / "00")
    assert [m["step"] for m in tp2] == [m["step"] for m in serial] == [8]
    assert tp2[0]["train_loss"] == pytest.approx(serial[0]["train_loss"], rel=LOSS_RTOL)
    assert tp2[0]["val_loss"] == pytest.approx(serial[0]["val_loss"], rel=LOSS_RTOL)
    log = (tmp_path / "logs" / "test" / "2GPU_tp2_cp1_dp1" / "00" / "out.log").read_text()
    assert "sequence parallel: between the tensor-parallel layers this rank holds 16 of the 32 tokens" in log


def test_flags_and_layout_errors(cfg_factory, tmp_path, capsys):
    from training.launcher import arg_parser, main

    args = arg_parser().parse_args(["--row_parallel_size", "4", "--context_parallel", "2",
                                    "--parallel_order", "cp-tp-dp"])
    assert (args.tensor_parallel, args.context_parallel, args.parallel_order) == (4, 2, "cp-tp-dp")
    yaml = _write_yaml(cfg_factory(), tmp_path / "test.yaml")
    argv = ["--yaml_config", str(yaml), "--config", "test", "--tensor_parallel", "2"]
    code = main(argv=argv, model_parallel=True)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("error: world size 1 is not divisible by tensor_parallel x context_parallel")
    assert not (tmp_path / "logs").exists()  # nothing written for a run that cannot start
    code = main(argv=argv + ["--amp_mode", "fp16"], model_parallel=True)
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: amp_mode fp16 does not work with tensor_parallel > 1 (the ranks' loss scalers "
        "would skip different steps); use --amp_mode bf16")
