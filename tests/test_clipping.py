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
    trainer.variant.clip_gradients()
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
    from training.graphs import GraphStep

    with pytest.raises(ValueError, match="'grad_clip_norm' must be 0 or more, got -1"):
        cfg_factory(grad_clip_norm=-1.0)
    with pytest.raises(ValueError, match="train_graph.py does not clip gradients"):
        GraphStep.check(cfg_factory(grad_clip_norm=1.0), RunContext(device=CPU, run_dir=None), 4)


def nccl_only_groups(monkeypatch) -> list:
    """Collectives that refuse anything but a "cuda" tensor, as an NCCL group does, on this rank's
    GPU 0: the groups they were called on are listed in the list returned."""
    seen = []

    def nccl_only_all_reduce(t, group=None):
        if t.device.type != "cuda":
            raise RuntimeError(f"No backend type associated with device type {t.device.type}")
        seen.append(group)

    monkeypatch.setattr(torch.distributed, "all_reduce", nccl_only_all_reduce)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return seen


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

    seen = nccl_only_groups(monkeypatch)
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


def test_offloaded_shards_are_gathered_on_the_groups_device(monkeypatch):
    """A consolidated checkpoint gathers every FSDP shard (shards.full): offloaded, a shard is in
    host memory and NCCL would refuse it. Faked as above: a DTensor stand-in whose mesh is on
    "cuda" and whose gather refuses anything else; the whole tensor comes back to the host."""
    from types import SimpleNamespace

    import torch.distributed.tensor as dtensor
    from torch._subclasses.fake_tensor import FakeTensorMode

    from distributed import shards

    class Offloaded:  # what shards.full reads of FSDP's DTensor
        def __init__(self, shard: torch.Tensor) -> None:
            self.shard, self.shape, self.placements = shard, shard.shape, ("Shard(0)",)
            self.device_mesh = SimpleNamespace(device_type="cuda")

        def to_local(self) -> torch.Tensor:
            return self.shard

        def stride(self) -> tuple[int, ...]:
            return self.shard.stride()

        def full_tensor(self) -> torch.Tensor:
            raise RuntimeError("No backend type associated with device type cpu")

    def from_local(local, mesh, placements, **kwargs):
        assert local.device.type == "cuda", local.device
        return SimpleNamespace(full_tensor=lambda: torch.cat([local, local]))

    monkeypatch.setattr(shards, "is_sharded", lambda t: isinstance(t, Offloaded))
    monkeypatch.setattr(dtensor.DTensor, "from_local", staticmethod(from_local))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with FakeTensorMode():
        whole = shards.full(Offloaded(torch.ones(2, 3)))
        assert whole.shape == (4, 3) and whole.device.type == "cpu"


def _offload_on_nccl() -> None:
    """One NCCL rank (a GPU), FSDP with CPU offload: the gradient shards sit in pinned host memory
    while the groups are NCCL's. Clipping gives torch's norm and clipped gradients; the memory
    report puts the shards in host memory."""
    import torch.distributed as dist

    from distributed.clipping import clip_grad_norm
    from distributed.mesh import build_mesh
    from distributed.sharding import apply_fsdp, local
    from distributed.shards import full
    from networks.vit import build_vit
    from tests.conftest import make_cfg
    from training.reporting import memory_report

    cuda = torch.device("cuda", 0)
    torch.cuda.set_device(cuda)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=cuda)
    cfg = make_cfg(".", ".", data_parallel="fsdp", cpu_offload=True)
    mesh = build_mesh({}, cfg.parallel_order, "cuda")
    torch.manual_seed(0)
    serial = build_vit(cfg.model).to(cuda)
    torch.manual_seed(0)  # the same weights; one rank's shards are whole tensors
    model = apply_fsdp(build_vit(cfg.model), mesh, cfg.layout, cfg.amp_mode, cfg.cpu_offload)
    inp, tar = _batch(cfg)
    for m in (serial, model):
        torch.nn.functional.mse_loss(m(inp.to(cuda)), tar.to(cuda)).backward()
    grads = [local(p.grad) for p in model.parameters()]
    assert grads and all(g.device.type == "cpu" for g in grads)
    want = torch.nn.utils.clip_grad_norm_(serial.parameters(), 1e-3)
    got = clip_grad_norm(list(model.parameters()), 1e-3, mesh)
    assert got.device.type == "cuda"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for p, q in zip(model.parameters(), serial.parameters()):  # clipped alike
        torch.testing.assert_close(local(p.grad).to(cuda).view_as(q.grad), q.grad, rtol=1e-5, atol=1e-7)
    for p, q in zip(model.parameters(), serial.parameters()):  # a consolidated checkpoint's gather
        torch.testing.assert_close(full(p).to(cuda), q.detach(), rtol=0, atol=0)
    report = memory_report(model, torch.optim.Adam(model.parameters()), cuda)
    assert report["parameters_MiB"] == 0 and report["host_parameters_MiB"] > 0, report
    dist.destroy_process_group()
    print("offload on nccl: ok", flush=True)


@pytest.mark.cuda
@pytest.mark.timeout(180)
def test_offloaded_fsdp_clips_and_reports_on_nccl():
    import subprocess
    import sys

    from tests.conftest import subprocess_env
    from tests.slurm_harness import free_port

    env = subprocess_env(gpus=True, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    code = "from tests.test_clipping import _offload_on_nccl; _offload_on_nccl()"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=170)
    said = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0 and "offload on nccl: ok" in done.stdout, said
