"""Large-batch tools: the one-cycle schedule (its shape, an exact resume) and LAMB (its formula,
its one-line refusals). LAMB across layouts: the clipped layouts of test_sharded.py (ZeRO-1 x cp,
FSDP x tp, HSDP) and test_pipeline.py (pp x tp) step with LAMB against a serial LAMB run."""

from __future__ import annotations

import math

import pytest
import torch

from tests.test_reliability import assert_same_run, make_trainer, metrics
from training.schedule import make_lr_lambda
from utils import signals


def test_onecycle_rises_then_anneals(cfg_factory):
    cfg = cfg_factory(lr_schedule="onecycle", num_iters=100, onecycle_pct_start=0.3, onecycle_div_factor=25.0,
                      onecycle_final_div_factor=1e4)
    f = make_lr_lambda(cfg.optim)
    values = [f(step) for step in range(101)]
    assert values[0] == pytest.approx(1 / 25) and values[30] == pytest.approx(1.0)
    assert values[100] == pytest.approx(1 / 25 / 1e4)
    assert values[15] == pytest.approx(1 / 25 + (1 - 1 / 25) / 2)  # half way up the cosine ramp
    assert all(a < b for a, b in zip(values[:30], values[1:31]))  # up to the peak
    assert all(a > b for a, b in zip(values[30:100], values[31:101]))  # then down


@pytest.mark.parametrize("flags, message", [
    ({"lr_schedule": "onecycle", "warmup": 5}, "onecycle warms up by itself"),
    ({"lr_schedule": "onecycle", "onecycle_pct_start": 1.0}, "0 < onecycle_pct_start < 1"),
    ({"optimizer_type": "Lion"}, "'optimizer_type' is 'Lion'; choose one of Adam, AdamW, LAMB, SGD"),
    ({"weight_decay": -0.1}, "'weight_decay' (0 or more)"),
    ({"lr": -1e-3}, "'lr' must be positive"),
])
def test_bad_values_are_one_line(cfg_factory, flags, message):
    with pytest.raises(ValueError) as err:
        cfg_factory(**flags)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_onecycle_run_stopped_by_a_signal_resumes_exactly(cfg_factory, tmp_path, monkeypatch):
    """Stopped at step 3 of 8 (mid-epoch) and rerun: the same losses as the run straight through."""
    cfg = cfg_factory(limit_nsamples=16, num_iters=8, checkpoint_every=0, stop_check_every=1,
                      lr_schedule="onecycle", dropout=0.1)
    make_trainer(cfg, tmp_path / "straight").fit()
    first = make_trainer(cfg, tmp_path / "run")
    step = first.train_step

    def signalled(inp, tar):
        if first.step == 2:
            monkeypatch.setattr(signals, "_received", 15)  # SIGTERM during step 3
        return step(inp, tar)

    first.train_step = signalled
    first.fit()
    assert first.stopped_early and first.step == 3
    monkeypatch.setattr(signals, "_received", None)
    make_trainer(cfg, tmp_path / "run").fit()
    assert_same_run(metrics(tmp_path / "straight"), tmp_path / "run")


def test_lamb_follows_its_formula():
    """Two steps on two tensors, against the formula written out here: Adam's bias-corrected
    direction plus weight decay, scaled per tensor by ||w|| / ||u||."""
    from distributed.lamb import Lamb

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    expected = [p.detach().clone() for p in params]
    lr, (b1, b2), eps, wd = 0.01, (0.9, 0.99), 1e-6, 0.1
    opt = Lamb(params, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    m = [torch.zeros_like(w) for w in expected]
    v = [torch.zeros_like(w) for w in expected]
    for t in (1, 2):
        grads = [torch.randn_like(w) for w in expected]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for i, (w, g) in enumerate(zip(expected, grads)):
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            u = (m[i] / (1 - b1 ** t)) / ((v[i] / (1 - b2 ** t)).sqrt() + eps) + wd * w
            trust = w.norm() / u.norm()
            expected[i] = w - lr * trust * u
    for p, w in zip(params, expected):
        torch.testing.assert_close(p.detach(), w, rtol=1e-6, atol=1e-7)
    zero = torch.nn.Parameter(torch.zeros(4))
    zero.grad = torch.ones(4)
    Lamb([zero], lr=0.5).step()  # ||w|| = 0: the trust ratio is 1, Adam's step
    assert torch.allclose(zero.detach(), torch.full((4,), -0.5), atol=1e-5)
    assert math.isfinite(float(params[0].sum()))


def _norms_of_split_tensors() -> None:
    """LAMB's squared norms, on 2 ranks, of tensors split the two ways a rank can hold part of a
    tensor: a tensor-parallel slice (a different half on each rank) and an FSDP shard. They must be
    those of the whole tensors (a rank that used its part alone would see about half)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from distributed.lamb import split_sum_squares
    from distributed.mesh import build_mesh
    from distributed.shards import local
    from distributed.tags import tag

    rank = dist.get_rank()
    torch.manual_seed(0)
    weight, bias = torch.randn(4, 6), torch.randn(6) * 3  # the whole tensors, the same on both ranks
    weight[:, 3:] *= 5  # the halves differ: their norms' ratio is not the whole's
    tp = build_mesh({"tp": 2, "cp": 1})
    split = tag(torch.nn.Parameter(weight[:, 3 * rank:3 * rank + 3].clone()), shard_dim=1)
    replicated = tag(torch.nn.Parameter(bias.clone()))
    got = split_sum_squares(tp)([split, replicated], [split.detach(), replicated.detach()])
    torch.testing.assert_close(got, torch.stack([weight.pow(2).sum(), bias.pow(2).sum()]))

    linear = torch.nn.Linear(6, 4)
    whole = [p.detach().clone() for p in linear.parameters()]
    dp = build_mesh({"tp": 1, "cp": 1})
    fully_shard(linear, mesh=dp.device_mesh["dp"])
    params = list(linear.parameters())
    got = split_sum_squares(dp)(params, [local(p).detach() for p in params])
    torch.testing.assert_close(got, torch.stack([w.pow(2).sum() for w in whole]))


@pytest.mark.timeout(120)
def test_lamb_norms_of_split_tensors_are_the_whole_tensors():
    from tests.dist_spawn import run_ranks

    run_ranks(2, _norms_of_split_tensors)


def test_lamb_sums_offloaded_norms_on_the_groups_device(monkeypatch):
    """FSDP's CPU offload keeps the shards in host memory while the groups are NCCL's, which has no
    backend for a host tensor. Faked on a CPU as in test_clipping.py: fake tensors, groups that
    refuse anything but "cuda"; the squared norms go to the groups' device and come back."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from distributed import lamb
    from distributed.mesh import ParallelMesh
    from distributed.tags import tag
    from tests.test_clipping import nccl_only_groups

    seen = nccl_only_groups(monkeypatch)
    monkeypatch.setattr(lamb, "is_sharded", lambda p: hasattr(p, "placements"))  # FSDP's DTensors
    mesh = ParallelMesh(sizes={"tp": 2, "cp": 1, "dp": 2}, groups={"tp": "tp", "dp": "dp"},
                        device_mesh=SimpleNamespace(device_type="cuda"))
    with FakeTensorMode():
        params = [tag(torch.nn.Parameter(torch.ones(4, 3)), shard_dim=0), torch.nn.Parameter(torch.ones(3))]
        for p in params:
            p.placements = [SimpleNamespace(is_shard=lambda: True)]
            p.device_mesh = SimpleNamespace(get_group=lambda i: "dp")
        sq = lamb.split_sum_squares(mesh)(params, [p.detach() for p in params])
        assert sq.device.type == "cpu"
    assert seen == ["tp", "dp"]


def test_the_range_test_stops_at_divergence_and_suggests_a_tenth(data_dir, tmp_path, capsys):
    """The rate grows from 1e-5 to 10 over 40 steps; the tiny test model diverges before the end,
    and the suggestion is a tenth of the rate at the lowest smoothed loss."""
    import json

    from scripts import lr_range_test
    from tests.ddp_helpers import write_test_yaml

    yaml = write_test_yaml(tmp_path / "t.yaml")
    assert lr_range_test.main(["--config", "tiny", "--yaml_config", str(yaml), "--data_dir", str(data_dir),
                               "--expdir", str(tmp_path), "--steps", "40", "--lr_min", "1e-5",
                               "--lr_max", "10"]) == 0
    out = tmp_path / "lr_range" / "tiny"
    result = json.loads((out / "lr_range.json").read_text())
    lrs = result["lr"]
    assert lrs[0] == pytest.approx(1e-5) and all(b > a for a, b in zip(lrs, lrs[1:]))
    assert result["stopped"].startswith("diverged at lr") and len(lrs) < 40
    assert result["suggested_lr"] == pytest.approx(result["lowest_at_lr"] / 10)
    assert (out / "lr_range.png").is_file()
    printed = capsys.readouterr().out
    assert f"suggested lr: {result['suggested_lr']:.3g}" in printed
    with pytest.raises(SystemExit):
        lr_range_test.main(["--lr_min", "1", "--lr_max", "0.1"])


def test_the_scaling_study_plans_equal_samples_and_scales_the_rate(cfg_factory):
    """Every batch sees the same samples in fewer steps, with the warm-up over the same samples,
    as micro-batches of the base batch; the three rules' rates."""
    from scripts.batch_scaling import plan_run, scaled_lr

    cfg = cfg_factory(global_batch_size=16, warmup=20)
    assert plan_run(cfg, 16, 16, 5120) == {"global_batch_size": 16, "grad_accum_steps": 1, "num_iters": 320,
                                           "warmup": 20}
    assert plan_run(cfg, 128, 16, 5120) == {"global_batch_size": 128, "grad_accum_steps": 8, "num_iters": 40,
                                            "warmup": 3}  # 20 x 16 = 320 samples: 2.5 steps of 128
    assert plan_run(cfg, 512, 16, 512)["warmup"] == 0  # one step: no room to warm up
    assert plan_run(cfg_factory(warmup=0), 64, 16, 640)["warmup"] == 0
    assert [scaled_lr(rule, 1e-3, 64, 16) for rule in ("constant", "linear", "sqrt")] == \
        pytest.approx([1e-3, 4e-3, 2e-3])


@pytest.mark.parametrize("flags, message", [
    (["--batches", "16,24"], "every batch must be a multiple of the micro-batch (16)"),
    (["--batches", "16,x"], "--batches takes whole numbers"),
    (["--rules", "cubic"], "unknown rule 'cubic'"),
    (["--optimizers", "SGD"], "--optimizers takes Adam, LAMB or both"),
    (["--optimizers", "Lion"], "choose one of Adam, AdamW, LAMB, SGD"),
    (["--samples", "100"], "--samples 100 is less than one batch of 512"),
    (["--lamb_lr", "-1"], "learning rates must be positive"),
])
def test_the_scaling_study_refuses_bad_input_in_one_line(flags, message, capsys):
    from scripts import batch_scaling

    with pytest.raises(SystemExit) as stop:
        batch_scaling.main(["--config", "tiny", *flags])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1], err
