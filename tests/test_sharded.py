"""Sharded data parallelism, gradient accumulation, sharded checkpoints and restarts, against
the serial run (same seed, data and global batch), launched by torchrun as users do.

Every run: 6 steps of global batch 8, 2 steps per epoch (3 metrics lines), 33 validation
samples (on 2 ranks 17 and 16: 5 and 4 batches, so FSDP's validation runs in lockstep).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distributed.mesh import build_mesh
from distributed.shards import local
from tests.conftest import REPO, make_cfg, subprocess_env
from tests.ddp_helpers import metrics, run, run_dir, train_args, write_test_yaml
from tests.dist_spawn import run_ranks
from training import sharded_checkpoint as sharded
from training.context import RunContext
from training.trainer import Trainer
from utils.checkpoint import CHECKPOINT_NAME

pytestmark = pytest.mark.timeout(300)

LOSS_RTOL = 1e-5  # fp32: only the order of sums differs (sharded reductions, micro-batches)
COMMON = {"limit_nsamples": 16, "limit_nsamples_val": 33}


@pytest.fixture(scope="module")
def test_yaml(tmp_path_factory) -> Path:
    return write_test_yaml(tmp_path_factory.mktemp("sharded_yaml") / "ViT.yaml")


def args(yaml: Path, data_dir: Path, expdir: Path, **extra) -> list[str]:
    return train_args(yaml, data_dir, expdir, **{**COMMON, **extra})


def ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.fixture(scope="module")
def serial(data_dir, test_yaml, tmp_path_factory) -> list[dict]:
    expdir = tmp_path_factory.mktemp("serial")
    ok(run(1, args(test_yaml, data_dir, expdir)))
    return metrics(run_dir(expdir, 1))


# below every step's gradient norm here: clipping acts on each step. The clipped runs also step
# with LAMB (weight decay included), whose per-tensor norms span the ranks' parts of each tensor
# (distributed/lamb.py): ZeRO-1 (whole tensors), FSDP x tp (shards and slices), HSDP
# (LAMB's rate is relative, a step moves each tensor by lr times its norm: 0.05 trains visibly here)
CLIP = {"grad_clip_norm": 0.05, "optimizer_type": "LAMB", "weight_decay": 0.01, "lr": 0.05}


@pytest.fixture(scope="module")
def serial_clipped(data_dir, test_yaml, tmp_path_factory) -> list[dict]:
    expdir = tmp_path_factory.mktemp("serial_clipped")
    ok(run(1, args(test_yaml, data_dir, expdir, **CLIP)))
    return metrics(run_dir(expdir, 1))


# a mixture of experts in every block, top-2, with a capacity that drops tokens: its capacity
# and balancing loss are per sample, so 2 DDP ranks of 2 micro-batches each compute the serial run
# (clipped: the global norm sums each expert once, on the rank that holds it)
MOE = {"num_experts": 4, "moe_top_k": 2, "moe_every": 1, "moe_capacity_factor": 0.75, "moe_aux_weight": 0.1,
       "grad_clip_norm": 0.2}


@pytest.fixture(scope="module")
def serial_moe_dir(data_dir, test_yaml, tmp_path_factory) -> Path:
    expdir = tmp_path_factory.mktemp("serial_moe")
    ok(run(1, args(test_yaml, data_dir, expdir, **MOE)))
    logged = metrics(run_dir(expdir, 1))
    assert all(layer[4] > 0 for m in logged for layer in m["moe"])  # the capacity dropped tokens
    assert all(m["grad_norm_mean"] > MOE["grad_clip_norm"] for m in logged)  # and clipping clipped
    return run_dir(expdir, 1)


@pytest.fixture(scope="module")
def serial_moe(serial_moe_dir) -> list[dict]:
    return metrics(serial_moe_dir)


def test_clipping_acts_on_every_step(serial_clipped):
    """In the clipped reference the gradient norm is above the limit on the steps, so the
    clipped layouts below clip too. (Adam barely notices gradients scaled by a steady factor,
    so the layouts are also compared on the norm they log, which must be the serial one.)"""
    assert all(m["grad_norm_max"] >= m["grad_norm_mean"] > CLIP["grad_clip_norm"] for m in serial_clipped)


def assert_same_losses(reference: list[dict], run: list[dict]) -> None:
    by_step = {m["step"]: m for m in reference}
    assert run and all(m["step"] in by_step for m in run)
    for m in run:
        ref = by_step[m["step"]]
        assert m["train_loss"] == pytest.approx(ref["train_loss"], rel=LOSS_RTOL), m["step"]
        assert m["val_loss"] == pytest.approx(ref["val_loss"], rel=LOSS_RTOL), m["step"]
        for key in ("grad_norm_mean", "grad_norm_max"):  # clipped runs: the norm before clipping
            assert (key in m) == (key in ref), key
            if key in ref:
                assert m[key] == pytest.approx(ref[key], rel=LOSS_RTOL), (key, m["step"])


FSDP = {"data_parallel": "fsdp"}
# Each option is proven in at least one run, combined where a run can hold several (plain
# fsdp and zero1 are inside their combinations with accumulation, checkpointing and tp).
VARIANTS = {  # name: (ranks, flags, model parallel (train_mp.py))
    "fsdp_keep_gathered": (2, {**FSDP, "reshard_after_forward": False}, False),
    "accumulation": (1, {"grad_accum_steps": 4}, False),
    # ZeRO-1 with context parallelism (gradients summed over cp, replicated over dp), clipped
    "zero1_x_cp2_accumulation_clipped_lamb": (4, {"data_parallel": "zero1", "context_parallel": 2,
                                                  "grad_accum_steps": 2, **CLIP}, True),
    # the command: 4 ranks, FSDP, every block recomputed, 2 micro-batches
    "fsdp_checkpointing_accumulation": (4, {**FSDP, "activation_checkpointing": "full",
                                            "grad_accum_steps": 2}, False),
    # the norm's squares summed over the FSDP shards and the tp slices, replicated ones once
    "fsdp_x_tp_clipped_lamb": (4, {**FSDP, "tensor_parallel": 2, **CLIP}, True),
    # HSDP: 2 groups of 2 ranks, each sharding the model, shards in host memory; clipped (the
    # norm sums over a sharding group only)
    "hsdp_offload_clipped_lamb": (4, {"data_parallel": "hsdp", "dp_shard": 2, "cpu_offload": True,
                                      **CLIP}, False),
}


def flags_to_args(flags: dict) -> tuple[dict, list[str]]:
    """Valued flags for train_args, and switches (``--no-X``, ``--X``) as arguments."""
    switches = [f"--{k}" if v else f"--no-{k}" for k, v in flags.items() if isinstance(v, bool)]
    return {k: v for k, v in flags.items() if not isinstance(v, bool)}, switches


@pytest.mark.parametrize("name", VARIANTS)
def test_layout_logs_the_serial_losses(name, data_dir, test_yaml, tmp_path, request):
    ranks, flags, mp = VARIANTS[name]
    reference = ("serial_moe" if "num_experts" in flags
                 else "serial_clipped" if "grad_clip_norm" in flags else "serial")
    serial = request.getfixturevalue(reference)
    valued, switches = flags_to_args(flags)
    env = {"DDP_TEST_MODEL_PARALLEL": "1"} if mp else {}
    ok(run(ranks, args(test_yaml, data_dir, tmp_path, **valued) + switches, timeout=240, **env))
    layout = next((tmp_path / "tiny").iterdir())
    logged = metrics(layout / "00")
    assert [m["step"] for m in logged] == [2, 4, 6]
    assert_same_losses(serial, logged)


def test_expert_parallel_trains_and_checkpoints_the_serial_model(serial_moe_dir, data_dir, test_yaml,
                                                                tmp_path):
    """train_mp.py on 2 ranks splitting the 4 experts of each layer (expert_parallel 2: tokens
    exchanged by all-to-all), top-2 with a capacity that drops, each batch as 2 micro-batches,
    clipped: the serial losses, and a checkpoint holding the serial model and optimizer state
    (every expert, gathered from its owner, under its serial name and index). Other layouts
    (tp x ep, dp 4 in 2 blocks) against the serial model, and a serial checkpoint loaded into 2
    expert-parallel ranks: test_model_parallel.py."""
    ok(run(2, args(test_yaml, data_dir, tmp_path, expert_parallel=2, grad_accum_steps=2, **MOE),
           DDP_TEST_MODEL_PARALLEL="1"))
    folder = tmp_path / "tiny" / "2GPU_tp1_cp1_dp2_ep2" / "00"
    assert_same_losses(metrics(serial_moe_dir), metrics(folder))
    mine, serial = (torch.load(d / CHECKPOINT_NAME, weights_only=False) for d in (folder, serial_moe_dir))
    assert list(mine["model"]) == list(serial["model"])
    for name, t in serial["model"].items():
        torch.testing.assert_close(mine["model"][name], t, rtol=1e-4, atol=1e-6, msg=name)
    assert sorted(mine["optimizer"]["state"]) == sorted(serial["optimizer"]["state"])
    for i, entry in serial["optimizer"]["state"].items():
        torch.testing.assert_close(mine["optimizer"]["state"][i]["exp_avg"], entry["exp_avg"], rtol=1e-3,
                                   atol=1e-7)


def _name(cfg) -> str:
    return cfg.data_parallel + ("_offload" if cfg.cpu_offload else "")


def _memory_per_rank(cfgs, run_dir_path, out_dir, world):
    """In every rank, for each layout in turn (one job for all of them): one step, then what this
    rank holds, in elements, and its memory report as a GPU run's ("meta" stands in for the GPU:
    what stays in host memory is then reported as such)."""
    from training import reporting

    rank = torch.distributed.get_rank()
    mesh = build_mesh({}, cfgs[0].parallel_order, "cpu")
    for cfg in cfgs:
        ctx = RunContext(device=torch.device("cpu"), run_dir=run_dir_path / _name(cfg), rank=rank,
                         world_size=world, mesh=mesh)
        trainer = Trainer(cfg, ctx, cfg.global_batch_size // world)
        inp, tar = next(iter(trainer.train_data))
        trainer.train_step(inp, tar)  # zero_grad(set_to_none) drops gradients: count the parameters
        opt = getattr(trainer.optimizer, "optim", trainer.optimizer)
        counts = torch.tensor([
            sum(local(p).numel() for p in trainer.raw_model.parameters()),
            sum(local(v).numel() for s in opt.state.values() for v in s.values() if v.dim() > 0),
        ])
        torch.save(counts, Path(out_dir) / f"{_name(cfg)}_{world}_{rank}.pt")
        report = reporting.memory_report(trainer.raw_model, trainer.optimizer, torch.device("meta"),
                                         trainer.held_bytes())
        held = trainer.held_bytes()
        (Path(out_dir) / f"{_name(cfg)}_{world}_{rank}.json").write_text(json.dumps({**report, **held}))


@pytest.mark.parametrize("world", [4])  # 4 ranks: each share is a quarter (2 would repeat it)
def test_what_each_rank_holds(cfg_factory, tmp_path, world):
    """ddp: everything everywhere; zero1: the Adam moments split over the ranks; fsdp: the
    weights and moments split (each rank's shards add up to the whole model); fsdp with
    --cpu_offload: the same shards, which the memory report of a run on a GPU (faked: "meta")
    counts as host memory, none on the GPU."""
    serial_params = None
    modes = ("ddp", "zero1", "fsdp")
    cfgs = [cfg_factory(data_parallel=mode, global_batch_size=4, limit_nsamples=8) for mode in modes]
    cfgs.append(cfg_factory(data_parallel="fsdp", cpu_offload=True, global_batch_size=4, limit_nsamples=8))
    run_ranks(world, _memory_per_rank, cfgs, tmp_path, tmp_path, world)
    for r in range(world):
        shards = torch.load(tmp_path / f"fsdp_{world}_{r}.pt").tolist()
        assert torch.load(tmp_path / f"fsdp_offload_{world}_{r}.pt").tolist() == shards
        report = json.loads((tmp_path / f"fsdp_offload_{world}_{r}.json").read_text())
        assert report["parameters_MiB"] == report["gradients_MiB"] == report["optimizer_MiB"] == 0
        assert report["host_parameters_MiB"] * 2**20 == report["parameters"] == 4 * shards[0]
        assert report["host_gradients_MiB"] == report["host_parameters_MiB"]
        assert report["host_optimizer_MiB"] * 2**20 == report["optimizer_state"]
    for mode in modes:
        params, moments = zip(*(torch.load(tmp_path / f"{mode}_{world}_{r}.pt").tolist()
                                for r in range(world)))
        if mode == "ddp":
            serial_params = params[0]
            assert params == (serial_params,) * world and moments == (2 * serial_params,) * world
        elif mode == "zero1":
            assert params == (serial_params,) * world
            assert sum(moments) == 2 * serial_params and max(moments) < 2 * serial_params
        else:
            assert sum(params) == serial_params and max(params) <= serial_params / world + 1000
            assert list(moments) == [2 * p for p in params]


def test_memory_on_the_device_is_not_reported_as_host_memory():
    """The other half of the split: parameters, gradients and Adam's state on the device the run
    computes on ("meta" standing in for a GPU) are reported there, none as host memory (Adam's
    step counts, host scalars, belong to their parameters); a run on the CPU has no host part."""
    from training import reporting

    model = torch.nn.Linear(64, 32).to("meta")
    adam = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    adam.step()
    report = reporting.memory_report(model, adam, torch.device("meta"))
    assert not [k for k in report if k.startswith("host_")]
    assert report["parameters_MiB"] * 2**20 == 4 * (64 * 32 + 32) == report["gradients_MiB"] * 2**20
    cpu = torch.nn.Linear(64, 32)
    on_cpu = reporting.memory_report(cpu, torch.optim.Adam(cpu.parameters()), torch.device("cpu"))
    assert not [k for k in on_cpu if k.startswith("host_")]


@pytest.fixture(scope="module")
def interrupted(data_dir, test_yaml, tmp_path_factory) -> Path:
    """An fsdp run on 2 ranks with a sharded checkpoint at step 3 (mid-epoch), then a failure."""
    expdir = tmp_path_factory.mktemp("interrupted")
    result = run(2, args(test_yaml, data_dir, expdir, data_parallel="fsdp", checkpoint_every=3),
                 DDP_TEST_RAISE_AT="0:4")
    assert result.returncode != 0
    folder = sharded.latest(run_dir(expdir, 2))
    assert folder is not None and folder.name == "step_00000003"
    assert not (run_dir(expdir, 2) / CHECKPOINT_NAME).exists()
    return run_dir(expdir, 2)


@pytest.mark.parametrize("ranks, mode", [(1, "ddp"), (4, "fsdp"), (2, "zero1")])
def test_sharded_checkpoint_resumes_at_another_scale(interrupted, serial, data_dir, test_yaml,
                                                     tmp_path, ranks, mode):
    target = run_dir(tmp_path, ranks)
    target.mkdir(parents=True)
    shutil.copytree(interrupted / sharded.DCP_DIR, target / sharded.DCP_DIR)
    ok(run(ranks, args(test_yaml, data_dir, tmp_path, data_parallel=mode), timeout=240))
    resumed = metrics(target)
    assert [m["step"] for m in resumed] == [4, 6]
    assert_same_losses(serial, resumed)
    if mode == "fsdp":  # its own sharded checkpoint replaced the copied one
        assert sharded.latest(target).name == "step_00000006"
    else:  # a single file now, and no older sharded one to confuse the next run
        assert (target / CHECKPOINT_NAME).is_file() and not (target / sharded.DCP_DIR).exists()


def test_converter_writes_a_single_file_train_py_continues(interrupted, serial, data_dir, test_yaml,
                                                           tmp_path):
    out = run_dir(tmp_path, 1) / CHECKPOINT_NAME
    result = subprocess.run([sys.executable, "scripts/convert_checkpoint.py", str(interrupted),
                             "--out", str(out)], cwd=REPO, env=subprocess_env(), capture_output=True,
                            text=True, timeout=120)
    ok(result)
    state = torch.load(out, weights_only=False)
    assert state["step"] == 3 and "blocks.0.attn.qkv.weight" in state["model"]
    assert sorted(state["optimizer"]["state"]) == list(range(len(state["model"])))
    ok(run(1, args(test_yaml, data_dir, tmp_path)))
    assert_same_losses(serial, metrics(out.parent))


def test_a_save_killed_midway_leaves_the_previous_checkpoint(serial, data_dir, test_yaml, tmp_path):
    flags = args(test_yaml, data_dir, tmp_path, data_parallel="fsdp", checkpoint_every=2)
    result = run(2, flags, DDP_TEST_DIE_BEFORE_LATEST="4")
    assert result.returncode != 0
    folder = run_dir(tmp_path, 2)
    assert sharded.latest(folder).name == "step_00000002"
    assert (folder / sharded.DCP_DIR / "step_00000004").is_dir()  # written, never named
    ok(run(2, flags))
    assert_same_losses(serial, metrics(folder))
    assert sorted(p.name for p in (folder / sharded.DCP_DIR).iterdir()) == [sharded.LATEST,
                                                                            "step_00000006"]


def test_torchrun_restarts_a_dead_rank_and_resumes(serial, data_dir, test_yaml, tmp_path):
    """Rank 1 exits in step 3 of the first attempt; torchrun restarts both ranks, which resume
    from the step-2 checkpoint. TORCH_DISABLE_SHARE_RDZV_TCP_STORE: see docs/06-sharding.md."""
    flags = args(test_yaml, data_dir, tmp_path, data_parallel="fsdp", checkpoint_every=2)
    result = run(2, flags, timeout=240, max_restarts=1, DDP_TEST_EXIT_AT="1:3",
                 TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    ok(result)
    assert "resumed from" in result.stdout + result.stderr
    assert_same_losses(serial, metrics(run_dir(tmp_path, 2)))


@pytest.mark.parametrize("ranks, flags, message", [
    (1, {"data_parallel": "fsdp", "amp_mode": "fp16"}, "fp16 is not supported with data_parallel fsdp"),
    (1, {"data_parallel": "zero1", "noddp": True}, "--noddp switches gradient synchronisation off"),
    (1, {"grad_accum_steps": 3}, "does not split into --grad_accum_steps 3"),
    (2, {"data_parallel": "hsdp", "dp_shard": 3}, "--dp_shard 3 does not divide the 2 data-parallel ranks"),
    # FSDP with one data-parallel rank would train as plain DDP without a word (fsdp_active)
    (1, {"data_parallel": "fsdp", "cpu_offload": True}, "--data_parallel fsdp with --cpu_offload shards over "
                                                        "the data-parallel ranks, but 1 rank leaves 1"),
    (2, {"data_parallel": "hsdp", "dp_shard": 2}, "hsdp with one sharding group of all 2 data-parallel"),
])
def test_bad_combinations_are_one_line_errors(ranks, flags, message, data_dir, test_yaml, tmp_path):
    valued, switches = flags_to_args(flags)
    result = run(ranks, args(test_yaml, data_dir, tmp_path, **valued) + switches, timeout=120)
    assert result.returncode == (2 if ranks == 1 else 1), result.stderr[-2000:]  # torchrun: 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors and message in errors[0]
    if ranks == 1:
        assert "Traceback" not in result.stderr
    else:  # torchrun reports a failed child with a traceback of its own; none from the ranks
        ours = ("training", "distributed", "utils")
        assert not any(f'File "{REPO / part}' in result.stderr for part in ours)


@pytest.mark.parametrize("flags, message", [
    ({"data_parallel": "fsdp", "context_parallel": 2}, "does not combine with context_parallel"),
    ({"data_parallel": "hsdp", "tensor_parallel": 2}, "hsdp combines with no other parallel dimension"),
    ({"data_parallel": "zero1", "cpu_offload": True}, "use it with --data_parallel fsdp or hsdp, not zero1"),
    ({"data_parallel": "hsdp", "dp_shard": -1}, "'dp_shard' must be 0"),
])
def test_combinations_refused_by_the_config(data_dir, tmp_path, flags, message):
    with pytest.raises(ValueError, match=message):
        make_cfg(data_dir, tmp_path, **flags)
