"""Checks for the exercises in exercises/: the reference solutions in CI, yours with
`make exercise NAME=...` (which sets EXERCISE_VARIANT=exercise)."""

import importlib
import os

import numpy as np
import pytest
import torch

from networks.vit import ViT
from tests.dist_spawn import run_ranks
from training.context import RunContext
from training.trainer import Trainer
from utils.data_loader import ERA5Dataset

VARIANT = os.environ.get("EXERCISE_VARIANT", "solution")
NAMES = ("sample_index", "amp_step", "allreduce_grads", "tp_mlp")


def exercise(name: str, variant: str = VARIANT):
    return importlib.import_module(f"exercises.{name}_{variant}")


@pytest.mark.skipif(VARIANT != "solution", reason="checks the shipped exercise files")
@pytest.mark.parametrize("name", NAMES)
def test_shipped_exercises_are_unsolved(name):
    """The exercise files really have their key lines removed: the checks below fail on them."""
    module = exercise(name, "exercise")
    functions = ("locate", "amp_step", "average_gradients", "tp_mlp_forward")
    fn = next(getattr(module, f) for f in functions if hasattr(module, f))
    with pytest.raises(NotImplementedError, match="exercise"):
        fn(*([None] * fn.__code__.co_argcount))


@pytest.mark.parametrize("dt", [1, 3])
def test_sample_index(cfg_factory, dt):
    ex = exercise("sample_index")
    ds = ERA5Dataset(cfg_factory(dt=dt), "train")
    steps = [f.n_steps for f in ds.files]
    for index in range(len(ds)):
        assert ex.locate(index, steps, dt) == ds.locate(index), index
    with pytest.raises(IndexError):
        ex.locate(len(ds), steps, dt)
    raw_inp, _ = ds.read_raw(7)
    means, stds = ds.means[None], ds.stds[None]
    np.testing.assert_allclose(ex.normalise(raw_inp, means, stds), ds[7][0].numpy(), rtol=1e-6)


@pytest.mark.parametrize("amp_mode", ["bf16", "fp16"])
def test_amp_step(cfg_factory, tmp_path, amp_mode):
    ex = exercise("amp_step")
    cfg = cfg_factory(amp_mode=amp_mode, lr_schedule="constant")
    trainer = Trainer(cfg, RunContext(device=torch.device("cpu"), run_dir=tmp_path), 4)
    model = ViT(cfg.img_size, cfg.patch_size, 20, 20, cfg.embed_dim, cfg.depth, cfg.num_heads)
    model.load_state_dict(trainer.model.state_dict())
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95))
    scaler = torch.amp.GradScaler("cpu") if amp_mode == "fp16" else None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[amp_mode]
    torch.manual_seed(0)
    for _ in range(3):
        inp, tar = torch.randn(4, 20, *cfg.img_size), torch.randn(4, 20, *cfg.img_size)
        expected = trainer.train_step(inp, tar)
        got = ex.amp_step(model, optimizer, scaler, trainer.loss_fn, inp, tar, "cpu", dtype)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, expected)
    for a, b in zip(model.parameters(), trainer.model.parameters()):
        torch.testing.assert_close(a, b)
    if scaler is not None:
        assert scaler.get_scale() == trainer.scaler.get_scale()


def _ddp_versus_manual(variant: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank = dist.get_rank()
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    manual = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    manual.load_state_dict(reference.state_dict())
    ddp = DistributedDataParallel(reference)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ddp, manual)]
    average_gradients = exercise("allreduce_grads", variant).average_gradients
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own shard
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
        for model, opt in zip((ddp, manual), opts):
            torch.nn.functional.mse_loss(model(x), y).backward()
            if model is manual:
                average_gradients(manual)
            opt.step()
            opt.zero_grad()
    for a, b in zip(reference.parameters(), manual.parameters()):
        # same reduction (sum then divide) in both: equal up to the order of float additions
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.timeout(120)
def test_allreduce_grads():
    run_ranks(2, _ddp_versus_manual, VARIANT)


def _tp_mlp_versus_serial(variant: str) -> None:
    import torch.distributed as dist

    from networks.vit import MLP

    rank, tp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    serial = MLP(8, 32)
    for p in serial.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(2, 5, 8)
    x_serial, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    shard = slice(rank * 32 // tp, (rank + 1) * 32 // tp)
    w1 = serial.fc1.weight[shard].detach().clone().requires_grad_()
    b1 = serial.fc1.bias[shard].detach().clone().requires_grad_()
    w2 = serial.fc2.weight[:, shard].detach().clone().requires_grad_()
    b2 = serial.fc2.bias.detach().clone().requires_grad_()
    forward = exercise("tp_mlp", variant).tp_mlp_forward
    out = forward(x_tp, w1, b1, w2, b2, dist.group.WORLD)
    expected = serial(x_serial)
    # fp32, the same products summed in a different order: agreement to ~1e-6
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(x_tp.grad, x_serial.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w1.grad, serial.fc1.weight.grad[shard], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w2.grad, serial.fc2.weight.grad[:, shard], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b2.grad, serial.fc2.bias.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(120)
def test_tp_mlp():
    run_ranks(2, _tp_mlp_versus_serial, VARIANT)
