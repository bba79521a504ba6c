"""The GPU paths' logic, checked on CPU: streams, graph capture, RNG state, device choice,
the learning-rate tensor of captured Adam, the profiler window, the torch floor."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, subprocess_env
from training import graphs
from training.context import RunContext
from training.trainer import Trainer
from utils import compat
from utils import device as dev
from utils.profiling import ProfilingWindow


def test_more_local_ranks_than_gpus_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(dev, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="2 ranks on this node but 1 visible GPU"):
        dev.pick_device(local_rank=1, local_world_size=2, environ={})
    with pytest.raises(ValueError, match="2 ranks on this node but 1 visible GPU"):  # torchrun in srun
        dev.pick_device(local_rank=1, local_world_size=2,
                        environ={"SLURM_STEP_ID": "0", "TORCHELASTIC_RUN_ID": "x"})


def test_an_srun_task_bound_to_one_gpu_takes_it_whatever_its_local_rank(monkeypatch):
    """`--gpus-per-task=1`: each of the node's 4 tasks sees only its own GPU, as GPU 0."""
    chosen = []
    monkeypatch.setattr(dev, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    device = dev.pick_device(local_rank=3, local_world_size=4, environ={"SLURM_STEP_ID": "0"})
    assert device == torch.device("cuda", 0) and chosen == [0]


def test_gloo_ranks_share_the_gpus_and_the_backend_is_checked(monkeypatch, cfg_factory):
    """--dist_backend gloo: ranks may outnumber the GPUs (make gpu-check's 2-rank jobs on one GPU);
    NCCL without a GPU, and a pipeline over gloo on GPUs (gloo sends no GPU tensors), are refused."""
    from training.launcher import check_backend

    chosen = []
    monkeypatch.setattr(dev, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    devices = [dev.pick_device(rank, 2, environ={}, share_gpus=True) for rank in (0, 1)]
    assert devices == [torch.device("cuda", 0)] * 2 and chosen == [0, 0]
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert [dev.backend_for(gpu), dev.backend_for(cpu), dev.backend_for(gpu, "gloo")] == \
        ["nccl", "gloo", "gloo"]
    check_backend(cfg_factory(dist_backend="gloo", tensor_parallel=2).layout, gpu)
    check_backend(cfg_factory(dist_backend="gloo", pipeline_parallel=2).layout, cpu)
    with pytest.raises(ValueError, match="^pipeline stages pass activations with send and recv, which gloo"):
        check_backend(cfg_factory(dist_backend="gloo", pipeline_parallel=2).layout, gpu)
    with pytest.raises(ValueError, match="^--dist_backend nccl needs GPUs with CUDA and this machine"):
        check_backend(cfg_factory(dist_backend="nccl").layout, cpu)


def test_rng_state_saves_only_this_ranks_gpu(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: asked.append(device) or torch.ones(3))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: asked.append(("set", device)))
    gpu = torch.device("cuda", 1)
    state = dev.rng_state(gpu)
    assert asked == [gpu] and set(state) == {"torch", "cuda_device"}
    dev.set_rng_state(state, gpu)
    assert asked[-1] == ("set", gpu)
    assert set(dev.rng_state(torch.device("cpu"))) == {"torch"}
    # a checkpoint written on a GPU resumes on a CPU (its GPU state is ignored there)
    dev.set_rng_state(state, torch.device("cpu"))


def test_graph_capture_is_thread_local_on_the_given_stream(monkeypatch):
    seen = {}

    class FakeGraphContext:
        def __init__(self, graph, **kwargs):
            seen.update(kwargs, graph=graph)

    monkeypatch.setattr(torch.cuda, "graph", FakeGraphContext)
    dev.graph_capture("g", stream="s")
    assert seen == {"graph": "g", "stream": "s", "capture_error_mode": "thread_local"}


def test_finiteness_of_weights_held_elsewhere_is_gathered_on_the_trainers_device():
    """FSDP's CPU offload keeps shards in host memory while the trainer's device is a GPU: each
    answer moves to the device before they are stacked (the meta device stands in for the GPU)."""
    from training.state import unsound_flags

    host = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    flags = unsound_flags(1.0, host, torch.device("meta"))
    assert flags.device.type == "meta" and flags.shape == (2,)
    assert unsound_flags(float("nan"), host, torch.device("cpu")).tolist() == [1.0, 0.0]


def test_a_graph_runs_checkpoint_resumes_in_train_py(cfg_factory, tmp_path):
    """train_graph.py saves the learning rate as a (GPU) tensor; train.py's foreach Adam refuses a
    tensor rate: the loaded rates become numbers again (rates written as CPU tensors here)."""
    from training.context import RunContext
    from training.trainer import Trainer

    cfg = cfg_factory(num_iters=4, limit_nsamples=8)
    first = Trainer(cfg, RunContext(device=torch.device("cpu"), run_dir=tmp_path / "a"), 2)
    batches = list(first.train_data)
    first.train_step(*batches[0])
    first.step = 1
    first.save_checkpoint()
    state = torch.load(first.checkpoint_path, weights_only=False)
    group = state["optimizer"]["param_groups"][0]
    group["lr"], group["initial_lr"] = torch.tensor(group["lr"]), torch.tensor(group["initial_lr"])
    state["scheduler"]["base_lrs"] = [torch.tensor(x) for x in state["scheduler"]["base_lrs"]]
    state["scheduler"]["_last_lr"] = [torch.tensor(x) for x in state["scheduler"]["_last_lr"]]
    torch.save(state, first.checkpoint_path)
    second = Trainer(cfg, RunContext(device=torch.device("cpu"), run_dir=tmp_path / "a"), 2)
    assert second.optimizer.param_groups[0]["foreach"]
    second.load_checkpoint(second.checkpoint_path)
    for _ in range(2):  # the scheduler's rates, not only the optimizer's, must be numbers
        second.train_step(*batches[1])
    assert isinstance(second.optimizer.param_groups[0]["lr"], float)


def test_train_graph_builds_the_optimizer_the_run_asks_for(cfg_factory):
    """AdamW with its weight decay (not plain Adam, whatever the flags), capturable, its rate a
    tensor; optimizers without a capturable kernel are refused in one line."""
    params = [torch.nn.Parameter(torch.zeros(3))]
    opt = graphs.capturable_optimizer(params, cfg_factory(optimizer_type="AdamW", weight_decay=0.05).optim,
                                      torch.device("cpu"))
    group = opt.param_groups[0]
    assert type(opt) is torch.optim.AdamW and group["weight_decay"] == 0.05 and group["capturable"]
    assert torch.is_tensor(group["lr"])
    for name in ("SGD", "LAMB"):
        with pytest.raises(ValueError, match=f"run --optimizer {name} with train.py"):
            graphs.GraphStep.check(cfg_factory(optimizer_type=name), None, 4)


def test_deepspeed_is_told_the_gpu_this_rank_uses():
    """Under srun --gpus-per-task=1 each task sees one GPU, cuda:0, whatever its local rank:
    DeepSpeed's LOCAL_RANK must name that GPU, not the task's place on the node."""
    from training.context import RunContext
    from training.deepspeed_engine import launcher_env

    ctx = RunContext(device=torch.device("cuda", 0), run_dir=None, rank=7, world_size=8, local_rank=3)
    assert launcher_env(ctx, torch.device("cuda", 0)) == {"RANK": "7", "LOCAL_RANK": "0", "WORLD_SIZE": "8"}
    assert launcher_env(ctx, torch.device("cpu"))["LOCAL_RANK"] == "3"


def test_loading_optimizer_state_keeps_the_lr_tensor():
    """A captured graph reads the lr tensor at a fixed address: it must survive a resume."""
    param = torch.nn.Parameter(torch.zeros(2))
    lr = torch.tensor(0.1)
    opt = torch.optim.Adam([param], lr=lr, foreach=False)
    saved = opt.state_dict()
    saved["param_groups"][0]["lr"] = torch.tensor(0.025)  # a checkpoint's own (CPU) tensor
    graphs.keep_lr_tensors(opt, lambda: opt.load_state_dict(saved))
    assert opt.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(0.025)
    saved["param_groups"][0]["lr"] = 0.5  # or a float
    graphs.keep_lr_tensors(opt, lambda: opt.load_state_dict(saved))
    assert opt.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(0.5)


def test_graph_trainer_uses_one_side_stream_for_ddp_warmup_and_capture(cfg_factory, tmp_path, monkeypatch):
    """DDP is built, the warm-up runs and the capture records on one persistent side stream."""
    events = []
    stream = object()
    inside = []

    @contextlib.contextmanager
    def on_stream(s, device):
        inside.append(s)
        yield
        inside.pop()

    class FakeGraph:
        def replay(self):
            events.append("replay")

    @contextlib.contextmanager
    def capture(graph, s):
        events.append(("capture", s))
        yield

    real_build = graphs.EagerStep.build_model

    def build_model(self):
        events.append(("build", tuple(inside)))
        return real_build(self)

    monkeypatch.setattr(dev, "new_stream", lambda device: stream)
    monkeypatch.setattr(dev, "on_stream", on_stream)
    monkeypatch.setattr(dev, "new_cuda_graph", FakeGraph)
    monkeypatch.setattr(dev, "graph_capture", capture)
    monkeypatch.setattr(graphs.EagerStep, "build_model", build_model)
    monkeypatch.setattr(graphs.GraphStep, "build_optimizer",  # capturable Adam needs CUDA
                        lambda self, model: torch.optim.Adam(model.parameters(), lr=1e-3))
    cfg = cfg_factory(num_iters=graphs.EAGER_WARMUP_STEPS + 2)
    trainer = Trainer(cfg, RunContext(device=torch.device("cpu"), run_dir=tmp_path), 4,
                             step=graphs.GraphStep)
    warmups = []
    real_step = graphs.EagerStep.train_step

    def counted_step(self, inp, tar):
        warmups.append(tuple(inside))
        return real_step(self, inp, tar)

    monkeypatch.setattr(graphs.EagerStep, "train_step", counted_step)
    trainer.fit()
    assert events[0] == ("build", (stream,))  # DDP would be constructed on the side stream
    assert warmups == [(stream,)] * graphs.EAGER_WARMUP_STEPS
    assert ("capture", stream) in events and events.count("replay") == 2


def test_profiler_window_opens_on_every_rank(cfg_factory, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(dev, "cuda_profiler_start", lambda: calls.append("start"))
    monkeypatch.setattr(dev, "cuda_profiler_stop", lambda: calls.append("stop"))
    cfg = cfg_factory(profile_epoch=0, profile_start_step=1, profile_num_steps=1)
    window = ProfilingWindow(cfg, torch.device("cpu"), tmp_path, rank=3, steps_per_epoch=4)
    for batch in range(3):
        with window.step(0, batch, batch):
            pass
    assert calls == ["start", "stop"]  # rank 3 too: each rank's nsys waits for its own start


@pytest.mark.parametrize("version, ok", [("2.13.0+cpu", True), ("2.8.0a0+5228986c39.nv25.06", True),
                                         ("2.7.1", False), ("1.13.1", False)])
def test_torch_floor(version, ok):
    problem = compat.check_torch(version)
    assert (problem is None) == ok
    if not ok:
        assert f"PyTorch {version} is too old: this code needs 2.8 or newer" in problem


def test_an_old_torch_gets_one_line_before_anything_is_imported(tmp_path):
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("__version__ = '2.1.0'\n")  # a stand-in for an old install
    env = subprocess_env()
    env["PYTHONPATH"] = f"{tmp_path}:{REPO}"
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", "tiny"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: PyTorch 2.1.0 is too old: this code needs 2.8 or newer; {compat.INSTALL_HINT}"]


def test_adam_runs_the_multi_tensor_path_unless_fused(cfg_factory, tmp_path):
    for fused in (False, True):
        trainer = Trainer(cfg_factory(enable_fused=fused),
                          RunContext(device=torch.device("cpu"), run_dir=tmp_path / str(fused)), 4)
        group = trainer.optimizer.param_groups[0]
        assert (bool(group["foreach"]), bool(group["fused"])) == (not fused, fused)


def test_threads_follow_the_cpus_this_process_may_run_on(monkeypatch):
    """Ranks of torchrun (or a plain start) split the CPUs they see; a task of an srun step has
    its own (the submit scripts give it `-c` CPUs, bound)."""
    monkeypatch.setattr(dev.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(dev.os, "cpu_count", lambda: 128)  # the node's count must not matter
    assert dev.cpu_threads(1, {}) == 8
    assert dev.cpu_threads(4, {}) == 2
    assert dev.cpu_threads(4, {"SLURM_STEP_ID": "0"}) == 8  # srun: 8 CPUs of its own
    assert dev.cpu_threads(4, {"SLURM_STEP_ID": "0", "TORCHELASTIC_RUN_ID": "x"}) == 2  # torchrun in srun
    assert dev.cpu_threads(16, {}) == 1


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_getaffinity"), reason="no CPU affinity here")
def test_threads_under_taskset_count_the_allowed_cpus():
    """A real restricted affinity: taskset lets the process run on CPU 0 only."""
    code = ("from utils.device import set_cpu_threads; import torch; set_cpu_threads(1); "
            "print(torch.get_num_threads())")
    env = {k: v for k, v in subprocess_env().items() if k != "OMP_NUM_THREADS"}
    result = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1"]


def test_graphs_refuse_activation_checkpointing_before_torch_2_10(cfg_factory, tmp_path, monkeypatch):
    assert compat.graphs_with_checkpointing_problem("2.13.0") is None
    assert compat.graphs_with_checkpointing_problem("2.10.1") is None
    problem = compat.graphs_with_checkpointing_problem("2.9.1+cu128")
    assert problem.startswith("train_graph.py with --activation_checkpointing needs torch 2.10 or newer")
    monkeypatch.setattr(compat, "torch_version", lambda version=None: (2, 8))
    with pytest.raises(ValueError, match="needs torch 2.10 or newer"):
        graphs.GraphStep.check(cfg_factory(activation_checkpointing="full"),
                               RunContext(device=torch.device("cpu"), run_dir=tmp_path), 4)


def test_pipeline_timeline_reads_the_clock_after_the_device_finishes(monkeypatch):
    """On a GPU the host queues kernels and moves on: each stage's start and end are read
    after synchronising the device (faked here: the calls are recorded in order)."""
    from distributed import pipeline

    calls = []
    monkeypatch.setattr(pipeline.dev, "synchronize", lambda device: calls.append(("sync", device.type)))
    events = []
    timed = pipeline._timed(lambda chunk: calls.append(("forward", chunk)), "F", 1, events,
                            torch.device("cuda", 0))
    timed(3)
    assert calls == [("sync", "cuda"), ("forward", 3), ("sync", "cuda")]
    assert [e[:3] for e in events] == [("F", 1, 3)] and events[0][3] <= events[0][4]


def test_sharding_report_shows_the_gpu_allocator_peak_on_a_gpu():
    from scripts import sharding_report as report

    gpu = {"parameters_MiB": 1.0, "gradients_MiB": 1.0, "optimizer_MiB": 2.0, "allocator_peak_MiB": 123.4}
    cpu = {"parameters_MiB": 1.0, "gradients_MiB": 1.0, "optimizer_MiB": 2.0, "peak_rss_MiB": 567.8}
    for memory, name, value in ((gpu, "CUDA allocator peak MiB", "123"), (cpu, "peak RSS MiB", "568")):
        rows = [{"mode": "ddp", "ranks": 1, "memory_MiB": memory}]
        lines = report.memory_table(rows, params=2**18)
        assert lines[0].endswith(f"| {name} |") and lines[2].endswith(f"| {value} |")
        acts = report.checkpointing_table([{"checkpointing": "full", "memory_MiB": memory,
                                             "samples_per_sec": 1.0}])
        assert name in acts[0] and f"| {value} |" in acts[2]
