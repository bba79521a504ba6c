"""Checks for the exercises in exercises/: the reference solutions in CI, yours with
`make exercise NAME=...` (which sets EXERCISE_VARIANT=exercise)."""

import importlib
import importlib.util
import os
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from networks.vit import ViT
from tests.conftest import REPO
from tests.dist_spawn import run_ranks
from training.context import RunContext
from training.trainer import Trainer
from utils.data_loader import ERA5Dataset

VARIANT = os.environ.get("EXERCISE_VARIANT", "solution")
NAMES = ("sample_index", "amp_step", "allreduce_grads", "compress_hook", "tp_mlp", "tp_mlp_split",
         "grad_accum", "pipeline_balance", "lamb_trust", "dispatch", "zero_memory", "activation_memory",
         "freeze_schedule", "pipedream_planner", "onebit_compress")


def exercise(name: str, variant: str = VARIANT):
    return importlib.import_module(f"exercises.{name}_{variant}")


def shipped_exercise(name: str, tmp_path):
    """The exercise file as committed (a student's solution in the working copy must not turn
    the suite red), imported from a copy."""
    path = f"exercises/{name}_exercise.py"
    result = subprocess.run(["git", "-C", str(REPO), "show", f"HEAD:{path}"], capture_output=True,
                            text=True)
    if result.returncode:
        pytest.skip(f"not a git checkout, so the shipped {path} cannot be told from an edited one")
    copy = tmp_path / f"shipped_{name}.py"
    copy.write_text(result.stdout)
    spec = importlib.util.spec_from_file_location(f"shipped_{name}", copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(VARIANT != "solution", reason="checks the shipped exercise files")
@pytest.mark.parametrize("name", NAMES)
def test_shipped_exercises_are_unsolved(name, tmp_path):
    """The committed exercise files really have their key lines removed: the checks below fail on
    them. (Your own edits to them are not looked at here: `make exercise NAME=...` checks those.)"""
    module = shipped_exercise(name, tmp_path)
    functions = ("locate", "amp_step", "average_gradients", "bf16_hook", "shard_mlp", "tp_mlp_forward",
                 "accumulate_gradients", "balance_stages", "lamb_update", "dispatch_plan",
                 "zero_bytes_per_rank", "block_activation_bytes", "frozen_after", "plan_pipeline",
                 "compress_with_feedback")
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


def fp32_loss(loss_fn):
    """The loss function, refusing what TODO 2 forbids: a low-precision prediction, or autocast."""

    def checked(pred, tar):
        assert pred.dtype == torch.float32, (
            f"the loss got a {pred.dtype} prediction: compute it in fp32 (TODO 2: pred.float())")
        assert not torch.is_autocast_enabled("cpu"), (
            "the loss was computed under autocast: leave the autocast block before it (TODO 2)")
        return loss_fn(pred, tar)

    return checked


@pytest.mark.parametrize("amp_mode", ["bf16", "fp16"])
def test_amp_step(cfg_factory, tmp_path, amp_mode):
    ex = exercise("amp_step")
    # torch's own attention kernel, as the learner's step runs (the trainer's timed choice of
    # kernel, attention_kernel auto, would round bf16 differently: it is not this exercise's)
    cfg = cfg_factory(amp_mode=amp_mode, lr_schedule="constant", attention_kernel="default")
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
        got = ex.amp_step(model, optimizer, scaler, fp32_loss(trainer.loss_fn), inp, tar, "cpu", dtype)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, expected)
    for a, b in zip(model.parameters(), trainer.model.parameters()):
        torch.testing.assert_close(a, b)
    if scaler is not None:
        assert scaler.get_scale() == trainer.scaler.get_scale()


def assert_close_with_hint(got: torch.Tensor, want: torch.Tensor, what: str,
                           mistakes: dict[str, torch.Tensor]) -> None:
    """assert_close, and when it fails, the likely mistake: ``mistakes`` maps a hint to what
    ``got`` would be had the student made that mistake."""
    if torch.allclose(got, want, rtol=1e-5, atol=1e-5):
        return
    for hint, wrong in mistakes.items():
        if got.shape == wrong.shape and torch.allclose(got, wrong, rtol=1e-4, atol=1e-5):
            raise AssertionError(f"{what} is wrong. Hint: {hint}")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{what} differs from the reference")


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
            if model is ddp:
                ddp_grads = [p.grad.clone() for p in reference.parameters()]
            else:
                local = [p.grad.clone() for p in manual.parameters()]
                average_gradients(manual)
                world = dist.get_world_size()
                for want, q, own in zip(ddp_grads, manual.parameters(), local):
                    assert_close_with_hint(q.grad, want, f"rank {rank}'s averaged gradient", {
                        f"it is {world} times DDP's: after the all-reduce (a sum) divide by the "
                        f"number of ranks": want * world,
                        "it is still this rank's own gradient: all-reduce it over the group": own,
                    })
            opt.step()
            opt.zero_grad()
    for a, b in zip(reference.parameters(), manual.parameters()):
        # same reduction (sum then divide) in both: equal up to the order of float additions
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.timeout(120)
def test_allreduce_grads():
    run_ranks(2, _ddp_versus_manual, VARIANT)


def _hook_versus_torchs(variant: str) -> None:
    """On each rank: DDP with the exercise's bf16 hook and DDP with torch's bf16_compress_hook,
    from the same weights on the same data, hold the same gradients and weights after 3 steps."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    rank = dist.get_rank()
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
              for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    ddps = [DistributedDataParallel(m) for m in models]
    # wrapped: DDP refuses torch's bf16 hook by name without NCCL, though gloo reduces bf16 too
    ddps[0].register_comm_hook(None, lambda group, bucket: default_hooks.bf16_compress_hook(group, bucket))
    ddps[1].register_comm_hook(None, exercise("compress_hook", variant).bf16_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
        for ddp in ddps:
            torch.nn.functional.mse_loss(ddp(x), y).backward()
        for want, got in zip(models[0].parameters(), models[1].parameters()):
            assert_close_with_hint(got.grad, want.grad, f"rank {rank}'s gradient after the hook", {
                "it is not divided by the number of ranks": want.grad * dist.get_world_size(),
            })
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.timeout(120)
def test_compress_hook():
    run_ranks(2, _hook_versus_torchs, VARIANT)


def _grad_accum_versus_one_batch(variant: str) -> None:
    """On each rank: accumulate_gradients over 4 micro-batches of its 8 samples under DDP must give
    the gradients of one backward over the global batch of 16 on a plain model, with one
    all-reduce per call (counted by a comm hook)."""
    import copy

    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    n_micro, local = 4, 8
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    whole = copy.deepcopy(model)  # unwrapped, fed the whole global batch: the reference
    alone = copy.deepcopy(model)  # unwrapped, fed this rank's batch: gradients never all-reduced
    ddp = DistributedDataParallel(model)  # about 180 parameters: a single gradient bucket

    def counting_allreduce(state: dict[str, int],
                           bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Count the bucket, then reduce it as DDP does by default (average over the ranks)."""
        state["buckets"] += 1
        return default_hooks.allreduce_hook(None, bucket)

    counter = {"buckets": 0}
    ddp.register_comm_hook(counter, counting_allreduce)

    def batches(step: int):
        g = torch.Generator().manual_seed(step)  # the same global batch on every rank
        x, y = torch.randn(world * local, 8, generator=g), torch.randn(world * local, 2, generator=g)
        own = slice(rank * local, (rank + 1) * local)
        return x, y, x[own], y[own]

    # the counter itself: a loop without no_sync all-reduces once per micro-batch
    _, _, x_own, y_own = batches(0)
    for x, y in zip(x_own.chunk(n_micro), y_own.chunk(n_micro)):
        (F.mse_loss(ddp(x), y) / n_micro).backward()
    assert counter["buckets"] == n_micro, (  # fails if the model outgrew one bucket: not your code
        f"the check itself is broken: {counter['buckets']} buckets without no_sync, want {n_micro}")
    ddp.zero_grad(set_to_none=True)

    sizes: list[int] = []  # the batch size of every loss_fn call

    def loss_fn(pred: torch.Tensor, tar: torch.Tensor) -> torch.Tensor:
        sizes.append(pred.shape[0])
        return F.mse_loss(pred, tar)

    accumulate = exercise("grad_accum", variant).accumulate_gradients
    for step in range(2):
        x, y, x_own, y_own = batches(step)
        counter["buckets"] = 0
        sizes.clear()
        got = accumulate(ddp, loss_fn, x_own, y_own, n_micro)
        assert sizes == [local // n_micro] * n_micro, (
            f"the loss saw batches of {sizes}, want {n_micro} micro-batches of {local // n_micro}: "
            f"split inp and tar with .chunk(n_micro) and run each through the model")
        assert counter["buckets"] != 0, (
            "the gradients were never all-reduced: run the last micro-batch outside model.no_sync()")
        assert counter["buckets"] == 1, (
            f"{counter['buckets']} gradient all-reduces in one call, want 1: run every micro-batch but "
            f"the last inside model.no_sync()")
        F.mse_loss(whole(x), y).backward()
        own_loss = F.mse_loss(alone(x_own), y_own)
        own_loss.backward()
        for name, p, want, own in zip(("w1", "b1", "w2", "b2"), model.parameters(), whole.parameters(),
                                      alone.parameters()):
            assert_close_with_hint(p.grad, want.grad, f"rank {rank}'s gradient of {name}", {
                f"it is {n_micro} times too large: divide each micro-batch's loss by n_micro":
                    want.grad * n_micro,
                "it is this rank's own gradient: the last micro-batch must run outside no_sync":
                    own.grad,
            })
        assert float(got) == pytest.approx(own_loss.item(), rel=1e-5), (
            "the returned loss is not the mean over the batch: sum the micro-batch losses after "
            "dividing each by n_micro")
        for m in (ddp, whole, alone):
            m.zero_grad(set_to_none=True)


@pytest.mark.timeout(120)
def test_grad_accum():
    run_ranks(2, _grad_accum_versus_one_batch, VARIANT)


def _serial_mlp():
    """The MLP both tensor-parallel exercises split (weights large enough that every term counts)."""
    from networks.vit import MLP

    torch.manual_seed(0)
    serial = MLP(8, 32)
    for p in serial.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return serial


def _tp_mlp_versus_serial(variant: str) -> None:
    import torch.distributed as dist


    rank, tp = dist.get_rank(), dist.get_world_size()
    serial = _serial_mlp()
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
    with torch.no_grad():
        partial = F.linear(F.gelu(F.linear(x, w1, b1)), w2)  # this rank's fc2 product alone
    # fp32, the same products summed in a different order: agreement to ~1e-6
    assert_close_with_hint(out.detach(), expected.detach(), "the output", {
        "fc2's bias was added on every rank before the sum, so it counts tp times: add it once, "
        "after reduce_from": expected.detach() + (tp - 1) * b2.detach(),
        "the ranks' partial products were never summed: reduce_from after fc2": partial + b2.detach(),
    })
    out.square().sum().backward()
    expected.square().sum().backward()
    x_part = torch.autograd.grad(F.linear(F.gelu(F.linear(x.requires_grad_(), w1, b1)), w2).add(b2)
                                 .mul(expected.detach()).mul(2).sum(), x)[0]
    assert_close_with_hint(x_tp.grad, x_serial.grad, "the gradient of x", {
        "it holds only this rank's part: enter the tensor-parallel region with copy_to, whose "
        "backward sums the ranks' parts": x_part,
    })
    torch.testing.assert_close(w1.grad, serial.fc1.weight.grad[shard], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w2.grad, serial.fc2.weight.grad[:, shard], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b2.grad, serial.fc2.bias.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(120)
def test_tp_mlp():
    run_ranks(2, _tp_mlp_versus_serial, VARIANT)


def _tp_mlp_split_versus_serial(variant: str) -> None:
    import torch.distributed as dist


    rank, tp = dist.get_rank(), dist.get_world_size()
    serial = _serial_mlp()
    ex = exercise("tp_mlp_split", variant)
    shards = ex.shard_mlp(serial.fc1.weight.detach(), serial.fc1.bias.detach(), serial.fc2.weight.detach(),
                          serial.fc2.bias.detach(), rank, tp)
    own = slice(rank * 32 // tp, (rank + 1) * 32 // tp)
    want = (serial.fc1.weight[own], serial.fc1.bias[own], serial.fc2.weight[:, own], serial.fc2.bias)
    for name, got, ref in zip(("w1", "b1", "w2", "b2"), shards, want):
        assert got.shape == ref.shape, (
            f"{name} has shape {tuple(got.shape)}, want {tuple(ref.shape)}. Hint: fc1 is split by rows "
            f"(output features), fc2's weight by columns (input features), fc2's bias not at all")
        assert torch.equal(got, ref.detach()), f"{name} holds another rank's block: rank r owns block r"
        assert got.untyped_storage().nbytes() == got.numel() * got.element_size(), (
            f"{name} is a view of the whole tensor: .clone() it")
    params = [t.clone().requires_grad_() for t in shards]
    x = torch.randn(2, 5, 8)
    x_serial, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = ex.tp_mlp_forward(x_tp, *params, dist.group.WORLD)
    expected = serial(x_serial)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(x_tp.grad, x_serial.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(params[0].grad, serial.fc1.weight.grad[own], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(params[2].grad, serial.fc2.weight.grad[:, own], rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(120)
def test_tp_mlp_split():
    run_ranks(2, _tp_mlp_split_versus_serial, VARIANT)


def _largest_stage_by_brute_force(costs: list[float], n_stages: int) -> float:
    """Every way to place n_stages - 1 cuts between the layers: the best largest stage."""
    import itertools

    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), n_stages - 1):
        bounds = (0, *cuts, len(costs))
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def test_pipeline_balance():
    balance = exercise("pipeline_balance").balance_stages
    rng = np.random.default_rng(0)
    cases = [([1.0] * 8, 4), ([1.0] * 4, 4), ([5.0], 1), ([3.0, 1.0, 1.0, 1.0], 2)]
    cases += [(list(rng.uniform(0.5, 3.0, size=int(rng.integers(2, 10)))), 0) for _ in range(40)]
    for costs, n_stages in cases:
        n_stages = n_stages or int(rng.integers(1, len(costs) + 1))
        ranges = balance(costs, n_stages)
        assert len(ranges) == n_stages and all(len(r) > 0 for r in ranges), (costs, ranges)
        assert [i for r in ranges for i in r] == list(range(len(costs))), "contiguous, in order, all layers"
        largest = max(sum(costs[i] for i in r) for r in ranges)
        assert largest == pytest.approx(_largest_stage_by_brute_force(costs, n_stages)), (costs, ranges)
    # the ViT's case: a heavy last layer (norm, head and loss) gets a stage of its own
    assert balance([1.0, 1.0, 1.0, 1.0, 1.0, 2.5], 3)[-1] == range(5, 6)


def test_freeze_schedule():
    """The formula against PipeTransformer's values and the project's schedule; the number of
    stages against the project's re-pipelining (training/repipelining.py) for two models, from 2
    and 4 stages, at every number of frozen blocks."""
    from distributed.pipeline import balanced_split
    from training.freezing import formula_frozen
    from training.repipelining import pipeline_layout, stage_items
    from utils.config import DEFAULT_YAML, load_config

    ex = exercise("freeze_schedule")
    got = [ex.frozen_after(12, 1 / 3, e) for e in range(8)]
    assert got[1] != 5, "12 x (1 - 2/3) is 4.000000000000001 in floating point: guard the ceil"
    assert got == [0, 4, 7, 9, 10, 11, 11, 12]
    for depth, alpha, epoch in [(4, 0.5, 3), (24, 0.25, 5), (8, 0.9, 9), (6, 1 / 3, 40)]:
        assert ex.frozen_after(depth, alpha, epoch) == formula_frozen(depth, alpha, epoch), (depth, alpha)
    for name, start in (("tiny", 2), ("tiny_deep", 2), ("tiny_deep", 4)):
        cfg = load_config(DEFAULT_YAML, name)
        for frozen in range(cfg.depth):
            stages = ex.stages_after(stage_items(cfg, frozen), stage_items(cfg, 0), start, balanced_split)
            assert stages == pipeline_layout(cfg, frozen, start)[0], (name, start, frozen)


def _best_plan_by_brute_force(module, times, activations, weights, workers, bandwidth) -> float:
    """Every contiguous split into at most ``workers`` stages and every way to give each stage at
    least one worker, all of them used: the smallest slowest part."""
    import itertools

    n, best = len(times), float("inf")
    for k in range(1, min(n, workers) + 1):
        for cuts in itertools.combinations(range(1, n), k - 1):
            bounds = (0, *cuts, n)
            links = [module.transfer_time(activations, c - 1, bandwidth) for c in cuts]
            for split in itertools.combinations(range(1, workers), k - 1):  # workers per stage
                counts = [b - a for a, b in zip((0, *split), (*split, workers))]
                stages = [module.stage_time(times, weights, a, b, r, bandwidth)
                          for (a, b), r in zip(zip(bounds, bounds[1:]), counts)]
                best = min(best, max(stages + links))
    return best


def test_pipedream_planner():
    """PipeDream's planner against a search of every plan, on 60 random models of 2 to 6 layers
    and 1 to 4 workers; the time it claims is its plan's; and the two extremes it must find."""
    module = exercise("pipedream_planner")
    rng = np.random.default_rng(0)
    for _ in range(60):
        n, workers = int(rng.integers(2, 7)), int(rng.integers(1, 5))
        times, activations, weights = (list(rng.uniform(0.1, 3.0, size=n)) for _ in range(3))
        bandwidth = float(rng.uniform(0.5, 8.0))
        claimed, stages = module.plan_pipeline(times, activations, weights, workers, bandwidth)
        assert [i for r, _ in stages for i in r] == list(range(n)), "contiguous, in order, all layers"
        assert sum(w for _, w in stages) == workers and all(w >= 1 for _, w in stages), stages
        actual = max([module.stage_time(times, weights, r.start, r.stop, w, bandwidth) for r, w in stages]
                     + [module.transfer_time(activations, r.stop - 1, bandwidth) for r, _ in stages[:-1]])
        assert claimed == pytest.approx(actual), "the time returned is not the plan's"
        best = _best_plan_by_brute_force(module, times, activations, weights, workers, bandwidth)
        assert claimed == pytest.approx(best), (times, activations, weights, workers, bandwidth, stages)
    # light weights, heavy activations: no boundary pays, replicate one stage (data parallelism)
    assert module.plan_pipeline([1.0] * 4, [100.0] * 4, [0.01] * 4, 4, 1.0)[1] == [(range(0, 4), 4)]
    # heavy weights, light activations: no replica pays, one layer per worker (a pipeline)
    assert module.plan_pipeline([1.0] * 4, [0.01] * 4, [100.0] * 4, 4, 1.0)[1] == [
        (range(i, i + 1), 1) for i in range(4)]


def test_lamb_trust():
    """One step of the project's LAMB (distributed/lamb.py) on tensors of different sizes, from
    the same weights and gradients: the exercise's update gives the same tensors. At the first
    step Adam's direction is g / (|g| + eps) (bias-corrected moments g and g**2)."""
    from distributed.lamb import Lamb

    update = exercise("lamb_trust").lamb_update
    torch.manual_seed(0)
    lr, wd, eps = 0.01, 0.1, 1e-6
    cases = [torch.randn(8, 4) * 3, torch.randn(16) * 0.01, torch.zeros(5)]  # the last: ||w|| = 0
    for w in cases:
        g = torch.randn_like(w)
        p = torch.nn.Parameter(w.clone())
        p.grad = g.clone()
        Lamb([p], lr=lr, eps=eps, weight_decay=wd).step()
        direction = g / (g.abs() + eps)
        u = direction + wd * w
        got = update(w.clone(), direction, lr, wd)
        assert got is not None, "lamb_update must return the new tensor"
        assert_close_with_hint(got, p.detach(), f"the step of a tensor of shape {tuple(w.shape)}", {
            "the trust ratio is ||w|| / ||u||, not ||u|| / ||w||": w - lr * (u.norm() / w.norm()) * u,
            "the weight decay term belongs in u (it is scaled by the trust ratio too)":
                w - lr * (w.norm() / direction.norm()) * direction - lr * wd * w,
            "without the trust ratio this is AdamW's step": w - lr * u,
        })


def test_onebit_compress():
    """The exercise's compression against distributed/onebit_adam.py's on random tensors, step
    after step with its error fed back; over 30 steps what was sent plus the error left is what
    came in (to fp32 rounding)."""
    from distributed.onebit_adam import compress

    step = exercise("onebit_compress").compress_with_feedback
    gen = torch.Generator().manual_seed(0)
    error = mine = torch.zeros(50)
    total_in, total_sent = torch.zeros(50), torch.zeros(50)
    for _ in range(30):
        x = torch.randn(50, generator=gen)
        got = step(x.clone(), mine.clone())
        assert got is not None and len(got) == 2, "return (sent, error)"
        signs, scale, error = compress(x + error, 50)
        want = torch.where(signs, scale, -scale)
        assert_close_with_hint(got[0], want, "what is sent", {
            "the error of the step before must be added first":
                torch.where(x >= 0, 1.0, -1.0) * x.norm() / 50 ** 0.5,
            "the scale is ||y|| / sqrt(n), the RMS, not the mean of |y|": torch.where(
                x + mine >= 0, 1.0, -1.0) * (x + mine).abs().mean(),
        })
        assert_close_with_hint(got[1], error, "the error kept", {"the error is y - sent": want - (x + mine)})
        mine = got[1]
        total_in += x
        total_sent += got[0]
    torch.testing.assert_close(total_sent + mine, total_in, rtol=1e-5, atol=1e-5)


def test_dispatch():
    """The exercise's plan against the one distributed/experts.py uses, on random assignments
    (4 and 8 experts over 2 and 4 ranks, some experts chosen by nobody)."""
    from distributed.experts import dispatch_plan

    plan = exercise("dispatch").dispatch_plan
    gen = torch.Generator().manual_seed(0)
    for num_experts, ep, n in [(4, 2, 30), (8, 4, 50), (8, 2, 3), (4, 4, 0)]:
        expert = torch.randint(0, num_experts, (n,), generator=gen)
        want_order, want_counts, want_splits = dispatch_plan(expert, num_experts, ep)
        order, counts, splits = plan(expert.clone(), num_experts, ep)
        assert torch.equal(counts, want_counts), f"counts per expert: got {counts.tolist()}"
        assert list(splits) == want_splits and all(isinstance(x, int) for x in splits), (
            f"send splits: got {splits}, want {want_splits} (expert e lives on rank e // (E / ep), "
            f"not e % ep)")
        assert torch.equal(expert[order], expert[want_order]), "order does not sort by expert"
        assert torch.equal(order, want_order), "within an expert keep token order: a stable sort"


def test_zero_memory():
    """The ZeRO paper's Figure 1 (Rajbhandari et al., 2020): 7.5B parameters, mixed-precision Adam
    (K = 12), 64 data-parallel ranks: 120, 31.4, 16.6 and 1.9 GB per device at stages 0-3; and one
    rank holds everything at every stage."""
    per_rank = exercise("zero_memory").zero_bytes_per_rank
    paper_gb = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    hints = {1: "stage 1 splits only the optimizer state (weights and gradients stay whole)",
             2: "stage 2 splits the gradients too, the weights stay whole",
             3: "stage 3 splits everything"}
    for stage, gb in paper_gb.items():
        got = per_rank(7_500_000_000, 64, stage)
        assert got is not None and set(got) == {"parameters", "gradients", "optimizer_state"}, \
            "return a dict with parameters, gradients and optimizer_state"
        total = sum(got.values()) / 1e9
        assert round(total, 1) == gb, f"stage {stage}: {total:.2f} GB per rank, the paper has {gb}. " \
            + hints.get(stage, "stage 0 holds 2 + 2 + 12 bytes per parameter")
    for stage in range(4):
        assert per_rank(1000, 1, stage, 4, 4, 8) == {"parameters": 4000, "gradients": 4000,
                                                     "optimizer_state": 8000}


def test_activation_memory():
    """One block's saved tensors, counted on the real block (networks/vit.py) for two sizes; with
    tensor parallelism, the cost model's count (tests/test_cost_model.py checks it against runs)."""
    from networks.vit import Block
    from scripts import cost_model as cm
    from scripts.cost_measure import ActivationMeter

    predict = exercise("activation_memory").block_activation_bytes
    for batch, tokens, dim, heads in ((2, 16, 32, 4), (3, 8, 64, 8)):
        block = Block(dim, heads, mlp_ratio=4.0, dropout=0.0)
        meter = ActivationMeter()
        x = torch.randn(batch, tokens, dim, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            block(x).sum().backward()
        got = predict(batch, tokens, dim, 4 * dim, heads)
        assert got == meter.peak, (
            f"batch {batch}, {tokens} tokens, D {dim}, {heads} heads: you predict {got} bytes, the block "
            f"keeps {meter.peak}" + (" (the layer norms keep 2 floats per token each)"
                                     if got + 16 * batch * tokens == meter.peak else ""))
    m = cm.Model(img=(32, 64), patch=4, c_in=20, c_out=20, dim=128, depth=4, heads=4)
    for tp in (2, 4):
        want = cm.activation_bytes(m, cm.Layout(tp, tp=tp, batch=8))["blocks"] // m.depth
        got = predict(8, m.tokens, m.dim, m.hidden, m.heads, tp=tp)
        assert got == want, f"tp {tp}: you predict {got} bytes per block, the cost model {want} " \
                            "(split only what lives between the column- and row-parallel layers)"
