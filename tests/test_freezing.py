"""Freezing layers as training goes (training/freezing.py, training/repipelining.py): the
schedules' values, what a frozen parameter leaves (the optimizer, the gradient sync: bytes
counted) and keeps (its value, to the bit), the activation cache against recomputation, the
pipeline that shrinks from pp 2 x dp 1 to pp 1 x dp 2 against the serial run that froze the
same blocks at the same steps, and a resume in the middle of a schedule.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
import torch

from distributed.pipeline import balanced_split
from networks.vit import build_vit
from tests.conftest import make_cfg
from tests.ddp_helpers import metrics, run, run_dir, train_args, write_test_yaml
from tests.dist_spawn import run_ranks
from tests.test_sharded import LOSS_RTOL, ok
from training.freezing import (
    ActivationCache,
    GradNormRule,
    formula_frozen,
    gradnorm_frozen,
    run_blocks,
    saved_freezing,
    steps_frozen,
)
from training.repipelining import pipeline_layout

pytestmark = pytest.mark.timeout(300)

MP = {"DDP_TEST_MODEL_PARALLEL": "1"}  # the worker runs as train_mp.py


# ----------------------------------------------------------------- the schedules ---
def test_the_formula_gives_pipetransformers_values():
    """L = 12, alpha = 1/3: 0, 4, 7, 9, 10, 11, 11, 12 blocks after epochs 0 .. 7 (the issue's and
    PipeTransformer's values); 1/2 freezes faster; never more than L."""
    assert [formula_frozen(12, 1 / 3, e) for e in range(8)] == [0, 4, 7, 9, 10, 11, 11, 12]
    assert [formula_frozen(12, 0.5, e) for e in range(6)] == [0, 6, 9, 11, 12, 12]
    assert formula_frozen(4, 1.0, 1) == 4 and formula_frozen(12, 1 / 3, 50) == 12
    assert [steps_frozen((2, 2, 5), s) for s in range(7)] == [0, 0, 2, 2, 2, 3, 3]


def test_the_gradient_test_freezes_the_blocks_before_the_first_moving_one():
    # relative changes of blocks 1 .. 4 (block 0 frozen): 0.1, 0.05, 0.5, 0.2; median 0.15:
    # block 3 is the first at or above it, so blocks 1 and 2 freeze
    before, now = [9.0, 1.0, 1.0, 1.0, 1.0], [9.0, 1.1, 0.95, 1.5, 1.2]
    assert gradnorm_frozen(before, now, 1) == 3
    assert gradnorm_frozen(before, [9.0, 2.0, 1.0, 1.0, 1.0], 1) == 1  # the first one moves most
    assert gradnorm_frozen(before, now, 5) == 5  # nothing active
    rule = GradNormRule()
    rule.add(torch.tensor(before))
    assert rule.decide(1) == 1  # the first interval has nothing to compare with
    rule.add(torch.tensor(now) / 2)
    rule.add(torch.tensor(now) / 2)  # an interval's norms add up over its steps
    saved = rule.state_dict()
    again = GradNormRule()
    again.load_state_dict(saved, torch.device("cpu"))
    assert again.decide(1) == 3 and rule.decide(1) == 3


def test_stages_are_balanced_and_the_pipeline_shrinks_when_the_active_blocks_fit(cfg_factory):
    rng = random.Random(0)
    for _ in range(30):  # the dynamic programme against every cut
        costs = [rng.uniform(0.1, 2) for _ in range(rng.randint(1, 7))]
        stages = rng.randint(1, len(costs))
        best = min(max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, len(costs))))
                   for cuts in itertools.combinations(range(1, len(costs)), stages - 1))
        got = balanced_split(costs, stages)
        assert [i for r in got for i in r] == list(range(len(costs))) and all(got)
        assert max(sum(costs[i] for i in r) for r in got) == pytest.approx(best)
    # the test model with 4 blocks on 2 stages: 1 or 2 frozen blocks re-cut the 2 stages (the
    # frozen prefix costs a sixth), 3 fit on one stage no costlier than the largest at the start
    cfg = cfg_factory(depth=4)
    assert pipeline_layout(cfg, 0, 2) == (2, [range(0, 2), range(2, 4)])
    assert pipeline_layout(cfg, 1, 2) == (2, [range(1, 3), range(3, 4)])
    assert pipeline_layout(cfg, 2, 2) == (2, [range(2, 3), range(3, 4)])
    assert pipeline_layout(cfg, 3, 2) == (1, [range(3, 4)])
    assert pipeline_layout(cfg, 4, 4)[0] == 1  # no active block: no stage but the head's


@pytest.mark.parametrize("flags, message", [
    ({"freeze_schedule": "steps"}, "--freeze_steps"),
    ({"freeze_schedule": "formula", "freeze_steps": (1,)}, "goes with --freeze_schedule steps"),
    ({"freeze_schedule": "steps", "freeze_steps": (3, 1)}, "in increasing order"),
    ({"freeze_schedule": "formula", "freeze_alpha": 0.0}, "freeze_alpha"),
    ({"freeze_schedule": "formula", "data_parallel": "fsdp"}, "does not combine with --data_parallel fsdp"),
    ({"freeze_schedule": "formula", "tensor_parallel": 2}, "tensor or context parallelism"),
    ({"freeze_schedule": "formula", "pipeline_parallel": 2, "pipeline_schedule": "zero_bubble", "depth": 4},
     "several stages per rank"),
    ({"freeze_schedule": "formula", "pipeline_parallel": 2, "pipeline_schedule": "async_1f1b"},
     "the async_1f1b schedule"),
    ({"freeze_schedule": "formula", "pipeline_parallel": 2, "local_batch_size": 2}, "power of two"),
    ({"freeze_schedule": "formula", "freeze_cache_mib": 1.0, "dropout": 0.1}, "exact only without dropout"),
    ({"freeze_schedule": "gradnorm", "amp_mode": "fp16"}, "scaled gradients"),
])
def test_freezing_refuses_what_it_cannot_run(flags, message, data_dir, tmp_path):
    with pytest.raises(ValueError, match=message):
        make_cfg(data_dir, tmp_path, **flags)


def test_graph_steps_refuse_freezing(cfg_factory):
    from training.graphs import GraphStep
    from training.launcher import step_for

    with pytest.raises(ValueError, match="use train.py or train_mp.py"):
        step_for(cfg_factory(freeze_schedule="formula"), GraphStep)


# ------------------------------------------------------------------- the cache ---
def test_the_cache_equals_recomputation_also_after_an_extension(cfg_factory):
    """Kept outputs, outputs extended through newly frozen blocks from the kept ones, and
    recomputed ones are torch.equal to the frozen blocks run on the batch from its input; the
    budget keeps what fits and recomputes the rest."""
    cfg = cfg_factory(depth=4)
    vit = build_vit(cfg).eval()
    images = torch.randn(12, cfg.n_in_channels, *cfg.img_size)
    row_bytes = vit.num_tokens * cfg.embed_dim * 4
    cache = ActivationCache(budget_mib=6 * row_bytes / 2**20)  # room for 6 samples
    calls = []  # (samples, first block, last block + 1) of every run of frozen blocks

    def run(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        calls.append((x.shape[0], start, stop))
        return run_blocks(vit, x, start, stop)

    with torch.no_grad():
        def check(keys: list[int], frozen: int) -> None:
            got = cache.tokens(keys, images[keys], frozen, run)
            assert torch.equal(got, run_blocks(vit, images[keys], 0, frozen)), (keys, frozen)

        check([0, 1, 2, 3, 4, 5, 6, 7], 1)  # all computed; the first 6 kept
        assert cache.report()["cache_missed_rate"] == 1.0 and len(cache.entries) == 6
        check([5, 6, 1, 9], 1)  # 5 and 1 kept
        assert cache.report()["cache_hit_rate"] == 0.5
        calls.clear()
        check([3, 0, 8, 2, 4], 3)  # extended from block 1 through blocks 1 and 2 (8: computed)
        assert sorted(calls) == [(1, 0, 3), (4, 1, 3)]  # the kept four from their kept output
        report = cache.report()
        assert report["cache_extended_rate"] == 0.8 and report["cache_MiB"] == 6 * row_bytes / 2**20
        assert cache.entries[3][0] == 3 and cache.entries[5][0] == 1  # 5 is extended when it comes
        check([5, 3, 11], 3)
        assert cache.report() == {"cache_hit_rate": 1 / 3, "cache_extended_rate": 1 / 3,
                                  "cache_missed_rate": 1 / 3, "cache_MiB": 6 * row_bytes / 2**20}


def test_batches_name_their_samples(cfg_factory):
    """The cache's key: the loader's batch rows are the samples it names, in a shuffled epoch
    and from the middle of one (a resumed run)."""
    from utils.data_loader import Batches, get_data_loader

    cfg = cfg_factory(limit_nsamples=24)
    loader, dataset, sampler = get_data_loader(cfg, "train", 4, train=True)
    batches = Batches(loader, sampler)
    for epoch, start in ((0, 0), (1, 2)):
        batches.set_epoch(epoch, start)
        seen = 0
        for inp, tar in batches:
            rows = [dataset[i] for i in batches.last_indices]
            assert torch.equal(inp, torch.stack([r[0] for r in rows]))
            assert torch.equal(tar, torch.stack([r[1] for r in rows]))
            seen += 1
        assert seen == 6 - start


def test_the_cost_model_predicts_a_freezing_steps_flops_and_the_caches_size(cfg_factory, tmp_path):
    """FlopCounterMode around the real freezing step (attention by the math kernel, whose
    matmuls it sees), for every number of frozen blocks: the first step on a batch computes the
    frozen prefix forward only, the second finds it in the cache; the cache then holds what the
    cost model says a sample takes."""
    from torch.utils.flop_counter import FlopCounterMode

    import scripts.cost_model as cm
    from training.context import RunContext
    from training.freezing import FreezingStep
    from training.trainer import Trainer

    cfg = cfg_factory(depth=3, freeze_schedule="steps", freeze_steps=(1000,), freeze_cache_mib=1.0,
                      attention_kernel="math", limit_nsamples=4)  # (frozen by hand below)
    m = cm.Model.from_config(cfg)
    for frozen in range(cfg.depth + 1):
        trainer = Trainer(cfg, RunContext(device=torch.device("cpu"), run_dir=tmp_path / str(frozen)), 4,
                          step=FreezingStep)
        trainer.variant.freeze(frozen, 0)
        inp, tar = next(iter(trainer.train_data))
        for cached in (False, True):
            with FlopCounterMode(display=False) as counter:
                trainer.train_step(inp, tar)
            predicted = cm.freezing_flops(m, 4, frozen, cached=cached and frozen > 0)["total"]
            assert counter.get_total_flops() == predicted, (frozen, cached)
        if frozen:
            assert trainer.variant.cache.used == cm.cache_bytes(m, 4)


def test_random_blocks_freeze_in_the_drawn_order_and_keep_their_bits(cfg_factory, tmp_path):
    """The control: the blocks of the seed's permutation freeze (with the embedding), in the
    middle of the model too; the full model runs (autograd through the frozen blocks for the
    active ones before them) and the frozen weights do not move."""
    from training.context import RunContext
    from training.freezing import FreezingStep, freeze_order
    from training.trainer import Trainer

    cfg = cfg_factory(depth=4, seed=1, freeze_schedule="steps", freeze_steps=(0, 0), freeze_order="random",
                      limit_nsamples=8)
    order = freeze_order(cfg)
    assert sorted(order) == [0, 1, 2, 3] and order[:2] != [0, 1]  # seed 1: blocks 1 and 3 first
    trainer = Trainer(cfg, RunContext(device=torch.device("cpu"), run_dir=tmp_path), 4, step=FreezingStep)
    trainer.variant.run_started()  # what the schedule freezes from step 0
    frozen = {n: p.detach().clone() for n, p in trainer.raw_model.named_parameters() if not p.requires_grad}
    assert {n.split(".")[1] for n in frozen if n.startswith("blocks.")} == {str(b) for b in order[:2]}
    assert any(n.startswith("patch_embed") for n in frozen)
    active = trainer.raw_model.blocks[str(min(b for b in range(4) if b not in order[:2]))].mlp.fc1.weight
    before = active.detach().clone()
    inp, tar = next(iter(trainer.train_data))
    for _ in range(2):
        trainer.train_step(inp, tar)
    assert all(torch.equal(p, frozen[n]) for n, p in trainer.raw_model.named_parameters() if n in frozen)
    assert not torch.equal(active, before)  # an active block before a frozen one trained


def _block_norms_under_ddp() -> None:
    from types import SimpleNamespace

    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from training.freezing import Freezing

    model = nn.Module()
    model.blocks = nn.ModuleDict({"0": nn.Linear(2, 2), "1": nn.Linear(2, 2)})
    model.blocks["1"](model.blocks["0"](torch.ones(1, 2))).sum().backward()
    cfg = SimpleNamespace(model=SimpleNamespace(depth=2, backbone="vit"))
    parts = SimpleNamespace(cfg=cfg, device=torch.device("cpu"), model=DistributedDataParallel(model))
    norms = Freezing.block_norms(SimpleNamespace(parts=parts))
    assert (norms > 0).all(), norms


@pytest.mark.timeout(120)
def test_the_gradient_rule_reads_the_blocks_under_ddp():
    """DDP's parameter names start with "module.": the rule reads the model inside it, or every
    block's norm is 0 and nothing ever freezes."""
    run_ranks(1, _block_norms_under_ddp)


# -------------------------------- what a frozen parameter keeps and leaves (2 ranks) ---
def _frozen_on_ranks(cfg, run_dir_path: Path, out_dir: Path) -> None:
    """DDP on 2 ranks, block 0 and the embedding frozen at step 1, block 1 at step 2: per step,
    the bytes DDP's all-reduce sent (counted as the collectives run) and whether the frozen
    blocks ran with autograd; the frozen weights as they were when they froze, and at the end."""
    import torch.distributed as dist

    from distributed.mesh import build_mesh
    from scripts.instruments import CollectiveCounter, count_ddp_gradients
    from training.context import Callback, RunContext
    from training.freezing import FreezingStep
    from training.trainer import Trainer

    counter = CollectiveCounter().install()
    grad_modes: list[bool] = []

    class Watch(Callback):
        def __init__(self) -> None:
            self.counted, self.sent, self.trainable, self.snapshots = None, [], [], {}
            self.counting = None

        def step_start(self, trainer) -> None:
            if trainer.model is not self.counted:  # DDP is rebuilt as blocks freeze: count the new one
                assert count_ddp_gradients(trainer.model, trainer.ctx.dp_group)
                self.counted = trainer.model
            params = trainer.raw_model.parameters()
            self.trainable.append(sum(4 * p.numel() for p in params if p.requires_grad))
            self.counting = counter.counting(reset=True)
            self.counting.__enter__()

        def step_end(self, trainer, loss):
            self.counting.__exit__(None, None, None)
            self.sent.append(counter.bytes.get("all_reduce", 0))
            params = dict(trainer.raw_model.named_parameters())
            for name, p in params.items():
                if not p.requires_grad and name not in self.snapshots:
                    self.snapshots[name] = p.detach().clone()
            held = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
            for name, p in params.items():  # the optimizer holds exactly the trainable ones
                assert (id(p) in held) == p.requires_grad, name
                assert p.requires_grad or p not in trainer.optimizer.state, name
            return None

    watch = Watch()
    mesh = build_mesh({}, cfg.parallel_order, "cpu")
    ctx = RunContext(device=torch.device("cpu"), run_dir=run_dir_path, rank=dist.get_rank(), world_size=2,
                     mesh=mesh)
    trainer = Trainer(cfg, ctx, cfg.global_batch_size // 2, step=FreezingStep, callbacks=[watch])
    trainer.raw_model.blocks["0"].register_forward_pre_hook(
        lambda module, args: grad_modes.append(torch.is_grad_enabled()))
    trainer.fit()
    unchanged = all(torch.equal(p, watch.snapshots[name]) for name, p in trainer.raw_model.named_parameters()
                    if name in watch.snapshots)
    result = {"sent": watch.sent, "trainable": watch.trainable, "frozen": sorted(watch.snapshots),
              "unchanged": unchanged, "grad_modes": grad_modes}
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))


def test_frozen_weights_keep_their_bits_and_leave_the_optimizer_and_the_gradient_sync(cfg_factory,
                                                                                       tmp_path):
    cfg = cfg_factory(freeze_schedule="steps", freeze_steps=(1, 2), num_iters=4, global_batch_size=4,
                      limit_nsamples=16, limit_nsamples_val=4, freeze_cache_mib=1.0)
    run_ranks(2, _frozen_on_ranks, cfg, tmp_path / "run", tmp_path)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0] == results[1]
    result = results[0]
    vit = build_vit(cfg)
    block, total = (sum(4 * p.numel() for p in m.parameters()) for m in (vit.blocks["0"], vit))
    embedding = 4 * (vit.pos_embed.numel() + sum(p.numel() for p in vit.patch_embed.parameters()))
    # every trainable gradient once per step (DDP's buckets, counted as they were all-reduced)
    assert result["trainable"] == [total, total - embedding - block, total - embedding - 2 * block,
                                   total - embedding - 2 * block]
    assert result["sent"] == result["trainable"]
    assert result["frozen"] == sorted(n for n, _ in vit.named_parameters()
                                      if n.startswith(("pos_embed", "patch_embed", "blocks.0.", "blocks.1.")))
    assert result["unchanged"]
    # block 0 ran with autograd in step 0 only; then without (train steps; validation has none)
    assert result["grad_modes"][0] and not any(result["grad_modes"][1:])


# ------------------------------------------------------------ runs, as users start them ---
COMMON = {"limit_nsamples_val": 33}


@pytest.fixture(scope="module")
def test_yaml(tmp_path_factory) -> Path:
    """The test model with 4 blocks (2 pipeline stages of 2 blocks)."""
    path = write_test_yaml(tmp_path_factory.mktemp("freezing_yaml") / "ViT.yaml", depth=4)
    return path


def args(yaml: Path, data_dir: Path, expdir: Path, **extra) -> list[str]:
    values = {**COMMON, **extra}
    steps = values.pop("freeze_steps", None)
    out = train_args(yaml, data_dir, expdir, **values)
    return out + (["--freeze_steps", *map(str, steps)] if steps else [])


# one step per epoch (8 samples, global batch 8): every step's loss is in metrics.jsonl; block
# 0 and 1 freeze at step 2, block 2 at step 4; the cache serves the frozen prefix from epoch 2 on.
# A constant learning rate: a run extended from 6 to 8 steps takes the 8-step run's steps
SHRINK = {"limit_nsamples": 8, "freeze_schedule": "steps", "freeze_steps": (2, 2, 4),
          "freeze_cache_mib": 1.0, "lr_schedule": "constant"}


def test_a_pipeline_that_shrinks_logs_the_serial_losses(data_dir, test_yaml, tmp_path):
    """pp 2 x dp 1: at step 2 the stages are re-cut (frozen embedding and blocks 0-1 before the
    schedule, block 2 | block 3 + head); at step 4 block 3 alone fits one stage: the two ranks
    continue as pp 1 x dp 2. Every step's loss is the serial run's with the same freezing, to
    fp32 rounding (rtol 1e-5: the pipeline's micro-batch means and DDP's all-reduce sum in
    another order); the frozen blocks of each step are the same. The same command run again
    for 2 more steps (as a job resubmitted) builds its 2 stages, finds its checkpoint past
    them and goes on at pp 1 x dp 2. The callbacks' fit_end comes once, when the run is over."""
    ok(run(1, args(test_yaml, data_dir, tmp_path / "serial", **SHRINK, num_iters=8)))
    serial = metrics(run_dir(tmp_path / "serial", 1))
    ends = tmp_path / "fit_end"  # callbacks hear of the run's end once, not at each layout change
    result = run(2, args(test_yaml, data_dir, tmp_path, pipeline_parallel=2, **SHRINK), timeout=240, **MP,
                 DDP_TEST_FIT_END=str(ends))
    ok(result)
    assert sorted(ends.read_text().splitlines()) == ["rank 0 step 6", "rank 1 step 6"]
    log = result.stdout + result.stderr
    assert "step 2: the run continues with pipeline_parallel 2" in log
    assert "(frozen, without autograd: embedding + blocks 0-1) + block 2; stage 1" in log
    assert "step 4: the run continues with pipeline_parallel 1" in log
    assert "dp 0/2 of [0, 1], pp 0/1" in log  # the mesh of the new layout
    again = run(2, args(test_yaml, data_dir, tmp_path, pipeline_parallel=2, **SHRINK, num_iters=8),
                timeout=240, **MP)
    ok(again)
    assert "step 6: the run continues with pipeline_parallel 1" in again.stdout + again.stderr
    shrunk = metrics(tmp_path / "tiny" / "2GPU_tp1_cp1_dp1_pp2" / "00")
    assert [m["step"] for m in shrunk] == [m["step"] for m in serial] == list(range(1, 9))
    assert [m["frozen_blocks"] for m in shrunk] == [m["frozen_blocks"] for m in serial] == \
        [[0], [0], [2], [2], [3], [3], [3], [3]]
    assert [m["pipeline_stages"][0] for m in shrunk] == [[[0, 2], [2, 4]]] * 2 + [[[2, 3], [3, 4]]] * 2 + \
        [[[3, 4]]] * 4  # each stage's active blocks [start, stop), at each step (one per epoch)
    for a, b in zip(serial, shrunk):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=LOSS_RTOL), a["step"]
        assert b["val_loss"] == pytest.approx(a["val_loss"], rel=LOSS_RTOL), a["step"]
    assert serial[-1]["cache_hit_rate"] == 1.0 and serial[4]["cache_extended_rate"] == 1.0


RESUMED = {  # name: (flags, checkpoint step); 6 steps, 2 epochs of 3 (24 samples, batch 8)
    # blocks 0-1 from epoch 2 (step 3) on, the cache filled in epoch 1 and extended in epoch 2; the
    # checkpoint in the middle of epoch 1
    "formula_cache": ({"freeze_schedule": "formula", "freeze_alpha": 0.5, "freeze_every": 3,
                       "freeze_cache_mib": 1.0}, 2),
    # intervals of 2 steps: a decision after steps 1, 3 and 5 from the norms summed over each; the
    # checkpoint in the middle of the second interval. Whether a decision freezes a block here
    # turns on rounding (torch 2.8 and 2.13 decide otherwise from the same seed), so the rule's
    # whole history (each interval's norms) is compared, not only what it froze
    "gradnorm": ({"freeze_schedule": "gradnorm", "freeze_every": 2}, 3),
}


@pytest.mark.parametrize("name", RESUMED)
def test_a_run_resumes_exactly_in_the_middle_of_its_schedule(name, data_dir, test_yaml, tmp_path):
    """A checkpoint in the middle of the schedule, a failure at the next step, the same command
    again: every logged number equals the uninterrupted run's, bit for bit (one process, the
    same kernels), the frozen blocks of each step included, and so does the schedule's state in
    the last checkpoint (the gradient test's norms of every interval)."""
    flags, at = RESUMED[name]
    flags = {"limit_nsamples": 24, **flags}
    ok(run(1, args(test_yaml, data_dir, tmp_path / "whole", **flags)))
    whole = metrics(run_dir(tmp_path / "whole", 1))
    broken = args(test_yaml, data_dir, tmp_path / "resumed", checkpoint_every=at, **flags)
    assert run(1, broken, DDP_TEST_RAISE_AT=f"0:{at + 1}").returncode != 0
    ok(run(1, broken))
    resumed = metrics(run_dir(tmp_path / "resumed", 1))
    keys = ("step", "train_loss", "val_loss", "rmse", "frozen_blocks")
    assert [{k: m[k] for k in keys} for m in resumed] == [{k: m[k] for k in keys} for m in whole]
    states = [saved_freezing(run_dir(tmp_path / d, 1)) for d in ("whole", "resumed")]
    assert states[0] == states[1]
    if name == "gradnorm":
        assert len(states[0]["gradnorm"]["history"]) == 3, states[0]  # one interval spans the resume
    else:
        assert any(k for m in whole for k in m["frozen_blocks"]), "the schedule froze nothing: no test"


def _next_mesh() -> None:
    import torch.distributed as dist

    from distributed import mesh as meshes

    mesh = meshes.build_mesh({"pp": 2}, "tp-cp-dp", "cpu")
    destroyed, real = [], (dist.get_backend, dist.destroy_process_group)
    dist.get_backend = lambda group: "nccl"  # as on GPUs
    dist.destroy_process_group = destroyed.append
    try:
        new = meshes.next_mesh(mesh, {"tp": 1, "cp": 1, "pp": 1}, "tp-cp-dp", "cpu")
    finally:
        dist.get_backend, dist.destroy_process_group = real
    assert new is not mesh and new.size("dp") == 2 and new.size("pp") == 1
    old = {id(g) for g in mesh.groups.values() if g is not None}
    assert len(destroyed) == len(old) and {id(g) for g in destroyed} == old


@pytest.mark.timeout(120)
def test_a_layout_change_releases_the_groups_it_leaves():
    """Freezing re-cuts the pipeline and may shrink it: the new layout gets new groups, and the old
    NCCL groups (communicators with GPU buffers) are destroyed, not leaked (gloo's: shown as NCCL)."""
    run_ranks(2, _next_mesh)
