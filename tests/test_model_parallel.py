"""Model parallelism: group layouts, autograd collectives, and the parallel ViT against the serial one.

Distributed tests run 2 or 4 CPU ranks with gloo (tests/dist_spawn.py): every rank
computes its checks into a pass/fail flag, the flags are combined across ranks, and a
failure on any rank fails the test on all of them.
"""

from __future__ import annotations

import re
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import mappings as M
from distributed.clipping import clip_grad_norm
from distributed.consolidate import full_state, load_full_state, take_shard
from distributed.mesh import (
    ParallelMesh,
    build_mesh,
    check_model,
    check_sizes,
    check_takes_effect,
    expert_layouts,
    group_layouts,
    hsdp_layouts,
    parse_order,
    requested_sizes,
)
from distributed.parallelize import apply_model_parallel
from distributed.tags import ParamSpec, wrap_data_parallel
from networks.vit import ViT
from tests.dist_spawn import run_ranks

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------ group layouts ---
def test_readme_example_8_ranks_tp4():
    g = group_layouts(8, {"tp": 4, "cp": 1})
    assert g["tp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["cp"] == [[r] for r in range(8)]


def test_layouts_tp2_cp2_dp2_default_order():
    g = group_layouts(8, {"tp": 2, "cp": 2})
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_layouts_other_orders():
    g = group_layouts(8, {"tp": 2, "cp": 2}, order="dp-tp-cp")  # dp fastest: data replicas adjacent
    assert g["dp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["tp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["cp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    g = group_layouts(4, {"tp": 2, "cp": 2}, order="cp-tp-dp")
    assert g["cp"] == [[0, 1], [2, 3]]
    assert g["tp"] == [[0, 2], [1, 3]]
    assert g["dp"] == [[0], [1], [2], [3]]


def test_layouts_partition_every_rank_once():
    for world, tp, cp, order in [(12, 3, 2, "tp-cp-dp"), (12, 2, 3, "cp-dp-tp"), (6, 1, 6, "dp-cp-tp")]:
        g = group_layouts(world, {"tp": tp, "cp": cp}, order)
        for name, size in [("tp", tp), ("cp", cp), ("dp", world // (tp * cp))]:
            assert sorted(r for grp in g[name] for r in grp) == list(range(world))
            assert all(len(grp) == size for grp in g[name])
        # a tp group and a dp group meet in exactly one rank (orthogonal)
        assert all(len(set(a) & set(b)) <= 1 for a in g["tp"] for b in g["dp"])


def test_single_process_mesh():
    mesh = build_mesh({"tp": 1, "cp": 1})
    assert mesh.sizes == {"tp": 1, "cp": 1, "dp": 1, "pp": 1}
    assert (mesh.dp_size, mesh.rank_in("tp"), mesh.dp_group, mesh.device_mesh) == (1, 0, None, None)
    assert not mesh.model_parallel


def test_order_may_leave_out_dimensions_and_sizes_follow_it():
    assert parse_order("dp") == ("dp", "tp", "cp", "pp")  # the others follow in the registry's order
    assert check_sizes(8, {"tp": 2, "cp": 1}, "cp-dp-tp") == {"cp": 1, "dp": 4, "tp": 2, "pp": 1}
    # pipeline stages vary slowest unless the order names them: 8 ranks, tp 2 x dp 2 x pp 2
    layouts = group_layouts(8, {"tp": 2, "cp": 1, "pp": 2})
    assert layouts["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layouts["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]] and layouts["dp"][0] == [0, 2]


@pytest.mark.parametrize("world,tp,cp,order,message", [
    (8, 3, 1, "tp-cp-dp", "not divisible by tensor_parallel x context_parallel"),
    (4, 2, 1, "tp-xx-dp", "must name parallel dimensions"),
    (4, 2, 1, "tp-dp-tp", "at most once each"),
    (4, 0, 1, "tp-cp-dp", "at least 1"),
])
def test_bad_sizes(world, tp, cp, order, message):
    with pytest.raises(ValueError, match=message):
        check_sizes(world, {"tp": tp, "cp": cp}, order)


@pytest.mark.parametrize("world, flags, message", [
    (4, {"tensor_parallel": 4, "data_parallel": "fsdp"}, "--data_parallel fsdp shards over the data-parallel "
     "ranks, but 4 ranks at tensor_parallel 4 leave 1 data-parallel rank: start 8 ranks or more"),
    (2, {"pipeline_parallel": 2, "data_parallel": "zero1"}, "--data_parallel zero1 shards over"),
    (1, {"grad_compression": "powersgd"}, "--grad_compression powersgd compresses the data-parallel"),
    (4, {"data_parallel": "hsdp"}, "hsdp with one sharding group of all 4 data-parallel ranks is fsdp"),
    (4, {"data_parallel": "hsdp", "dp_shard": 3}, "--dp_shard 3 does not divide the 4 data-parallel ranks"),
])
def test_a_layout_flag_the_ranks_would_switch_off_is_refused(cfg_factory, world, flags, message):
    """fsdp_active and zero1_active are False with one data-parallel rank, DDP (and its
    compression hook) is not built: the flag would be ignored. HSDP with one group is FSDP."""
    cfg = cfg_factory(**flags)
    sizes = check_sizes(world, requested_sizes(cfg.layout), cfg.parallel_order)
    with pytest.raises(ValueError, match=re.escape(message)):
        check_takes_effect(cfg.layout, cfg.memory, sizes, ranks_per_node=4)
    more = check_sizes(world * 6, requested_sizes(cfg.layout), cfg.parallel_order)  # more ranks
    check_takes_effect(cfg.layout, cfg.memory, more, 4)


def test_expert_and_hsdp_groups_are_the_codes(cfg_factory):
    """The rank lists distributed/experts.py and distributed/sharding.py build their groups from."""
    sizes = check_sizes(16, {"tp": 4, "cp": 1, "pp": 1})
    assert expert_layouts(16, sizes, "tp-cp-dp-pp", 4)["ep"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14],
                                                                 [3, 7, 11, 15]]
    sizes = check_sizes(16, {"tp": 1, "cp": 1, "pp": 1})
    layouts = expert_layouts(16, sizes, "tp-cp-dp-pp", 4)
    assert layouts["ep"][1] == [4, 5, 6, 7] and layouts["ep_replicas"][0] == [0, 4, 8, 12]
    assert hsdp_layouts(8, 4) == {"dp_shard": [[0, 1, 2, 3], [4, 5, 6, 7]],
                                  "dp_replicate": [[0, 4], [1, 5], [2, 6], [3, 7]]}


def test_model_must_split(cfg_factory):
    with pytest.raises(ValueError, match="num_heads must be divisible by tensor_parallel.*num_heads=4"):
        bad = cfg_factory(embed_dim=96, num_heads=4, tensor_parallel=3)
        check_model(bad.model, bad.layout)
    with pytest.raises(ValueError, match="context_parallel exceeds the number of tokens"):
        bad = cfg_factory(context_parallel=64)  # 16 x 32 grid, 4 x 4 patches: 32 tokens
        check_model(bad.model, bad.layout)


# ----------------------------------------------------------------------- mappings ---
def _check(name: str, got: torch.Tensor, want: list) -> None:
    want_t = torch.tensor(want, dtype=got.dtype)
    if not torch.equal(got, want_t):
        raise AssertionError(f"{name}: got {got.tolist()}, want {want}")


def _mappings_on_ranks() -> None:
    r, group = dist.get_rank(), dist.group.WORLD
    c = float(r + 1)  # each rank weights its output differently, so backward sums are visible

    x = torch.tensor([1.0, 2.0], requires_grad=True)
    y = M.copy_to(x, group)
    (y * c).sum().backward()
    _check("copy_to forward", y.detach(), [1.0, 2.0])
    _check("copy_to backward (all-reduce 1 + 2)", x.grad, [3.0, 3.0])

    x = torch.full((2,), c, requires_grad=True)
    y = M.reduce_from(x, group)
    (y * c).sum().backward()
    _check("reduce_from forward (1 + 2)", y.detach(), [3.0, 3.0])
    _check("reduce_from backward (identity)", x.grad, [c, c])

    # uneven: 5 items as 3 + 2
    x = torch.arange(5.0, requires_grad=True)
    y = M.scatter_to(x, 0, group, [3, 2])
    (y * c).sum().backward()
    _check("scatter_to forward", y.detach(), [[0.0, 1.0, 2.0], [3.0, 4.0]][r])
    _check("scatter_to backward (all-gather)", x.grad, [1.0, 1.0, 1.0, 2.0, 2.0])
    _check("default split 10 over 4", torch.tensor(M.split_sizes(10, 4)), [3, 3, 2, 2])

    w = torch.arange(5.0) + 10 * r
    x = torch.tensor([[0.0, 1.0, 2.0], [3.0, 4.0]][r], requires_grad=True)
    y = M.gather_from(x, 0, group, [3, 2])
    (y * w).sum().backward()
    _check("gather_from forward", y.detach(), [0.0, 1.0, 2.0, 3.0, 4.0])
    _check("gather_from backward (own slice)", x.grad, [[0.0, 1.0, 2.0], [13.0, 14.0]][r])

    x = torch.tensor([[0.0, 1.0, 2.0], [3.0, 4.0]][r], requires_grad=True)
    y = M.gather_sequence(x, 0, group, [3, 2])
    (y * w).sum().backward()
    _check("gather_sequence forward", y.detach(), [0.0, 1.0, 2.0, 3.0, 4.0])
    # w0 + w1 = 2 * arange(5) + 10, rank 0 keeps items 0..2, rank 1 items 3..4
    _check("gather_sequence backward (reduce-scatter)", x.grad, [[10.0, 12.0, 14.0], [16.0, 18.0]][r])

    # every rank holds 5 partial sums (rank r: arange(5) + 10 r); each keeps its 3 + 2 of the sum
    x = (torch.arange(5.0) + 10 * r).requires_grad_()
    y = M.reduce_scatter_to(x, 0, group, [3, 2])
    (y * c).sum().backward()
    _check("reduce_scatter_to forward", y.detach(), [[10.0, 12.0, 14.0], [16.0, 18.0]][r])
    _check("reduce_scatter_to backward (all-gather)", x.grad, [1.0, 1.0, 1.0, 2.0, 2.0])

    _reduce_scatter_both_ways(r, group)

    # all-to-all, uneven: rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 3 to rank 0
    # and 1 to itself. Backward: each row's gradient goes back where the row came from.
    send = [[1, 2], [3, 1]][r]
    recv = [send_r[r] for send_r in ([1, 2], [3, 1])]
    x = (torch.arange(float(sum(send))) + 10 * r).unsqueeze(1).requires_grad_()
    y = M.all_to_all(x, group, recv, send)
    (y * c * torch.arange(1.0, y.shape[0] + 1).unsqueeze(1)).sum().backward()
    _check("all_to_all forward", y.detach().flatten(), [[0.0, 10.0, 11.0, 12.0], [1.0, 2.0, 13.0]][r])
    # rank 0's rows went to: itself (weight 1 x 1), rank 1 (weights 2 x 1, 2 x 2); rank 1's rows
    # to rank 0 (weights 1 x 2, 1 x 3, 1 x 4) and itself (2 x 3)
    _check("all_to_all backward (the reverse all-to-all)", x.grad.flatten(),
           [[1.0, 2.0, 4.0], [2.0, 3.0, 4.0, 6.0]][r])
    from torch.distributed.nn.functional import all_to_all_single  # torch's, with autograd
    x2 = x.detach().clone().requires_grad_()
    out = torch.empty_like(y)
    y2 = all_to_all_single(out, x2, recv, send, group=group)
    (y2 * c * torch.arange(1.0, y.shape[0] + 1).unsqueeze(1)).sum().backward()
    _check("torch's all_to_all_single agrees", y2.detach().flatten(), y.detach().flatten().tolist())
    _check("and so does its backward", x2.grad.flatten(), x.grad.flatten().tolist())

    # non-contiguous input: a transposed (2, 5) view, split along dim 1 as 3 + 2
    base = torch.arange(10.0).view(5, 2)
    x = base.t().requires_grad_()  # x[i, j] = 2 j + i
    assert not x.is_contiguous()
    y = M.scatter_to(x, 1, group, [3, 2])
    want = [[[0.0, 2.0, 4.0], [1.0, 3.0, 5.0]], [[6.0, 8.0], [7.0, 9.0]]][r]
    _check("scatter_to of a non-contiguous tensor", y.detach(), want)
    z = M.gather_from(y.t(), 0, group, [3, 2])  # gather a non-contiguous slice back
    _check("gather_from of a non-contiguous tensor", z.detach(), base.tolist())

    # a group of one rank (or None): identity both ways
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    for f in (lambda t: M.copy_to(t, None), lambda t: M.reduce_from(t, None),
              lambda t: M.gather_sequence(t, 0, None)):
        f(x).sum().backward()
    _check("identity without a group", x.grad, [3.0, 3.0])


def _reduce_scatter_both_ways(r: int, group) -> None:
    """reduce_scatter_along by a reduce-scatter where the backend has one (gloo here), and by an
    all-reduce and a slice where it has none (faked): the same sums, even and uneven slices,
    along dims 0 and 1."""
    calls = []
    originals = {name: getattr(dist, name) for name in ("reduce_scatter_tensor", "all_reduce")}

    def counted(name):
        return lambda *args, **kwargs: calls.append(name) or originals[name](*args, **kwargs)

    x = (torch.arange(10.0).view(2, 5) + 100 * r).requires_grad_()
    total = 2 * torch.arange(10.0).view(2, 5) + 100  # the sum over the 2 ranks
    try:
        for name in originals:
            setattr(dist, name, counted(name))
        for has_it in (True, False):
            M.REDUCE_SCATTER_BACKENDS = ("nccl", "gloo") if has_it else ("nccl",)
            for dim, sizes in ((0, [1, 1]), (1, [3, 2]), (1, [4, 1])):
                calls.clear()
                y = M.reduce_scatter_to(x, dim, group, sizes)
                _check(f"reduce_scatter_to along {dim} as {sizes} (reduce-scatter: {has_it})", y.detach(),
                       total.narrow(dim, sum(sizes[:r]), sizes[r]).tolist())
                assert calls == (["reduce_scatter_tensor"] if has_it else ["all_reduce"]), (has_it, calls)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        M.REDUCE_SCATTER_BACKENDS = ("nccl", "gloo")


def _fail_on_rank_1() -> None:
    if dist.get_rank() == 1:
        raise ValueError("only rank 1 fails")


def test_a_failure_on_one_rank_fails_the_test():
    with pytest.raises(AssertionError, match="only rank 1 fails"):
        run_ranks(2, _fail_on_rank_1)


# ------------------------------------------------------- parallel ViT == serial ViT ---
# fp32, tolerance rtol 1e-4 with an absolute floor of 1e-5 x the largest magnitude: the
# parallel model sums the same products in a different order (split matmuls, then an
# all-reduce), which changes fp32 rounding (eps 1.2e-7) by about 1e-6 relative after a
# few hundred additions. Real bugs (a bias added twice, a gradient summed over tp or not
# summed over cp) are errors of order 1 and fail by many orders of magnitude. Weight
# gradients get an absolute floor of 1e-5 x the largest weight gradient: the key bias's
# gradient is zero in exact arithmetic (softmax ignores a shift shared by all scores), so
# only rounding noise (about 1e-7 of the largest gradient) is left to compare there.
RTOL = 1e-4
ATOL_FRACTION = 1e-5

MODEL = dict(img_size=(12, 20), patch_size=4, in_channels=3, out_channels=2, embed_dim=32, depth=2,
             num_heads=4)  # 3 x 5 = 15 tokens: context parallel splits them unevenly (8 + 7)
GLOBAL_BATCH = 4


def _close(name: str, got: torch.Tensor, want: torch.Tensor, errors: list[str], scale: float = 0.0) -> None:
    atol = ATOL_FRACTION * max(want.abs().max().item(), scale)
    if got.shape != want.shape or not torch.allclose(got, want, rtol=RTOL, atol=atol):
        diff = (got - want).abs().max().item() if got.shape == want.shape else "shape"
        errors.append(f"{name}: max difference {diff} (scale {want.abs().max().item():.3g})")


def _parity_on_ranks(layouts: list[tuple[int, ...]]) -> None:
    """Each layout (tp, cp), (tp, cp, sequence parallel), (tp, cp, sp, experts) or (tp, cp, sp,
    experts, expert parallel) against the serial model; with experts, the second block's MLP is
    a top-2 mixture of 4 (replicated, or split over ep data-parallel ranks)."""
    from distributed import experts as ep_lib

    errors: list[str] = []
    for tp, cp, *rest in layouts:
        sp = bool(rest and rest[0])
        model = {**MODEL, **({"num_experts": 4, "moe_top_k": 2} if rest[1:] and rest[1] else {})}
        ep = rest[2] if rest[2:] else 1
        mesh = build_mesh({"tp": tp, "cp": cp})
        where = (f"tp={tp} cp={cp}{' sp' if sp else ''}{' moe' if 'num_experts' in model else ''} "
                 f"ep={ep} dp={mesh.dp_size} ({mesh.describe()})")
        torch.manual_seed(0)
        serial = ViT(**model)
        state_after_serial = torch.get_rng_state()
        torch.manual_seed(0)
        par = apply_model_parallel(ViT(**model), mesh, sequence_parallel=sp)
        if ep > 1:
            par = ep_lib.apply_expert_parallel(par, mesh, ep)
        if not torch.equal(torch.get_rng_state(), state_after_serial):
            errors.append(f"{where}: building the parallel model used the random generator differently")
        for name, full in full_state(par, mesh).items():  # initialised as the serial model's shards
            _close(f"{where} initial weight {name}", full, serial.get_parameter(name).detach(), errors)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():  # biases start at 0 and norms at 1: move them so every term counts
            for p in serial.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
        state = serial.state_dict()
        load_full_state(par, ep_lib.local_model_state(par, state) if ep > 1 else state, mesh)
        model = wrap_data_parallel(par, mesh, torch.device("cpu"))

        x = torch.randn(GLOBAL_BATCH, 3, 12, 20, generator=gen)
        w = torch.randn(GLOBAL_BATCH, 2, 12, 20, generator=gen)  # loss weights: distinct gradients

        xs = x.clone().requires_grad_()
        out_s = serial(xs)
        (out_s * w).sum().div(GLOBAL_BATCH).backward()

        local = GLOBAL_BATCH // mesh.dp_size  # each data-parallel replica takes its part
        sl = slice(mesh.dp_rank * local, (mesh.dp_rank + 1) * local)
        xp = x[sl].clone().requires_grad_()
        out_p = model(xp)
        (out_p * w[sl]).sum().div(local).backward()

        _close(f"{where} output", out_p.detach(), out_s.detach()[sl], errors)
        # the input gradient: context-parallel ranks each hold the part that flowed through
        # their tokens (summed here; with sp the tp ranks too); per-replica mean losses make it
        # dp times the serial one
        gx = M.reduce_from(xp.grad, mesh.group("cp")) / mesh.dp_size
        if sp:
            gx = M.reduce_from(gx, mesh.group("tp"))
        _close(f"{where} input gradient", gx, xs.grad[sl], errors)
        # clipping by the global norm, active (the limit is half the norm): every rank must
        # find the serial model's norm, and scale its gradients alike
        limit = 0.5 * torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in serial.parameters()]))
        want_norm = torch.nn.utils.clip_grad_norm_(serial.parameters(), limit.item())
        got_norm = clip_grad_norm(list(par.parameters()), limit.item(), mesh)
        _close(f"{where} gradient norm", got_norm, want_norm, errors)
        grads = full_state(par, mesh, grads=True)
        if ep > 1:  # every expert's gradient, from the rank that holds it
            grads = ep_lib.full_model_state(par, mesh, grads)
        largest = max(p.grad.abs().max().item() for p in serial.parameters())
        for name, p in serial.named_parameters():
            _close(f"{where} gradient of {name}", grads[name], p.grad, errors, largest)
    if errors:
        raise AssertionError(f"rank {dist.get_rank()}:\n" + "\n".join(errors[:12]))


EVEN_MODEL = {**MODEL, "img_size": (16, 16)}  # 16 tokens: torch's sequence parallelism splits evenly


def _torch_tp_steps_on_ranks() -> None:
    """tp 2, and tp 2 with sequence parallelism: the course's layers and torch's parallelize_module
    (the same plan, ``ViT.tp_plan``) against the serial model for two SGD steps: outputs, the
    gradient norm and every weight after each step."""
    errors: list[str] = []
    mesh = build_mesh({"tp": 2})
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randn(2, 3, 16, 16, generator=gen), torch.randn(2, 2, 16, 16, generator=gen))
               for _ in range(2)]
    for sp in (False, True):
        torch.manual_seed(0)
        serial = ViT(**EVEN_MODEL)
        models = {"serial": serial}
        for impl in ("course", "torch"):
            torch.manual_seed(0)
            models[impl] = wrap_data_parallel(apply_model_parallel(ViT(**EVEN_MODEL), mesh, sp, impl), mesh,
                                              torch.device("cpu"))
        # SGD: Adam would turn the float noise of gradients that are 0 in exact arithmetic (the key
        # biases') into whole steps of the learning rate
        optims = {k: torch.optim.SGD(m.parameters(), lr=0.05) for k, m in models.items()}
        for step, (x, w) in enumerate(batches):
            out, norm = {}, {}
            for name, m in models.items():
                optims[name].zero_grad()
                out[name] = m(x)
                (out[name] * w).sum().backward()
                norm[name] = (torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9) if name == "serial"
                              else clip_grad_norm(list(m.parameters()), 1e9, mesh))
                optims[name].step()
            for impl in ("course", "torch"):
                where = f"{impl} sp={sp} step {step}"
                _close(f"{where} output", out[impl].detach(), out["serial"].detach(), errors)
                _close(f"{where} gradient norm", norm[impl], norm["serial"], errors)
                for name, full in full_state(models[impl], mesh).items():
                    _close(f"{where} weight {name}", full, serial.get_parameter(name).detach(), errors)
    with pytest.raises(ValueError, match="splits the 15 tokens evenly over --tensor_parallel 2"):
        apply_model_parallel(ViT(**MODEL), mesh, True, "torch")
    if errors:
        raise AssertionError(f"rank {dist.get_rank()}:\n" + "\n".join(errors[:12]))


def _mappings_then_parity(layouts: list[tuple[int, ...]]) -> None:
    from tests.test_experts import checkpoint_round_trip

    _mappings_on_ranks()
    _parity_on_ranks(layouts)
    _torch_tp_steps_on_ranks()
    checkpoint_round_trip()  # a serial checkpoint loads into 2 expert-parallel ranks and back


def test_mappings_and_tp2_cp2_match_serial_on_two_ranks():
    """One set of 2 ranks (starting ranks is the slow part): the mappings against
    hand-computed values, then the parallel ViT against the serial one for tp=2 and cp=2 (and
    tp=2 with sequence parallelism, and with replicated experts), then a checkpoint's round trip
    through 2 expert-parallel ranks (tests/test_experts.py), and torch's parallelize_module against
    the course's layers and the serial model."""
    run_ranks(2, _mappings_then_parity, [(2, 1), (1, 2), (2, 1, True), (2, 1, False, True)])


BIG = {"embed_dim": 2048, "depth": 8, "num_heads": 16}  # 402M parameters: 1.6 GB in fp32


def _build_peak(cfg, run_dir) -> tuple[float, int]:
    """A trainer's build_peak_MiB with the process's peak reset just before, and the model's size."""
    import gc

    from training.context import RunContext
    from training.trainer import Trainer
    from utils import device as dev

    gc.collect()
    dev.reset_process_peak()
    ctx = RunContext(device=torch.device("cpu"), run_dir=run_dir, rank=dist.get_rank(),
                     world_size=dist.get_world_size(), mesh=build_mesh({}, "tp-cp-dp", "cpu"))
    trainer = Trainer(cfg, ctx, cfg.global_batch_size // dist.get_world_size())
    return trainer.build_peak_MiB, trainer.n_params


def _placement_on_two_nodes() -> None:
    """4 ranks as 2 Slurm nodes of 2 (SLURMD_NODENAME n1, n1, n2, n2): rank 0 logs each rank's node
    and groups as that rank reports them, and warns when tp groups span nodes (the order dp-tp-cp
    puts dp fastest: tp groups [0, 2] and [1, 3])."""
    import logging
    import os

    os.environ["SLURMD_NODENAME"] = f"n{dist.get_rank() // 2 + 1}"
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("distributed.mesh")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        build_mesh({"tp": 2, "cp": 1}, "tp-cp-dp")
        build_mesh({"tp": 2, "cp": 1}, "dp-tp-cp")
    finally:
        logger.removeHandler(handler)
        del os.environ["SLURMD_NODENAME"]
    lines = [(r.levelname, r.getMessage()) for r in records]
    if dist.get_rank() != 0:
        assert lines == [], lines
        return
    assert ("INFO", "parallel layout rank 2 on node n2: tp 0/2 of [2, 3], cp 0/1, dp 1/2 of [0, 2], "
                    "pp 0/1 (order tp-cp-dp-pp)") in lines, lines
    assert ("INFO", "parallel layout rank 2 on node n2: dp 0/2 of [2, 3], tp 1/2 of [0, 2], cp 0/1, "
                    "pp 0/1 (order dp-tp-cp-pp)") in lines, lines
    warnings = [message for level, message in lines if level == "WARNING"]
    assert len(warnings) == 1 and warnings[0].startswith(
        "2 tensor-parallel group(s) span nodes (ranks [0, 2] on n1, n2)"), warnings


def _parity_then_fsdp_build(layouts: list[tuple[int, ...]], data_dir: str, out_dir: str) -> None:
    """Where ranks sit on nodes, the layouts against serial, then FSDP on 4 ranks building a model
    of 1.6 GB: built on the meta device, each rank allocates only its shards (and one whole
    parameter at a time), so its peak grows by far less than half the model over a tiny model's
    build."""
    from pathlib import Path

    from tests.conftest import make_cfg

    _placement_on_two_nodes()
    _parity_on_ranks(layouts)
    with pytest.raises(ValueError, match="--tp_impl torch runs tensor .* alone here"):  # tp 2 x dp 2
        apply_model_parallel(ViT(**MODEL), build_mesh({"tp": 2}), False, "torch")
    out = Path(out_dir)
    tiny, _ = _build_peak(make_cfg(data_dir, out, data_parallel="fsdp"), out / "tiny")
    big, n_params = _build_peak(make_cfg(data_dir, out, data_parallel="fsdp", **BIG), out / "big")
    model_mib = 4 * n_params / 2**20
    assert model_mib >= 1.5e9 / 2**20, model_mib  # at least 1.5 GB
    assert big - tiny < model_mib / 2, (f"rank {dist.get_rank()}: build peak {big:.0f} MiB against "
                                        f"{tiny:.0f} for tiny; the model is {model_mib:.0f} MiB")
    (out / f"build_peak_{dist.get_rank()}.txt").write_text(f"{tiny:.1f} {big:.1f} {model_mib:.1f}")


@pytest.mark.slow
def test_four_rank_layouts_match_serial_and_fsdp_builds_in_shards(data_dir, tmp_path):
    # the placement log and its warning of tp groups across nodes; then tp=2 x dp=2, tp=2 x cp=2,
    # cp=2 x dp=2 (cp gradients summed inside DDP's comm hook), and
    # with sequence parallelism tp=2 x dp=2 (the hook sums part of a bucket over tp) and
    # tp=2 x cp=2 (tokens split over cp, then over tp; the tag hooks sum over both)
    # and expert parallel: tp=2 x dp=2 with the dp pair splitting the experts, and dp=4 in 2
    # blocks of 2 (each expert averaged over the 2 ranks that hold it)
    run_ranks(4, _parity_then_fsdp_build, [(2, 1), (2, 2), (1, 2), (2, 1, True), (2, 2, True),
                                           (2, 1, False, True, 2), (1, 1, False, True, 2)],
              str(data_dir), str(tmp_path))
    for rank in range(4):
        print(rank, (tmp_path / f"build_peak_{rank}.txt").read_text())


def test_saved_activation_bytes_counts_each_storage_once():
    from scripts.mp_memory import saved_activation_bytes

    lin = torch.nn.Linear(8, 4)
    x = torch.randn(16, 8)
    nbytes, out = saved_activation_bytes(lambda t: lin(t) + lin(t), x)  # x saved twice, counted once
    assert nbytes == 16 * 8 * 4  # the weight is a parameter, not an activation
    assert out.shape == (16, 4)


@pytest.mark.parametrize("flags", [{}, {"tensor_parallel": 2, "context_parallel": 2},
                                   {"tensor_parallel": 2, "pipeline_parallel": 2}])
def test_torch_tensor_parallelism_alone_is_asked_for(cfg_factory, flags):
    with pytest.raises(ValueError, match="--tp_impl torch is tensor parallelism alone here: use it with "
                                         "--tensor_parallel 2 or more"):
        cfg_factory(tp_impl="torch", **flags)


@pytest.mark.parametrize("flags, message", [
    ({}, "--sequence_parallel splits what tensor parallelism replicates; use it with --tensor_parallel 2"),
    ({"tensor_parallel": 2, "data_parallel": "fsdp"}, "does not combine with --data_parallel fsdp here"),
    ({"tensor_parallel": 2, "pipeline_parallel": 2}, "does not combine with --pipeline_parallel here"),
])
def test_sequence_parallel_refusals_are_one_line(cfg_factory, flags, message):
    with pytest.raises(ValueError) as err:
        cfg_factory(sequence_parallel=True, **flags)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_sequence_parallel_needs_a_token_per_rank(cfg_factory):
    with pytest.raises(ValueError, match="sequence_parallel needs a token for every tp rank"):
        bad = cfg_factory(sequence_parallel=True, tensor_parallel=4, context_parallel=16)
        check_model(bad.model, bad.layout)


def test_config_rejects_a_bad_parallel_order(cfg_factory):
    assert cfg_factory(parallel_order="dp-cp-tp").parallel_order == "dp-cp-tp"
    with pytest.raises(ValueError, match="'parallel_order' is 'tp-tp'"):
        cfg_factory(parallel_order="tp-tp")


@pytest.mark.parametrize("shard_dim", [0, 1])
def test_a_shard_owns_its_memory(shard_dim):
    """Loading a consolidated checkpoint must not leave every rank holding the whole tensor
    (a chunk is a view of it; Adam's moments would keep all of them alive)."""
    full = torch.arange(24.0).reshape(4, 6)
    mesh = ParallelMesh(sizes={"tp": 2, "cp": 1, "dp": 1}, rank=1, coords={"tp": 1})
    shard = take_shard(full, ParamSpec(shard_dim), mesh)
    assert torch.equal(shard, full.chunk(2, dim=shard_dim)[1])
    assert shard.is_contiguous()
    assert shard.untyped_storage().nbytes() == shard.numel() * shard.element_size()


def test_consolidation_moves_each_gathered_tensor_to_host_memory_at_once(monkeypatch):
    """A checkpoint's whole tensors go to host memory one by one as they are gathered, so a GPU
    never holds more than one of them beside the model (all at once: the model and Adam's
    state again). No CPU test sees device memory, so the device is faked: each gathered tensor
    is marked, and the move to the host is a copy, as it is from a GPU."""
    from distributed import consolidate as C

    gathered: list = []
    alive_at_once = []
    real_gather = C.gather_full

    def gather(t, p_spec, mesh, device=None):
        out = real_gather(t, p_spec, mesh, device)
        gathered.append(weakref.ref(out))
        alive_at_once.append(sum(r() is not None for r in gathered))
        return out

    monkeypatch.setattr(C, "gather_full", gather)
    monkeypatch.setattr(C, "to_host", lambda t: t.clone())  # from a GPU, .to("cpu") copies
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    mesh = ParallelMesh(sizes={"dp": 1})
    state = C.full_state(model, mesh)
    assert list(state) == [n for n, _ in model.named_parameters()]
    assert all(torch.equal(state[n], p) for n, p in model.named_parameters())
    opt_state = C.full_optimizer_state(opt, mesh)
    assert len(gathered) == 4 + 2 * 4  # 4 tensors; each with Adam's two moments
    assert max(alive_at_once) == 1, alive_at_once  # never two gathered tensors held at once
    assert all(torch.equal(opt_state["state"][i]["exp_avg"], opt.state[p]["exp_avg"])
               for i, p in enumerate(model.parameters()))


def test_a_shard_in_host_memory_is_gathered_on_its_parameters_device(monkeypatch):
    """ZeRO-1 consolidates Adam's state into host memory (torch's ZeroRedundancyOptimizer) and NCCL
    gathers only device tensors, so a tp-sharded moment goes back to its parameter's device for
    the gather over tp. The meta device stands in for the GPU; the gather is faked (one process)."""
    from distributed import consolidate as C
    from distributed import mappings

    seen = []

    def gather(t, dim, group, sizes):
        seen.append(t.device)
        return torch.cat([t] * len(sizes), dim)

    monkeypatch.setattr(mappings, "all_gather_along", gather)
    mesh = ParallelMesh(sizes={"tp": 2, "cp": 1, "dp": 1}, coords={"tp": 0})
    whole = C.gather_full(torch.ones(2, 3), ParamSpec(1), mesh, torch.device("meta"))
    assert seen == [torch.device("meta")] and whole.shape == (2, 6)
