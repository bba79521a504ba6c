"""The asynchronous pipeline (distributed/async_pipeline.py, ``--pipeline_schedule async_1f1b``)
against the update rules it implements.

In one process (the stages' messages through queues): a stashed backward is autograd's gradient
at the weights its forward used, not at the newest; four stages in each mode give the version
counts of the update rules (stash: p - s per stage; 2BW: 2) and the weights of a one-process
reference that computes each step's gradient at the weight versions the mode names. Through
train_mp.py on 2 gloo ranks: the stashed schedule reproduces that reference (SGD with each
stage's update delayed by p - 1 - s steps), and a checkpoint drains the pipeline and resumes
exactly.
"""

from __future__ import annotations

import copy
import random
import shutil
from collections import deque
from pathlib import Path

import pytest
import torch
from torch.func import functional_call

from distributed.async_pipeline import StageEngine
from distributed.pipeline import split_blocks
from networks.vit import build_vit
from tests.conftest import make_cfg
from tests.ddp_helpers import metrics, run, train_args, write_test_yaml
from tests.test_sharded import ok
from utils.checkpoint import CHECKPOINT_NAME
from utils.data_loader import get_data_loader
from utils.metrics import relative_l2_loss

pytestmark = pytest.mark.timeout(300)

LR = 10.0  # SGD without momentum: each update is the gradient times the rate, nothing carried; the loss's
# gradients are about 1e-3 here: a large rate moves the weights enough to tell the versions apart


# --------------------------------------------------------- stages in one process ---
class QueueLinks:
    """A stage's messages through queues shared by the stages of one process."""

    def __init__(self, queues: dict, stage: int) -> None:
        self.queues, self.stage = queues, stage

    def exchange(self, out, shape):
        if out is not None:
            self.queues["F", self.stage + 1].append(out.detach().clone())
        return None if shape is None else self.queues["B", self.stage].popleft()

    def recv_activation(self, shape):
        return self.queues["F", self.stage].popleft()

    def send_gradient(self, grad):
        self.queues["B", self.stage - 1].append(grad.detach().clone())

    def release(self):
        pass

    def flush(self):
        pass


def stages_of(model, n_stages: int) -> list:
    """The serial model cut as distributed/pipeline.py cuts it, each stage a copy."""
    ranges = split_blocks(len(model.blocks), n_stages)
    return [copy.deepcopy(model).cut(r, s == 0, s == n_stages - 1) for s, r in enumerate(ranges)]


def sgd_update(module):
    def update():
        with torch.no_grad():
            for p in module.parameters():
                p -= LR * p.grad
                p.grad = None
    return update


def simulate(model, n_stages: int, mode: str, m: int, batches, drains=()) -> list[StageEngine]:
    """The asynchronous pipeline's stages in one process, each step micro-batch by micro-batch
    (every stage's forward and backward of micro-batch j before micro-batch j + 1's: the order in
    which the ranks' messages arrive); a drain after the steps in ``drains`` and at the end."""
    queues = {(k, s): deque() for k in "FB" for s in range(n_stages)}
    engines = [StageEngine(stage, s, n_stages, mode, m, relative_l2_loss, QueueLinks(queues, s),
                           sgd_update(stage)) for s, stage in enumerate(stages_of(model, n_stages))]
    for n, (inp, tar) in enumerate(batches):
        if n in drains:
            for e in reversed(engines):  # the last stage first: each drain's gradients come from the next
                e.drain()
        for e in engines:
            e.begin_step((inp.shape[0] // m, *model.unit_shape))
        for j, (x, y) in enumerate(zip(inp.chunk(m), tar.chunk(m))):
            for e in engines:
                e.micro_batch(x if e.first else None, y if e.last else None, j, m)
    for e in reversed(engines):
        e.drain()
    return engines


def reference(model, n_stages: int, delays: list[int], batches, drains=(),
              losses: list | None = None) -> dict[str, torch.Tensor]:
    """SGD in which step n's gradient is computed with each stage s's weights as they were after
    max(n - delays[s], last drain) updates, and every stage applies it as its update n + 1 (each
    step's loss at those weights appended to ``losses``)."""
    stage_of = {name: s for s, stage in enumerate(stages_of(model, n_stages))
                for name, _ in stage.named_parameters()}
    history = [{n: p.detach().clone() for n, p in model.named_parameters()}]
    base = 0
    for n, (inp, tar) in enumerate(batches):
        base = n if n in drains else base
        weights = {name: history[max(base, n - delays[stage_of[name]])][name].detach().requires_grad_()
                   for name in stage_of}
        loss = relative_l2_loss(functional_call(model, weights, (inp,)), tar)
        grads = torch.autograd.grad(loss, list(weights.values()))
        if losses is not None:
            losses.append(loss.item())
        history.append({name: history[-1][name].detach() - LR * g for name, g in zip(weights, grads)})
    return history[-1]


def final_weights(engines) -> dict[str, torch.Tensor]:
    return {n: p.detach() for e in engines for n, p in e.module.named_parameters()}


@pytest.fixture(scope="module")
def vit_and_batches(data_dir, tmp_path_factory):
    cfg = make_cfg(data_dir, tmp_path_factory.mktemp("async_cfg"), depth=4)
    model = build_vit(cfg.model)
    model.reset_parameters(torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 20, 16, 32, generator=gen), torch.randn(6, 20, 16, 32, generator=gen))
               for _ in range(10)]
    return model, batches


def test_a_stashed_backward_is_autograd_at_the_weights_its_forward_used(vit_and_batches):
    """The first of 2 stages (one micro-batch in flight beyond the newest): micro-batch 1's
    forward runs before micro-batch 0's update, its backward after it. With stashing its gradient
    is autograd's at the weights of its forward (version 0); without, at the newest (version 1)."""
    model, batches = vit_and_batches
    inputs = [x for x, _ in batches[:3]]
    width = model.pos_embed.shape[-1]
    out_grads = [torch.randn(6, model.num_tokens, width, generator=torch.Generator().manual_seed(i))
                 for i in range(3)]

    def run_stage(mode):
        stage = stages_of(model, 2)[0]
        versions, grads = [{n: p.detach().clone() for n, p in stage.named_parameters()}], []
        links = QueueLinks({("F", 1): deque(), ("B", 0): deque(out_grads)}, 0)

        def update():
            grads.append({n: p.grad.clone() for n, p in stage.named_parameters()})
            sgd_update(stage)()
            versions.append({n: p.detach().clone() for n, p in stage.named_parameters()})

        engine = StageEngine(stage, 0, 2, mode, 1, relative_l2_loss, links, update)
        for x in inputs:
            engine.step([x], [None], (6, *model.unit_shape))
        assert engine.version == 2 and engine.most_versions == (2 if mode == "stash" else 1)
        return stage, versions, grads

    def autograd_at(stage, weights, x, g):
        leaves = {n: w.clone().requires_grad_() for n, w in weights.items()}
        out = functional_call(stage, leaves, (x,))
        return dict(zip(leaves, torch.autograd.grad(out, list(leaves.values()), g)))

    stage, versions, stashed = run_stage("stash")
    at_forward = autograd_at(stage, versions[0], inputs[1], out_grads[1])
    at_newest = autograd_at(stage, versions[1], inputs[1], out_grads[1])
    for name in at_forward:
        torch.testing.assert_close(stashed[1][name], at_forward[name], rtol=0, atol=0)
    assert any(not torch.allclose(stashed[1][n], at_newest[n], rtol=1e-3) for n in at_newest)
    _, _, newest = run_stage("none")
    for name in at_newest:
        torch.testing.assert_close(newest[1][name], at_newest[name], rtol=0, atol=0)


# mode: (micro-batches per step, each stage's delay in the reference, versions held per stage)
RULES = {
    "stash": (1, [3, 2, 1, 0], [4, 3, 2, 1]),  # stage s: p - 1 - s updates late, p - s versions
    "vertical": (1, [3, 3, 3, 3], [4, 4, 4, 4]),  # the first stage's version everywhere: p - 1 late
    "2bw": (3, [1, 1, 1, 1], [2, 2, 2, 2]),  # W(n + 1) = W(n) - lr grad f(W(n - 1)), m >= p - 1
}


@pytest.mark.parametrize("mode", RULES)
def test_four_stages_follow_their_update_rule(mode, vit_and_batches):
    """4 stages, 10 steps, a drain after step 6 (as a checkpoint does) and at the end: the weights
    of the reference that computes each step's gradient at the versions the mode names (the
    same operations in the same order with one micro-batch per step: equal to the bit; 2BW sums 3
    micro-batches' gradients where the reference has one batch: within fp32 rounding), and the
    versions each stage held at most."""
    model, batches = vit_and_batches
    m, delays, versions = RULES[mode]
    engines = simulate(model, 4, mode, m, batches, drains={7})
    want = reference(model, 4, delays, batches, drains={7})
    got = final_weights(engines)
    tolerance = {"rtol": 0, "atol": 0} if m == 1 else {"rtol": 1e-5, "atol": 1e-6}
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tolerance)
    assert [e.most_versions for e in engines] == versions
    assert all(not e.stash and not e.flights for e in engines)  # drained: one version, nothing in flight


def test_without_stashing_the_weights_are_another_rule(vit_and_batches):
    """No stashing keeps one version per stage and its backward is not the forward's gradient:
    its weights are neither stashing's nor synchronous SGD's."""
    model, batches = vit_and_batches
    engines = simulate(model, 4, "none", 1, batches)
    assert [e.most_versions for e in engines] == [1, 1, 1, 1]
    got = final_weights(engines)
    for delays in ([3, 2, 1, 0], [0, 0, 0, 0]):  # stashing's rule is met to the bit (above)
        want = reference(model, 4, delays, batches)
        assert max((got[n] - want[n]).abs().max() for n in want) > 1e-5


@pytest.mark.parametrize("flags, message", [
    ({"dropout": 0.1}, "does not run --dropout 0.1"),
    ({"grad_clip_norm": 1.0}, "does not run --grad_clip_norm"),
    ({"enable_jit": True}, "does not run --enable_jit"),
    ({"activation_checkpointing": "full"}, "already recomputes"),
    ({"tensor_parallel": 2}, "does not run --tensor_parallel"),
    ({"weight_stashing": "2bw", "pipeline_parallel": 4, "num_microbatches": 2}, "num_microbatches 2 < 3"),
    ({"checkpoint_every": 30}, "checkpoint only where it drains, every --async_drain_every 100"),
])
def test_what_the_asynchronous_schedule_refuses(flags, message, data_dir, tmp_path):
    flags = {"pipeline_parallel": 2, **flags}
    with pytest.raises(ValueError, match=message):
        make_cfg(data_dir, tmp_path, depth=4, pipeline_schedule="async_1f1b", **flags)


def test_the_loss_is_shared_before_the_loop_reads_it():
    """The steps after which the loop reads its loss sum: epoch ends (every 5 steps here), the
    drains (every 4: the only places for a checkpoint or a stop), the stop agreement's reads (a
    step after each of its questions, every 10) and the last (12); a checkpoint with a loss still
    unshared, or where the pipeline did not drain, is refused."""
    from types import SimpleNamespace

    from training.async_pipeline import AsyncPipelineState, AsyncPipelineStep

    cfg = SimpleNamespace(run=SimpleNamespace(stop_check_every=10), optim=SimpleNamespace(num_iters=12),
                          layout=SimpleNamespace(async_drain_every=4))
    step = AsyncPipelineStep(SimpleNamespace(cfg=cfg, train_data=SimpleNamespace(batches_per_epoch=5)))
    assert [d for d in range(1, 13) if step.loss_read_after(d)] == [1, 4, 5, 8, 10, 11, 12]
    assert [d for d in range(1, 13) if step.may_stop_after(d)] == [4, 8, 12]
    parts = SimpleNamespace(model=SimpleNamespace(unshared=[object()]))
    with pytest.raises(RuntimeError, match="not shared"):
        AsyncPipelineState(SimpleNamespace(parts=parts)).state_dict()
    parts = SimpleNamespace(step=5, model=SimpleNamespace(unshared=[], engine=SimpleNamespace(flights=[1])))
    with pytest.raises(RuntimeError, match="does not drain"):
        AsyncPipelineState(SimpleNamespace(parts=parts)).state_dict()


def test_one_pipeline_only():
    from types import SimpleNamespace

    from training.async_pipeline import AsyncPipelineStep

    ctx = SimpleNamespace(mesh=SimpleNamespace(dp_size=2))
    cfg = SimpleNamespace(memory=SimpleNamespace(grad_accum_steps=1),
                          layout=SimpleNamespace(num_microbatches=1, pipeline_parallel=2))
    with pytest.raises(ValueError, match="one pipeline here, not 2"):
        AsyncPipelineStep.check(cfg, ctx, 8)


# ------------------------------------------------------------- 2 ranks, train_mp.py ---
MP = {"DDP_TEST_MODEL_PARALLEL": "1"}
STASHED = {"pipeline_parallel": 2, "pipeline_schedule": "async_1f1b", "weight_stashing": "stash",
           "num_microbatches": 1, "optimizer_type": "SGD", "momentum": 0.0, "lr": LR,
           "lr_schedule": "constant", "limit_nsamples": 16, "limit_nsamples_val": 8, "checkpoint_every": 3,
           "async_drain_every": 3}


@pytest.fixture(scope="module")
def deep_yaml(tmp_path_factory) -> Path:
    path = write_test_yaml(tmp_path_factory.mktemp("async_yaml") / "ViT.yaml", depth=4)
    return path


def pp2_run(data_dir, yaml, expdir, **env) -> Path:
    result = run(2, train_args(yaml, data_dir, expdir, **STASHED), timeout=240, **MP, **env)
    if env:  # a failure injected
        assert result.returncode != 0
    else:
        ok(result)
    return expdir / "tiny" / "2GPU_tp1_cp1_dp1_pp2" / "00"


@pytest.fixture(scope="module")
def stashed_run(data_dir, deep_yaml, tmp_path_factory) -> Path:
    """6 steps of 8 samples on 2 stages, one micro-batch per step, a checkpoint (a drain) at
    step 3 and at the end."""
    return pp2_run(data_dir, deep_yaml, tmp_path_factory.mktemp("stashed"))


def test_two_ranks_reproduce_sgd_with_each_stage_delayed(stashed_run, data_dir, tmp_path):
    """The 2-rank run against :func:`reference` with delays p - 1 - s = (1, 0), drained at step
    3, on the same batches: weights and each epoch's loss within fp32 rounding (the stages share
    each step's loss without waiting, and the loop's sum after steps 1, 2, 3, 4 and 6: step 5's
    comes with step 6's). The ranks' matmuls may block
    and sum in another order than this process's (a stage's slice of the model, a thread of its
    own); each step's differences are then a few ulps of the weights, and 6 steps of SGD at
    rate 0.05 keep them below 1e-6 here. A rule off by one update differs by 1e-3 or more."""
    cfg = make_cfg(data_dir, tmp_path, depth=4, global_batch_size=8, limit_nsamples=16)
    model = build_vit(cfg.model)
    model.reset_parameters(torch.Generator().manual_seed(cfg.seed))
    loader, _, sampler = get_data_loader(cfg, "train", 8, train=True)
    batches = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        batches += [(x.clone(), y.clone()) for x, y in loader]
    got = torch.load(stashed_run / CHECKPOINT_NAME, weights_only=False)["model"]
    losses: list[float] = []
    want = reference(model, 2, [1, 0], batches, drains={3}, losses=losses)
    epochs = [sum(losses[i: i + 2]) / 2 for i in (0, 2, 4)]
    assert [m["train_loss"] for m in metrics(stashed_run)] == pytest.approx(epochs, rel=1e-5)
    print("largest difference to the reference", max((got[n] - want[n]).abs().max() for n in got))
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)
    synchronous = reference(model, 2, [0, 0], batches)
    print("largest difference to synchronous SGD", max((got[n] - synchronous[n]).abs().max() for n in got))
    assert max((got[n] - synchronous[n]).abs().max() for n in got) > 1e-3
    assert [m["step"] for m in metrics(stashed_run)] == [2, 4, 6]


def test_a_checkpoint_drains_and_resumes_exactly(stashed_run, data_dir, deep_yaml, tmp_path):
    """The same run, stopped by a failure right after its checkpoint at step 3, and run
    again: the steps after the checkpoint log the uninterrupted run's losses, and it ends with its
    weights, to the bit (the checkpoint drained the pipeline in both, and both continued from an
    empty one)."""
    folder = pp2_run(data_dir, deep_yaml, tmp_path, DDP_TEST_RAISE_AT="1:3")
    assert (folder / CHECKPOINT_NAME).is_file() and [m["step"] for m in metrics(folder)] == [2]
    shutil.copy(folder / CHECKPOINT_NAME, tmp_path / "at_step_3.pt")
    pp2_run(data_dir, deep_yaml, tmp_path)
    resumed, whole = metrics(folder), metrics(stashed_run)
    assert [(m["step"], m["train_loss"]) for m in resumed] == [(m["step"], m["train_loss"]) for m in whole]
    got = torch.load(folder / CHECKPOINT_NAME, weights_only=False)["model"]
    want = torch.load(stashed_run / CHECKPOINT_NAME, weights_only=False)["model"]
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert torch.load(tmp_path / "at_step_3.pt", weights_only=False)["step"] == 3


def test_a_stop_signal_at_any_step_resumes_exactly(stashed_run, data_dir, deep_yaml, tmp_path):
    """SIGUSR1 to a random rank during a random step: the ranks agree a step later (a check every
    step) and stop where the pipeline next drains (step 3, or the end at 6), with a checkpoint;
    the run again, with no interval checkpoints this time (--checkpoint_every may change on a
    rerun): the uninterrupted run's losses and weights to the bit. Neither the signal nor the
    checkpoints moved a drain."""
    rank, step = random.randrange(2), random.randrange(5)
    flags = {"stop_check_every": 1, "checkpoint_every": 0}
    stopped = run(2, train_args(deep_yaml, data_dir, tmp_path, **{**STASHED, **flags}), timeout=240, **MP,
                  DDP_TEST_SIGNAL_AT=f"{rank}:{step}")
    out = stopped.stdout + stopped.stderr
    folder = tmp_path / "tiny" / "2GPU_tp1_cp1_dp1_pp2" / "00"
    where = f"signal to rank {rank} in step {step + 1}"
    if step + 2 <= 3:  # agreed after step + 2: the next drain is step 3
        assert stopped.returncode != 0 and "stopping at step 3 of 6" in out, (where, out[-3000:])
        deferred = "the asynchronous pipeline stops where it next drains, at step 3"
        assert (deferred in out) == (step + 2 < 3), where  # agreed after step 2: it waits a step
        assert torch.load(folder / CHECKPOINT_NAME, weights_only=False)["step"] == 3, where
        ok(run(2, train_args(deep_yaml, data_dir, tmp_path, **{**STASHED, **flags}), timeout=240, **MP))
    else:  # agreed after step 4 or 5: the next drain is the end
        ok(stopped)
    resumed, whole = metrics(folder), metrics(stashed_run)
    losses = [[(m["step"], m["train_loss"]) for m in ms] for ms in (resumed, whole)]
    assert losses[0] == losses[1], where
    got = torch.load(folder / CHECKPOINT_NAME, weights_only=False)["model"]
    want = torch.load(stashed_run / CHECKPOINT_NAME, weights_only=False)["model"]
    assert all(torch.equal(got[n], want[n]) for n in want), where
