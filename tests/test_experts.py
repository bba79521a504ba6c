"""The mixture of experts (networks/moe.py): routing, gates, capacity and the balancing loss
against their definitions written out here; statistics per sample (what makes every
layout that splits the batch equal to the serial model); training with it. Data parallelism
and accumulation with experts against the serial run: test_sharded.py (``ddp2_moe_...``)."""

from __future__ import annotations

import math

import pytest
import torch

from networks.moe import MoEMLP
from networks.vit import MLP

DIM, HIDDEN, EXPERTS = 8, 16, 4


def make(top_k: int = 1, capacity_factor: float = 0.0) -> MoEMLP:
    torch.manual_seed(0)
    moe = MoEMLP(DIM, HIDDEN, EXPERTS, top_k, capacity_factor, expert=MLP)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
    return moe


def by_hand(moe: MoEMLP, x: torch.Tensor) -> torch.Tensor:
    """Every token through its top-k experts, one token at a time, nothing dropped."""
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        for n in range(x.shape[1]):
            probs = torch.softmax(moe.router(x[b, n]), dim=-1)
            gates, chosen = probs.topk(moe.top_k)
            if moe.top_k == 2:
                gates = gates / gates.sum()
            for g, e in zip(gates, chosen):
                out[b, n] += g * moe.experts[str(int(e))](x[b, n : n + 1])[0]
    return out


@pytest.mark.parametrize("top_k", [1, 2])
def test_each_token_goes_to_its_top_k_experts_weighted_by_their_gates(top_k):
    moe = make(top_k)
    x = torch.randn(3, 10, DIM)
    torch.testing.assert_close(moe(x), by_hand(moe, x), rtol=1e-5, atol=1e-6)
    assert moe.stats[-1] == 0  # dropless: nothing dropped
    assert moe.stats[:-1].sum() == pytest.approx(1.0)


def test_every_parameter_gets_a_gradient_even_an_idle_experts():
    """DDP needs a gradient for every parameter each step: an expert that got no token must still
    produce one (zeros)."""
    moe = make()
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0] = 10.0  # every token's first choice: expert 0 (positive inputs)
    x = torch.rand(2, 6, DIM)
    (moe(x).sum() + moe.aux_loss).backward()
    assert moe.stats[0] == 1.0
    assert all(p.grad is not None for p in moe.parameters())
    assert moe.experts["3"].fc1.weight.grad.abs().sum() == 0


def test_capacity_drops_the_assignments_beyond_it_per_sample_first_choices_first():
    """Every token prefers expert 0, then expert 1. With capacity factor 1 and top-2, an expert
    takes ceil(1 x 6 x 2 / 4) = 3 assignments of each sample: expert 0 serves the first 3 tokens'
    first choices, expert 1 the first 3 tokens' second choices; the others are dropped."""
    moe = make(top_k=2, capacity_factor=1.0)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0], moe.router.weight[1] = 2.0, 1.0
    x = torch.rand(2, 6, DIM) + 0.1
    assert moe.capacity(6) == 3
    experts, gates, kept = moe.route(x)
    assert (experts[..., 0] == 0).all() and (experts[..., 1] == 1).all()
    want = torch.tensor([True] * 3 + [False] * 3)
    assert (kept[..., 0] == want).all() and (kept[..., 1] == want).all()  # in every sample
    out = moe(x)
    assert (out[:, 3:] == 0).all() and (out[:, :3] != 0).all()
    assert moe.stats.tolist() == pytest.approx([0.25, 0.25, 0.0, 0.0, 0.5])
    # a token's second choice waits behind every first choice of its expert: expert 1 full of
    # first choices takes no second choice at all
    with torch.no_grad():
        moe.router.weight[1] = moe.router.weight[0] + 0.01 * torch.arange(DIM)  # nearly tied
    experts, _, kept = moe.route(x)
    firsts = (experts[..., 0] == 1).sum(dim=1)
    assert (firsts >= 3).all() and not kept[..., 1][experts[..., 1] == 1].any()


def test_balancing_loss_is_its_formula():
    moe = make(top_k=2)
    x = torch.randn(3, 10, DIM)
    moe(x)
    probs = torch.softmax(moe.router(x), dim=-1)
    first = torch.nn.functional.one_hot(probs.argmax(-1), EXPERTS).float()
    want = (EXPERTS * (first.mean(1) * probs.mean(1)).sum(-1)).mean()
    torch.testing.assert_close(moe.aux_loss, want)
    with torch.no_grad():  # a uniform router: f sums to 1 and P = 1/E, the loss is exactly 1
        moe.router.weight.zero_()
    moe(x)
    assert moe.aux_loss.item() == pytest.approx(1.0)


def test_statistics_are_per_sample_so_splitting_the_batch_changes_nothing():
    """Outputs and the balancing loss of a batch equal those of its halves (the loss: their mean),
    with a capacity that drops: what data parallelism and accumulation rely on."""
    moe = make(top_k=2, capacity_factor=0.5)
    x = torch.randn(4, 10, DIM)
    whole = moe(x)
    aux = moe.aux_loss
    assert moe.stats[-1] > 0  # the capacity did drop assignments
    halves = [moe(part) for part in x.chunk(2)]
    torch.testing.assert_close(whole, torch.cat(halves))
    moe(x[:2])
    first = moe.aux_loss
    moe(x[2:])
    torch.testing.assert_close(aux, (first + moe.aux_loss) / 2)


def test_the_vit_with_experts_trains_and_logs_them(cfg_factory, tmp_path):
    """Every second block gets the experts; the trainer adds the weighted balancing loss to what
    it differentiates (not to the logged loss) and logs each expert's share per step."""
    import json

    from tests.test_reliability import make_trainer

    cfg = cfg_factory(num_experts=4, moe_top_k=2, moe_capacity_factor=1.0, moe_aux_weight=0.5,
                      limit_nsamples=8, num_iters=2, checkpoint_every=0)
    trainer = make_trainer(cfg, tmp_path)
    kinds = [type(b.mlp).__name__ for b in trainer.raw_model.blocks.values()]
    assert kinds == ["MLP", "MoEMLP"] * (cfg.depth // 2)
    inp, tar = next(iter(trainer.train_data))
    trainer.model.zero_grad()
    loss = trainer.forward_loss(inp, tar)
    router = trainer.variant.moe_layers[0].router.weight
    plain = torch.autograd.grad(loss, router, retain_graph=True)[0]
    with_aux = torch.autograd.grad(loss + trainer.variant.balancing_loss(), router)[0]
    assert not torch.allclose(plain, with_aux)  # the balancing loss reaches the router
    trainer.fit()
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    layers = record["moe"]
    assert len(layers) == cfg.depth // 2 and all(len(v) == 4 + 2 for v in layers)
    assert all(sum(v[:4]) + v[4] == pytest.approx(1.0) and math.isfinite(v[5]) for v in layers)


@pytest.mark.parametrize("flags, message", [
    ({"num_experts": 4, "moe_top_k": 3}, "moe_top_k must be 1 or 2"),
    ({"num_experts": -1}, "num_experts (0 or more)"),
    ({"num_experts": 4, "context_parallel": 2}, "--num_experts does not combine with --context_parallel"),
    ({"num_experts": 4, "pipeline_parallel": 2}, "--num_experts does not combine with --pipeline_parallel"),
    ({"num_experts": 6, "expert_parallel": 4}, "num_experts 6 is not divisible by expert_parallel 4"),
    ({"expert_parallel": 2}, "--expert_parallel splits the experts of a mixture of experts"),
    ({"num_experts": 4, "expert_parallel": 2, "data_parallel": "fsdp"},
     "--expert_parallel runs with DDP here"),
])
def test_bad_expert_settings_are_one_line(cfg_factory, flags, message):
    with pytest.raises(ValueError) as err:
        cfg_factory(**flags)
    assert message in str(err.value) and "\n" not in str(err.value)


def checkpoint_round_trip() -> None:
    """(Run by test_model_parallel.py's 2-rank test, whose ranks are started anyway.)
    On 2 ranks splitting the experts: a serial model's and Adam's state (as a checkpoint of a
    run without expert parallelism holds them) loads, each rank taking its own experts, and
    consolidates back to the same tensors, names and indices."""
    import copy

    import torch.distributed as dist

    from distributed import experts as ep_lib
    from distributed.consolidate import (
        full_optimizer_state,
        full_state,
        load_full_optimizer_state,
        load_full_state,
    )
    from distributed.mesh import build_mesh
    from networks.vit import ViT

    torch.manual_seed(0)
    serial = ViT((8, 16), 4, 3, 2, 16, 2, 2, num_experts=4, moe_top_k=2)
    adam = torch.optim.Adam(serial.parameters())
    serial(torch.randn(2, 3, 8, 16)).square().mean().backward()
    adam.step()
    model_state = {n: p.detach().clone() for n, p in serial.named_parameters()}
    optimizer_state = copy.deepcopy(adam.state_dict())

    mesh = build_mesh({})
    torch.manual_seed(1)  # other weights: the load must overwrite them
    model = ep_lib.apply_expert_parallel(ViT((8, 16), 4, 3, 2, 16, 2, 2, num_experts=4, moe_top_k=2), mesh, 2)
    own = [n for n, _ in model.named_parameters()]
    first = 2 * dist.get_rank()
    assert f"blocks.1.mlp.experts.{first}.fc1.weight" in own and len(own) < len(model_state)
    opt = torch.optim.Adam(model.parameters())
    load_full_state(model, ep_lib.local_model_state(model, model_state), mesh)
    load_full_optimizer_state(opt, ep_lib.local_optimizer_state(model, optimizer_state), mesh)
    back = ep_lib.full_model_state(model, mesh, full_state(model, mesh))
    assert list(back) == list(model_state)
    for name, t in model_state.items():
        assert torch.equal(back[name], t), name
    back_opt = ep_lib.full_optimizer_state(model, mesh, full_optimizer_state(opt, mesh))
    assert back_opt["param_groups"][0]["params"] == optimizer_state["param_groups"][0]["params"]
    for i, entry in optimizer_state["state"].items():
        for key, value in entry.items():
            assert torch.equal(back_opt["state"][i][key], value), (i, key)


def test_expert_runs_refused_where_they_cannot_run(cfg_factory, tmp_path, capsys):
    """Expert parallelism is train_mp.py's, needs data-parallel ranks it divides, and refuses fp16
    (each rank's loss scaler would see only its own experts); CUDA Graphs cannot replay a mixture
    of experts: each in one line, before any work."""
    from ruamel.yaml import YAML

    from training.context import RunContext
    from training.graphs import GraphStep
    from training.launcher import main

    path = tmp_path / "test.yaml"
    with open(path, "w") as f:
        YAML().dump({"test": cfg_factory().to_dict()}, f)
    argv = ["--yaml_config", str(path), "--config", "test", "--num_experts", "4", "--expert_parallel", "2"]
    assert main(argv=argv) == 2
    assert "expert parallel runs use train_mp.py" in capsys.readouterr().err.strip().splitlines()[-1]
    assert main(argv=argv, model_parallel=True) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: expert_parallel 2 does not divide the 1 data-parallel ranks; choose a divisor (the "
        "expert-parallel ranks are data-parallel ranks)")
    assert main(argv=argv + ["--amp_mode", "fp16"], model_parallel=True) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: amp_mode fp16 does not work with expert_parallel > 1 (each rank's loss scaler sees only "
        "its own experts' gradients: the ranks would skip different steps and the replicated weights "
        "drift apart); use --amp_mode bf16")
    with pytest.raises(ValueError, match="fp16 does not work with expert_parallel"):  # the config's own check
        cfg_factory(num_experts=4, expert_parallel=2, amp_mode="fp16")
    cfg_factory(num_experts=4, amp_mode="fp16")  # experts on every rank: one scaler sees them all
    assert not (tmp_path / "logs").exists()
    with pytest.raises(ValueError, match="train_graph.py does not train a mixture of experts"):
        GraphStep.check(cfg_factory(num_experts=4), RunContext(device=torch.device("cpu"), run_dir=tmp_path),
                        4)


def count_host_copies(monkeypatch) -> list[str]:
    """Every later call that copies a tensor's values to the host (on a GPU: waits for the GPU to
    reach it), by name: values read out, nonzero, a boolean mask, repeat_interleave without its
    output size."""
    copies: list[str] = []

    def counted(name, fn, when=lambda *a, **k: True):
        def wrapper(*args, **kwargs):
            if when(*args, **kwargs):
                copies.append(name)
            return fn(*args, **kwargs)
        return wrapper

    for name in ("tolist", "item", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch, "nonzero", counted("nonzero", torch.nonzero))
    monkeypatch.setattr(torch, "repeat_interleave", counted(
        "repeat_interleave", torch.repeat_interleave,
        lambda x, repeats=None, *a, **k: torch.is_tensor(repeats) and k.get("output_size") is None))

    def masked(t, index):
        parts = index if isinstance(index, tuple) else (index,)
        return any(torch.is_tensor(p) and p.dtype == torch.bool for p in parts)

    getitem = counted("boolean mask", torch.Tensor.__getitem__, masked)
    monkeypatch.setattr(torch.Tensor, "__getitem__", getitem)
    return copies


@pytest.mark.parametrize("top_k, capacity_factor", [(1, 0.0), (2, 0.75)])
def test_an_expert_parallel_layer_copies_to_the_host_once(monkeypatch, top_k, capacity_factor):
    """The all-to-alls' split sizes (and the shapes of what arrives) come from one host copy per
    layer; nothing else waits for the device. In one process (ep 1: the all-to-alls are this
    rank's own) the layer computes the serial layer's output and statistics."""
    from distributed.experts import ExpertParallelMoE
    from distributed.mesh import build_mesh

    serial = make(top_k, capacity_factor)
    layer = ExpertParallelMoE(serial, build_mesh({}))
    x = torch.randn(3, 6, DIM, generator=torch.Generator().manual_seed(1))
    want = serial(x)
    copies = count_host_copies(monkeypatch)
    got = layer(x)
    monkeypatch.undo()
    assert copies == ["tolist"]
    torch.testing.assert_close(got, want)
    assert torch.equal(layer.stats, serial.stats)
    if capacity_factor:
        assert layer.stats[-1] > 0  # some assignments were dropped


@pytest.mark.cuda
def test_an_expert_parallel_layer_synchronises_once_on_a_gpu():
    """torch's own count on a GPU: one synchronising call per layer's forward."""
    import warnings

    from distributed.experts import ExpertParallelMoE
    from distributed.mesh import build_mesh

    layer = ExpertParallelMoE(make(2, 0.75), build_mesh({})).cuda()
    x = torch.randn(3, 6, DIM, device="cuda")
    layer(x)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            layer(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, syncs
