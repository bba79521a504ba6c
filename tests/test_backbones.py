"""A second backbone through every layout: FourCastNet's AFNO (networks/afno.py, selected by the
config key ``backbone``), which no layout's code names, each layout equal step by step to AFNO's
own serial run (same seed, same global batch)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from networks.backbone import BACKBONES, backbone_class, build, build_on_meta
from tests.conftest import make_cfg
from tests.dist_spawn import run_ranks
from tests.test_ladder import fixed_batches, make_trainer
from tests.test_sharded import LOSS_RTOL

AFNO = {"backbone": "afno", "limit_nsamples": 8, "limit_nsamples_val": 8}  # 3 epochs of 2 steps
FREEZE = {"freeze_schedule": "steps", "freeze_steps": (2, 4)}
LAYOUTS = {  # name: flags on 2 ranks; with the serial run they match
    "ddp": ({}, "serial"),
    "zero1": ({"data_parallel": "zero1"}, "serial"),
    "fsdp_checkpointing": ({"data_parallel": "fsdp", "activation_checkpointing": "full"}, "serial"),
    "tp2": ({"tensor_parallel": 2}, "serial"),
    "pp2": ({"pipeline_parallel": 2, "num_microbatches": 2}, "serial"),
    "freezing_ddp": (FREEZE, "frozen"),
}
REFUSED = {  # flags on 2 ranks -> the one-line error
    "context_parallel": ({"context_parallel": 2}, "AFNO has no tokens to split"),
    "sequence_parallel": ({"tensor_parallel": 2, "sequence_parallel": True}, "AFNO has no tokens to split"),
}


def _losses(run_dir: Path) -> list[tuple[int, float, float]]:
    import json

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(m["step"], m["train_loss"], m["val_loss"]) for m in map(json.loads, lines)]


def _fit(cfg, run_dir: Path, mesh=None) -> None:
    from training.context import RunContext
    from training.launcher import step_for
    from training.trainer import EagerStep, Trainer

    kwargs = {} if mesh is None else {"rank": dist.get_rank(), "world_size": dist.get_world_size(),
                                      "mesh": mesh}
    ctx = RunContext(device=torch.device("cpu"), run_dir=run_dir, **kwargs)
    dp = 1 if mesh is None else mesh.dp_size
    Trainer(cfg, ctx, cfg.global_batch_size // dp, step=step_for(cfg, EagerStep)).fit()


def _layouts_on_two_ranks(data_dir: str, out: str, serial: dict) -> None:
    from distributed import mesh as meshes

    errors = []
    for name, (flags, reference) in LAYOUTS.items():
        cfg = make_cfg(Path(data_dir), Path(out), **AFNO, **flags)
        mesh = meshes.build_mesh(meshes.requested_sizes(cfg.layout), cfg.parallel_order, "cpu")
        _fit(cfg, Path(out) / name, mesh)
        if dist.get_rank() == 0:
            got, want = _losses(Path(out) / name), serial[reference]
            if [s for s, *_ in got] != [s for s, *_ in want] or any(
                    a != pytest.approx(b, rel=LOSS_RTOL) for g, w in zip(got, want) for a, b in zip(g, w)):
                errors.append(f"{name}: {got} against the serial {want}")
    for name, (flags, message) in REFUSED.items():
        cfg = make_cfg(Path(data_dir), Path(out), **AFNO, **flags)
        mesh = meshes.build_mesh(meshes.requested_sizes(cfg.layout), cfg.parallel_order, "cpu")
        with pytest.raises(ValueError, match=message):
            _fit(cfg, Path(out) / name, mesh)
    assert not errors, "\n".join(errors)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_afno_trains_in_every_layout_as_its_serial_run(data_dir, tmp_path):
    """DDP, ZeRO-1, FSDP with every block recomputed, tensor parallelism (its channel MLPs split
    as the plan says), a pipeline of two stages and freezing (each on 2 ranks, one after the
    other) log the serial run's losses; context and sequence parallelism are refused in a line."""
    serial = {}
    for name, flags in (("serial", {}), ("frozen", FREEZE)):
        _fit(make_cfg(data_dir, tmp_path, **AFNO, **flags), tmp_path / name)
        serial[name] = _losses(tmp_path / name)
    assert len(serial["serial"]) == 3 and serial["frozen"] != serial["serial"]
    run_ranks(2, _layouts_on_two_ranks, str(data_dir), str(tmp_path), serial)


@pytest.mark.slow
def test_afno_compiled_matches_eager(cfg_factory, tmp_path):
    eager = make_trainer(cfg_factory(depth=1, **AFNO), tmp_path / "eager")
    compiled = make_trainer(cfg_factory(enable_jit=True, depth=1, **AFNO), tmp_path / "compiled")
    inp, tar = fixed_batches(1, compiled.cfg)[0]
    results = []
    for trainer in (eager, compiled):
        loss = trainer.loss_fn(trainer.model(inp), tar)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in trainer.model.parameters()]))
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-4, atol=1e-6)  # inductor reorders float32 sums
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


def test_every_backbone_builds_on_meta_and_fills_from_the_seed(cfg_factory):
    """Each backbone's initial values cover every parameter, in the same order for a model built
    on the meta device and for a real one (what parallelize's materialize relies on)."""
    for name in BACKBONES:
        cfg = cfg_factory(backbone=name).model
        meta, n_params = build_on_meta(cfg)
        real = build(cfg)
        assert all(p.is_meta for p in meta.parameters()), name
        assert n_params == sum(p.numel() for p in real.parameters()), name
        names = [n for n, _ in meta.initial_values(torch.Generator().manual_seed(0))]
        assert sorted(names) == sorted(n for n, _ in real.named_parameters()), name
        real.reset_parameters(torch.Generator().manual_seed(0))
        values = dict(real.initial_values(torch.Generator().manual_seed(0)))  # drawn alike again
        assert all(torch.equal(values[n], p) for n, p in real.named_parameters()), name
        assert {backbone_class(cfg).part_of(n) for n in names} >= {"stem", 0, "tail"}, name


def test_an_unknown_backbone_is_one_line(cfg_factory):
    with pytest.raises(ValueError, match="backbone 'resnet' is not one of vit, afno"):
        build(cfg_factory(backbone="resnet").model)
