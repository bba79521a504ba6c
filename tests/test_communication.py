"""The communication lesson's parts that run in one process or in spawned gloo ranks: which
layouts refuse gradient compression, that the bytes counted are the bytes all-reduced, and the
heartbeat's diagnosis of a rank that did not arrive. (Compressed training runs and a frozen
rank in a real job: tests/test_ddp.py; scripts/hang_demo.py and scripts/comm_overlap.py run in
the course check, tests/test_readme.py.)"""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from distributed.health import Deadlines, Heartbeat, collectives_by_phase
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
    from training.graphs import GraphStep

    with pytest.raises(ValueError, match="train_graph.py does not compress gradients"):
        ctx = RunContext(device=torch.device("cpu"), run_dir=None)
        GraphStep.check(cfg_factory(grad_compression="bf16"), ctx, 4)


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
        state = compress_gradients(ddp, cfg.layout, cfg.seed, None)
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

    beat = Heartbeat(dist.HashStore(), 0, 2, "hb/", limits=Deadlines(0.05, 0.05, 0.05))
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


def test_on_nccl_the_heartbeat_reports_before_the_process_group_times_out():
    """NCCL's watchdog ends the process at the process group's timeout, before any Python code
    can name the missing rank; on gloo the collective raises and the launcher names it. So on
    NCCL the heartbeat's diagnosis comes first, the process group's timeout a margin later,
    and the heartbeat ends the process only if NCCL has not."""
    from distributed.health import NCCL_MARGIN_S, PERIOD_S, deadlines

    gloo, nccl = deadlines(20.0, "gloo"), deadlines(20.0, "nccl")
    assert gloo == Deadlines(20.0, 20.0 + 2 * PERIOD_S, 20.0 + 2 * PERIOD_S)  # raises, then reports
    assert nccl.report_s == 20.0 < nccl.process_group_s == 20.0 + NCCL_MARGIN_S < nccl.end_s
    # time to notice (a heartbeat), write the line (a heartbeat and the store reads) and flush it
    assert NCCL_MARGIN_S >= 4 * PERIOD_S + 5
    assert deadlines(20.0, "cpu:gloo,cuda:nccl") == nccl
    assert nccl.host_runs_ahead and not gloo.host_runs_ahead


def test_on_nccl_the_step_named_is_the_latest_the_stuck_collective_can_be_of():
    """The host queues NCCL's collectives and runs on: when it notices, it may be a step past the
    stuck one. The line says so instead of naming the step as if it were certain."""
    import torch.distributed as dist

    from distributed.health import deadlines

    beat = Heartbeat(dist.HashStore(), 0, 2, "hb/", period_s=0.01, limits=deadlines(5.0, "nccl"))
    beat.others = lambda read_timeout_s=5.0: {1: None}
    beat.mark(13, "backward")
    line = beat.diagnosis()
    assert line.startswith("rank 0 gave up at step 13 in backward: rank 1 never reported"), line
    assert line.endswith("(the stuck collective is of that step or an earlier one: the host queues NCCL's "
                         "collectives ahead of the GPU; the Flight Recorder dump names it)"), line
    beat.limits = deadlines(5.0, "gloo")
    assert "the stuck collective" not in beat.diagnosis()


def _skipping_rank(rank: int, port: int, timeout_s: float, fake_nccl: bool) -> None:
    """One of two ranks joined through distributed/env.py: rank 1 skips step 2's all-reduce and is
    alive elsewhere ("validation"). With ``fake_nccl``, gloo is given NCCL's deadlines and a
    collective that gives up ends the process without a word, as NCCL's watchdog does."""
    import logging
    import os
    import sys

    import torch.distributed as dist

    from distributed import env, health
    from utils.device import cuda_available

    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
    if fake_nccl:
        health.ENDS_PROCESS_AT_TIMEOUT = ("gloo",)
    device = torch.device("cuda", rank) if cuda_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    env.init_distributed(env.DistEnv(rank, rank, 2, 2, "127.0.0.1", port), device, timeout_s, 60.0)
    beat = env.heartbeat()
    beat.collectives = collectives_by_phase(ddp=True, fsdp=False, zero1=False, model_parallel=False,
                                            pipeline=False, clipping=False)
    x = torch.ones(1, device=device)
    for step in (1, 2):
        beat.mark(step, "backward")
        if rank == 1 and step == 2:  # the bug: rank 1 skips this step's all-reduce
            beat.mark(step, "validation")
            time.sleep(600)
        try:
            dist.all_reduce(x)
            x.cpu()  # NCCL: wait for it
        except Exception as err:
            print(f"the process group gave up: {type(err).__name__}", flush=True)
            os._exit(3)  # NCCL's watchdog: the process ends here, nothing else is logged
        print(f"step {step} done", flush=True)


def _run_skipping_ranks(timeout_s: float, fake_nccl: bool, gpus: bool) -> tuple[str, float]:
    """Rank 0's output until its heartbeat's diagnosis (or its end), and the seconds from rank 0's
    step 1 to that line. Both ranks are stopped."""
    import re
    import subprocess
    import sys

    from tests.conftest import REPO, subprocess_env
    from tests.slurm_harness import free_port

    port, procs = free_port(), []
    env = subprocess_env(gpus=gpus, PYTHONUNBUFFERED="1")
    for rank in (0, 1):
        code = (f"from tests.test_communication import _skipping_rank; "
                f"_skipping_rank({rank}, {port}, {timeout_s}, {fake_nccl})")
        procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    lines, started, took = [], None, None
    try:
        for line in procs[0].stdout:
            lines.append(line)
            if line.startswith("step 1 done"):
                started = time.monotonic()
            if "gave up at step" in line:
                took = time.monotonic() - started
                break
    finally:
        for p in procs:
            p.kill()
            p.wait()
    out = "".join(lines)
    assert not re.search(r"^the process group gave up", out, re.M), out[-3000:]
    assert took is not None, out[-3000:]
    return out, took


@pytest.mark.timeout(120)
def test_the_diagnosis_comes_before_a_process_group_that_ends_the_process():
    """Two gloo ranks given NCCL's deadlines: rank 1 skips an all-reduce; rank 0's heartbeat names
    it, with the collective and where rank 1 is, at the collective timeout, before the process
    group's timeout (which on NCCL ends the process without a word)."""
    timeout_s = 3.0
    out, took = _run_skipping_ranks(timeout_s, fake_nccl=True, gpus=False)
    assert ("rank 0 gave up at step 2 in backward (DDP's gradient all-reduce): rank 1 did not arrive: "
            "it is alive at step 2 in validation") in out, out[-3000:]
    assert "the process group times out in" in out
    # noticed within a heartbeat of the timeout, written within another (and the store reads)
    assert timeout_s < took < timeout_s + 4 * 2.0 + 5, took


@pytest.mark.cuda
@pytest.mark.timeout(180)
def test_on_nccl_the_diagnosis_comes_before_nccls_watchdog():
    """The same on NCCL itself (two GPUs: NCCL refuses two ranks on one GPU)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs a GPU per rank: this machine has one")
    out, took = _run_skipping_ranks(5.0, fake_nccl=False, gpus=True)
    assert "rank 0 gave up at step 2 in backward (DDP's gradient all-reduce): rank 1 did not arrive" in out
    assert 5.0 < took < 5.0 + 13, took


def test_the_overlap_timeline_reads_a_gpus_times_once_its_work_is_done(monkeypatch):
    """scripts/comm_overlap.py on a GPU, faked: the host only queues work there, so every stamp of
    the step (spans, a bucket handed over and completed, in its completion callback) is a device
    event, and events are read only after the device was synchronised. The fake device's clock
    counts events, so the times are whole numbers of seconds where a host clock's would not be."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from scripts import comm_overlap
    from utils import device as dev

    log: list[str] = []

    class DeviceEvent:
        def record(self) -> None:
            self.t = len(log)
            log.append("record")

        def elapsed_time(self, end: DeviceEvent) -> float:  # as CUDA's: only once both are done
            assert "synchronize" in log[max(self.t, end.t):], "an event read before its work was done"
            return 1000.0 * (end.t - self.t)

    monkeypatch.setattr(dev, "timing_event", lambda device: DeviceEvent())
    monkeypatch.setattr(dev, "synchronize", lambda device: log.append("synchronize"))
    allreduce = torch.futures.Future()
    monkeypatch.setattr(default_hooks, "allreduce_hook", lambda group, bucket: allreduce)
    timeline = comm_overlap.Timeline(torch.device("cuda", 0))
    hook = comm_overlap.recording_hook(timeline, None)
    bucket = SimpleNamespace(index=lambda: 0)

    timeline.start()  # synchronize, then the first event (1)
    timeline.span("forward", 0.0)  # event 2
    hook(None, bucket)  # handed over: event 3
    allreduce.set_result(torch.zeros(1))  # the completion callback: event 4
    assert timeline.finish() == 4.0  # the step's last event (5), after its synchronize
    assert timeline.spans == {"forward": [0.0, 1.0]} and timeline.buckets == {0: [2.0, 3.0]}


@pytest.mark.cuda
def test_the_overlap_timeline_times_the_gpus_work_not_its_launches():
    """On a GPU the span around queued matmuls lasts as long as the GPU computes them, not the
    fraction of a millisecond the host takes to queue them."""
    from scripts import comm_overlap

    cuda = torch.device("cuda", 0)
    a = torch.randn(4096, 4096, device=cuda)
    a @ a  # warm-up
    timeline = comm_overlap.Timeline(cuda)
    timeline.start()
    wall = time.perf_counter()
    start = timeline.now()
    for _ in range(20):
        a @ a
    queued = time.perf_counter() - wall
    timeline.span("forward", start)
    total = timeline.finish()
    wall = time.perf_counter() - wall
    begin, end = timeline.spans["forward"]
    assert wall > 5 * queued, (wall, queued)  # the GPU's work outlasts its queueing
    assert end - begin > 0.8 * wall and total >= end, (timeline.spans, total, wall)


def _groups_that_wait(rank: int, port: int, timeout_s: float) -> None:
    """Two gloo ranks joined through distributed/env.py make the groups a run makes after the
    default one (the mesh's tp, the experts' ep, HSDP's dp_shard); rank 1 then joins none of their
    collectives, and rank 0 prints how long each waited before it gave up."""
    import contextlib
    import sys

    import torch.distributed as dist

    from distributed import env
    from distributed.experts import add_expert_groups
    from distributed.mesh import build_mesh
    from distributed.sharding import hsdp_mesh
    from utils.config_groups import ParallelConfig

    where = env.DistEnv(rank, rank, 2, 2, "127.0.0.1", port)
    env.init_distributed(where, torch.device("cpu"), timeout_s, 60.0)
    tp = build_mesh({"tp": 2})
    dp = build_mesh({})
    add_expert_groups(dp, 2)
    shard = hsdp_mesh(dp, ParallelConfig(data_parallel="hsdp", dp_shard=2))
    groups = {"tp": tp.group("tp"), "dp": dp.group("dp"), "ep": dp.group("ep"),
              "dp_shard": shard.get_group("dp_shard")}
    if rank == 1:
        time.sleep(120)
    for name, group in groups.items():
        start = time.monotonic()
        with contextlib.suppress(Exception):  # gloo's "Timed out waiting ... ms"
            dist.all_reduce(torch.ones(1), group=group)
        print(f"{name} waited {time.monotonic() - start:.1f} s", flush=True)
    sys.stdout.flush()
    os._exit(0)


@pytest.mark.timeout(120)
def test_every_group_a_run_makes_has_the_runs_timeout():
    """The groups made after the default one (a DeviceMesh's dimensions, new_group for the experts)
    take torch's default timeout, 30 min on gloo and 10 on NCCL, unless they are given the run's:
    a stuck tp collective would outlast --collective_timeout_s and the heartbeat's diagnosis."""
    import subprocess
    import sys

    from tests.conftest import REPO, subprocess_env
    from tests.slurm_harness import free_port

    port, timeout_s = free_port(), 2.0
    code = "from tests.test_communication import _groups_that_wait; _groups_that_wait({}, {}, {})"
    procs = [subprocess.Popen([sys.executable, "-c", code.format(rank, port, timeout_s)], cwd=REPO,
                              env=subprocess_env(PYTHONUNBUFFERED="1"), text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for rank in (0, 1)]
    try:
        out, _ = procs[0].communicate(timeout=90)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    waited = dict(re.findall(r"^(\w+) waited ([\d.]+) s$", out, re.M))
    assert set(waited) == {"tp", "dp", "ep", "dp_shard"}, out[-3000:]
    assert all(timeout_s <= float(s) < timeout_s + 5 for s in waited.values()), waited


@pytest.mark.timeout(180)
def test_ranks_end_with_their_launcher(data_dir, tmp_path):
    """kill -9 of torchrun: its ranks, in sessions of their own, would train on (and, once one is
    gone, wait for each other for ever); each one's heartbeat sees its parent gone and ends it
    within a few seconds, in one line."""
    import signal
    import subprocess
    import sys

    from tests.conftest import REPO, subprocess_env
    from tests.ddp_helpers import train_args, write_test_yaml

    yaml = write_test_yaml(tmp_path / "ViT.yaml")
    args = train_args(yaml, data_dir, tmp_path / "logs", num_iters=100000, checkpoint_every=0)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = subprocess_env(fast_start=False, PYTHONUNBUFFERED="1")  # the ranks are torchrun's own children
    proc = subprocess.Popen([*launch, str(REPO / "train.py"), *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, ranks = [], []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "steps per epoch" in line:
                break
        for p in Path("/proc").iterdir():  # the ranks: train.py processes whose parent is torchrun
            with contextlib.suppress(OSError, ValueError):
                parent = int((p / "stat").read_text().rsplit(") ", 1)[1].split()[1])
                if p.name.isdigit() and parent == proc.pid:
                    ranks.append(int(p.name))
        assert len(ranks) == 2, "".join(lines)[-3000:]
        proc.kill()  # the launcher only
        killed = time.monotonic()
        rest = proc.stdout.read()  # until every rank has closed its end of the pipe
        took = time.monotonic() - killed
    finally:
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    out = "".join(lines) + rest
    assert out.count("its launcher (torchrun, pid") == 2, out[-3000:]
    assert took < 20, took
