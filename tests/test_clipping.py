"""Gradient clipping by the global norm (distributed/clipping.py) in one process: the serial
model's norm and clipped gradients, fp16's unscaling first, the log, and refusals. The layouts
are checked against the serial model in tests/test_model_parallel.py (tp, cp: norm and
gradients), tests/test_sharded.py (ZeRO-1 with cp, FSDP with tp) and tests/test_pipeline.py
(pipeline with tp): same losses and the same logged norm."""

import json

import pytest
import torch

from tests.conftest import REPO  # noqa: F401  (puts the repository on sys.path)
from training.context import RunContext
from training.trainer import Trainer

CPU = torch.device("cpu")


def _batch(cfg, n=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, cfg.n_in_channels, *cfg.img_size, generator=gen),
            torch.randn(n, cfg.n_out_channels, *cfg.img_size, generator=gen))


def test_serial_clipping_is_torchs(cfg_factory, tmp_path):
    cfg = cfg_factory(grad_clip_norm=0.05)
    trainer = Trainer(cfg, RunContext(device=CPU, run_dir=tmp_path), 4)
    inp, tar = _batch(cfg)
    trainer.forward_loss(inp, tar).backward()
    reference = [p.detach().clone().requires_grad_() for p in trainer.model.parameters()]
    for r, p in zip(reference, trainer.model.parameters()):
        r.grad = p.grad.clone()
    want = torch.nn.utils.clip_grad_norm_(reference, 0.05)
    trainer.clip_gradients()
    assert want > 0.05  # the limit acts
    torch.testing.assert_close(trainer.grad_norms[-1], want, rtol=1e-6, atol=0)
    for p, q in zip(trainer.model.parameters(), reference):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)


def test_fp16_gradients_are_unscaled_before_the_norm(cfg_factory, tmp_path):
    cfg = cfg_factory(grad_clip_norm=0.05, amp_mode="fp16")
    trainer = Trainer(cfg, RunContext(device=CPU, run_dir=tmp_path), 4)
    trainer.train_step(*_batch(cfg))
    fp32 = Trainer(cfg_factory(grad_clip_norm=0.05), RunContext(device=CPU, run_dir=tmp_path / "b"), 4)
    fp32.train_step(*_batch(cfg))
    # the scaled gradients would be 65536 times larger; fp16 autocast rounds a little
    torch.testing.assert_close(trainer.grad_norms[0], fp32.grad_norms[0], rtol=2e-2, atol=0)


def test_the_norm_is_logged_every_step(cfg_factory, tmp_path):
    from tests.test_training import scalar_tags

    cfg = cfg_factory(grad_clip_norm=0.05, num_iters=4, limit_nsamples=8)  # 2 epochs of 2 steps
    trainer = Trainer(cfg, RunContext(device=CPU, run_dir=tmp_path), 4)
    trainer.open_writer()
    trainer.fit()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    assert all(r["grad_norm_max"] >= r["grad_norm_mean"] > 0.05 for r in records)
    assert scalar_tags(tmp_path)["Gradient norm/before clipping"] == 4
    # and the first record carries the process's peak memory of building (tests/test_model_parallel.py)
    assert records[0]["build_peak_MiB"] > 0 and "build_peak_MiB" not in records[1]


def test_clipping_off_computes_nothing(cfg_factory, tmp_path):
    trainer = Trainer(cfg_factory(), RunContext(device=CPU, run_dir=tmp_path), 4)
    trainer.train_step(*_batch(trainer.cfg))
    assert trainer.grad_norms == []


def test_refusals_are_one_line(cfg_factory):
    from training.graphs import GraphTrainer

    with pytest.raises(ValueError, match="'grad_clip_norm' must be 0 or more, got -1"):
        cfg_factory(grad_clip_norm=-1.0)
    with pytest.raises(ValueError, match="train_graph.py does not clip gradients"):
        GraphTrainer(cfg_factory(grad_clip_norm=1.0), RunContext(device=CPU, run_dir=None), 4)


def test_offloaded_gradients_are_summed_on_the_groups_device(monkeypatch):
    """FSDP's CPU offload keeps gradient shards in host memory while the process groups are
    NCCL's, which has no backend for a CPU tensor. Faked on a CPU: the tensors are fake ones
    (FakeTensorMode, so a "cuda" tensor needs no GPU), the mesh's groups live on "cuda" and
    refuse anything else, as NCCL does; every gradient keeps its device."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from distributed import clipping
    from distributed.mesh import ParallelMesh
    from distributed.tags import tag

    seen = []

    def nccl_only_all_reduce(t, group=None):
        if t.device.type != "cuda":
            raise RuntimeError(f"No backend type associated with device type {t.device.type}")
        seen.append(group)

    monkeypatch.setattr(clipping.dist, "all_reduce", nccl_only_all_reduce)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # this rank's GPU
    mesh = ParallelMesh(sizes={"tp": 2, "cp": 1, "dp": 1, "pp": 2}, groups={"tp": "tp", "pp": "pp"},
                        device_mesh=SimpleNamespace(device_type="cuda"))
    with FakeTensorMode():
        host = [tag(torch.nn.Parameter(torch.ones(4, 3)), shard_dim=0), torch.nn.Parameter(torch.ones(3))]
        for p in host:
            p.grad = torch.ones_like(p)
        norm = clipping.clip_grad_norm(host, 0.1, mesh)  # the scale comes back to the host
        assert norm.device.type == "cuda"
        assert [p.grad.device.type for p in host] == ["cpu", "cpu"]
    assert seen == ["tp", "pp"]
