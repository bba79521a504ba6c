"""Activation checkpointing (distributed/parallelize.py): the same gradients as the plain
model, dropout included, for less memory saved for backward."""

from __future__ import annotations

import json

import pytest
import torch

from distributed.parallelize import apply_activation_checkpointing
from networks.vit import ViT
from scripts.mp_memory import saved_activation_bytes
from training.context import RunContext
from training.trainer import Trainer

MODEL = dict(img_size=(16, 32), patch_size=4, in_channels=20, out_channels=20, embed_dim=32, depth=4,
             num_heads=4, dropout=0.1)


def grads_and_saved_bytes(mode: str) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
    torch.manual_seed(0)
    model = apply_activation_checkpointing(ViT(**MODEL), mode)
    model.train()  # dropout on: the recomputation must replay the same masks
    x = torch.randn(2, 20, 16, 32, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)
    saved, out = saved_activation_bytes(model, x)
    out.square().mean().backward()
    return {n: p.grad for n, p in model.named_parameters()}, out.detach(), saved


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_gradients_equal_the_plain_model_and_less_is_saved(mode):
    plain, plain_out, plain_saved = grads_and_saved_bytes("none")
    grads, out, saved = grads_and_saved_bytes(mode)
    assert torch.equal(out, plain_out)
    assert grads.keys() == plain.keys()  # parameter names (and so checkpoints) unchanged
    for name, g in grads.items():
        assert torch.equal(g, plain[name]), name  # recomputed exactly: bit for bit on CPU
    assert saved < plain_saved
    if mode == "selective":
        assert saved > grads_and_saved_bytes("full")[2]  # half the blocks: between none and full


def test_training_logs_the_same_losses(cfg_factory, tmp_path):
    losses = {}
    for mode in ("none", "full"):
        cfg = cfg_factory(activation_checkpointing=mode, num_iters=4, limit_nsamples=8, dropout=0.1)
        Trainer(cfg, RunContext(device=torch.device("cpu"), run_dir=tmp_path / mode), 4).fit()
        losses[mode] = [json.loads(line)["train_loss"] for line in (tmp_path / mode / "metrics.jsonl")
                        .read_text().splitlines()]
    assert losses["full"] == losses["none"]
