"""The communication lesson's parts that run in one process or in spawned gloo ranks: which
layouts refuse gradient compression, that the bytes counted are the bytes all-reduced, and the
heartbeat's diagnosis of a rank that did not arrive. (Compressed training runs and a frozen
rank in a real job: tests/test_ddp.py; scripts/hang_demo.py and scripts/comm_overlap.py run in
the course check, tests/test_readme.py.)"""

from __future__ import annotations

import time

import pytest
import torch

from distributed.health import Heartbeat, collectives_by_phase
from tests.dist_spawn import run_ranks


@pytest.mark.parametrize("flags, named", [
    ({"data_parallel": "fsdp"}, "--data_parallel fsdp"),
    ({"data_parallel": "hsdp"}, "--data_parallel hsdp"),
    ({"tensor_parallel": 2}, "--tensor_parallel 2"),
    ({"context_parallel": 2}, "--context_parallel 2"),
    ({"pipeline_parallel": 2}, "--pipeline_parallel 2"),
    ({"noddp": True}, "--noddp"),
])
def test_compression_is_refused_where_ddp_does_not_reduce_alone(cfg_factory, flags, named):
    with pytest.raises(ValueError) as err:
        cfg_factory(grad_compression="powersgd", **flags)
    message = str(err.value)
    assert "\n" not in message and named in message and "use it with --data_parallel ddp or zero1" in message
    cfg_factory(grad_compression="bf16", data_parallel="zero1")  # ZeRO-1 reduces with DDP: allowed
    with pytest.raises(ValueError, match="powersgd_rank"):
        cfg_factory(grad_compression="powersgd", powersgd_rank=0)


def test_graph_runs_refuse_compression(cfg_factory):
    from training.context import RunContext
    from training.graphs import GraphTrainer

    with pytest.raises(ValueError, match="train_graph.py does not compress gradients"):
        ctx = RunContext(device=torch.device("cpu"), run_dir=None)
        GraphTrainer(cfg_factory(grad_compression="bf16"), ctx, 4)


def _bytes_counted_are_bytes_sent() -> None:
    for compression in ("bf16", "powersgd"):
        _count_bytes(compression)


def _count_bytes(compression: str) -> None:
    """DDP with the project's hook on a small model; every dist.all_reduce call is counted here
    (the hooks call it through the module, as torch's do) and compared with the hook's count."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from distributed.compression import compress_gradients
    from tests.conftest import make_cfg

    sent = [0]
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        sent[0] += tensor.numel() * tensor.element_size()
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 8))
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)  # several buckets
        cfg = make_cfg(".", ".", grad_compression=compression, powersgd_rank=2)
        state = compress_gradients(ddp, cfg, None)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        counted, full = [], sum(p.numel() * 4 for p in model.parameters())
        for step in range(4):
            g = torch.Generator().manual_seed(10 * step + dist.get_rank())
            x, y = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
            before = sent[0]
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            counted.append(state.bytes_sent)
            state.bytes_sent = 0
            assert counted[-1] == sent[0] - before, (step, counted[-1], sent[0] - before)
            opt.step()
            opt.zero_grad()
    finally:
        dist.all_reduce = original
    if compression == "bf16":
        assert counted == [full // 2] * 4
    else:  # powersgd: two steps whole, then the two 2-D weights as rank-2 factors, biases whole
        compressed = 4 * ((64 + 96) * 2 + (96 + 8) * 2 + 96 + 8)
        assert counted == [full] * 2 + [compressed] * 2, (counted, full, compressed)


@pytest.mark.timeout(120)
def test_the_bytes_counted_are_the_bytes_all_reduced():
    """bf16 and PowerSGD, one after the other in the same 2 gloo ranks."""
    run_ranks(2, _bytes_counted_are_bytes_sent)


def test_the_heartbeat_names_the_rank_that_did_not_arrive():
    """Two ranks' heartbeats in one in-memory store: a rank alive elsewhere is named with where it
    is; a rank whose entries stopped is named as not responding; ranks at the same place are
    told apart from both."""
    import torch.distributed as dist

    store = dist.HashStore()
    ranks = [Heartbeat(store, r, 2, "hb/", period_s=0.05).start() for r in range(2)]
    try:
        ranks[0].collectives = collectives_by_phase(ddp=True, fsdp=False, zero1=False, model_parallel=False,
                                                    pipeline=False, clipping=False)
        ranks[0].mark(7, "backward")
        ranks[1].mark(6, "validation")
        line = ranks[0].diagnosis()
        assert line.startswith("rank 0 gave up at step 7 in backward (DDP's gradient all-reduce): ")
        assert "rank 1 did not arrive: it is alive at step 6 in validation (the validation metrics' " \
               "all-reduce), host" in line
        ranks[1].mark(7, "backward")
        time.sleep(0.2)
        assert "every other rank is alive at the same step and phase" in ranks[0].diagnosis()
        ranks[1].stop()  # frozen: no more entries
        line = ranks[0].diagnosis(now=time.time() + 30)
        assert "rank 1 stopped responding (no sign of life for 3" in line
        assert "last seen at step 7 in backward" in line
    finally:
        for r in ranks:
            r.stop()
    lonely = Heartbeat(dist.HashStore(), 0, 2, "hb/", period_s=0.01)
    lonely.others = lambda read_timeout_s=5.0: {1: None}  # the store had nothing from rank 1
    assert "rank 1 never reported" in lonely.diagnosis()


def test_the_heartbeat_names_a_rank_killed_a_moment_ago_and_its_node(monkeypatch):
    """A rank killed an instant ago (a lost node: its connections close and the collective fails at
    once) has a fresh last entry; it is named as stopped because it writes no new one, with the
    Slurm node it ran on (SLURMD_NODENAME, which is not the host name when several nodes share a
    machine)."""
    import torch.distributed as dist

    monkeypatch.setenv("SLURMD_NODENAME", "n2")
    store = dist.HashStore()
    ranks = [Heartbeat(store, r, 2, "hb/", period_s=0.05).start() for r in range(2)]
    try:
        time.sleep(0.1)
        ranks[1].stop()  # killed: no more entries
        line = ranks[0].diagnosis()
        assert "rank 1 stopped responding (no sign of life for " in line, line
        assert "last seen at step 0 in start-up, node n2 (host " in line, line
    finally:
        for r in ranks:
            r.stop()


def test_the_watchdog_watches_only_a_step_after_the_first():
    """A phase of a training step that lasts longer than the limit ends the process (torch 2.8's DDP
    on gloo never times out waiting for a frozen peer); not the first step (compilation), not
    validation or checkpoints, not while a diagnosis is being written."""
    import torch.distributed as dist

    beat = Heartbeat(dist.HashStore(), 0, 2, "hb/", stuck_after_s=0.05)
    beat.mark(10, "backward")  # the first step of this process
    time.sleep(0.1)
    assert not beat.stuck()
    beat.mark(11, "validation")
    time.sleep(0.1)
    assert not beat.stuck()
    beat.mark(11, "backward")
    assert not beat.stuck()  # just marked
    time.sleep(0.1)
    assert beat.stuck()
    beat.reporting = True
    assert not beat.stuck()
    assert not Heartbeat(dist.HashStore(), 0, 2, "hb/").stuck()  # no limit: no watchdog
