#!/usr/bin/env python
"""Check a layout before you run it: one training step of a many-GPU job, played on this CPU
with fake tensors and a fake process group, its memory and traffic beside the cost model's.

    python scripts/dry_run.py sbatch --nodes 4 submit_pm_mp.sh --config=mp --tensor_parallel=4
    python scripts/dry_run.py --ranks 16 train_mp.py --config=mp --tensor_parallel=4 --rank 3

A fake tensor (``torch._subclasses.fake_tensor.FakeTensorMode``) has a shape, a dtype and a
device but no data: every operation computes only the shape of its result. A fake process
group (the "fake" backend of ``torch.testing._internal.distributed.fake_pg``) accepts every
collective at any world size and moves nothing. Under both, this process builds the Trainer of
one rank of the job (the same parallelize, DDP/FSDP/HSDP/ZeRO-1, tensor- and context-parallel
layers, pipeline schedules, experts, activation checkpointing and precision a real run takes)
and runs one step, forward, backward and optimizer step, then the checkpoint's gather of the
weights. It records:

* every storage the step allocates and frees (a dispatch mode sees each operation's outputs),
  classified afterwards as parameters, gradients, optimizer state or activations and
  temporaries; the peak of each kind, and of all together;
* every collective the rank issues, with its group, kind and bytes (as the cost model counts
  them: an all-reduce its tensor, an all-gather its output, a reduce-scatter its input).

What it does not play: the data loader (the batch is a fake tensor of the right shape),
torch.compile (eager: compile's fused kernels keep fewer temporaries), CUDA graphs, DeepSpeed's
engine, a pipeline's checkpoint gather (its stages send each other pickled tensors). It traces
on the CPU device: a CPU-only torch cannot run a fake CUDA device, and the bytes do not depend
on it. It needs torch 2.11 or newer (older releases have no fake kernels for some collectives).

Where torch or the project reads a value (which a fake tensor has not), :func:`play` puts a
stand-in, each said where it is: no initial values, balanced expert routing, the ranks'
placement computed instead of gathered, each pipeline stage given its shapes, collectives'
handles holding their tensor, DDP's all-reduce through its Python hook (distributed/tags.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import os
import shlex
import sys
import tempfile
import weakref
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from scripts import cost_model as cm  # noqa: E402

log = logging.getLogger("dry_run")
MIB = 2**20
GPUS_PER_NODE = 4  # Perlmutter's GPU nodes
SUBMIT_SCRIPTS = {"submit_pm.sh": "train.py", "submit_pm_dp.sh": "train.py", "submit_pm_mp.sh": "train_mp.py"}
KINDS = ("parameters", "gradients", "optimizer_state", "activations")
MIN_TORCH = (2, 11)


# ------------------------------------------------------------------ the job ---
@dataclasses.dataclass
class Job:
    entry: str  # train.py or train_mp.py
    args: list[str]
    ranks: int
    per_node: int = GPUS_PER_NODE


def job_from(words: list[str], ranks: int | None = None) -> Job:
    """The job a command line starts: ``sbatch [--nodes N] SCRIPT ARGS`` (one rank per GPU, 4 per
    node; submit_pm.sh one), or ``SCRIPT ARGS`` with ``ranks``."""
    words = list(words)
    if words and words[0] == "sbatch":
        nodes, words = 1, words[1:]
        while words and words[0].startswith("-"):
            flag, _, value = words.pop(0).partition("=")
            value = value or words.pop(0)
            if flag in ("-N", "--nodes"):
                nodes = int(value)
        if not words or Path(words[0]).name not in SUBMIT_SCRIPTS:
            raise ValueError(f"sbatch runs one of {', '.join(SUBMIT_SCRIPTS)} here")
        script = Path(words[0]).name
        per_node = 1 if script == "submit_pm.sh" else GPUS_PER_NODE
        if nodes < 1:
            raise ValueError(f"--nodes {nodes}: a job has at least 1 node")
        return Job(SUBMIT_SCRIPTS[script], words[1:], ranks or nodes * per_node, per_node)
    if not words or Path(words[0]).name not in ("train.py", "train_mp.py"):
        raise ValueError("give the job as the page does (sbatch --nodes N submit_pm_mp.sh ...) or as "
                         "--ranks N train.py|train_mp.py ...")
    if not ranks or ranks < 1:
        raise ValueError("--ranks N: the job's world size, at least 1 (nodes x 4 GPUs on Perlmutter)")
    return Job(Path(words[0]).name, words[1:], ranks, min(ranks, GPUS_PER_NODE))


# ------------------------------------------------------------------ what a rank does ---
@dataclasses.dataclass
class Collective:
    kind: str
    group: str  # the mesh dimension(s) it runs over, or its size
    size: int  # ranks in the group
    nbytes: int


@dataclasses.dataclass
class RankReport:
    rank: int
    coords: dict[str, int]
    peak: dict[str, int]  # kind -> its own peak; "total": the peak of all together
    at_peak: dict[str, int]  # kind -> bytes live at the moment of the total's peak
    collectives: list[Collective]  # the step's
    checkpoint: list[Collective]  # the checkpoint's gather
    predicted: dict[str, int]  # the cost model's memory of this rank
    predicted_collectives: dict[tuple[str, str], int]  # (kind, dimension) -> bytes
    largest: list[tuple[int, str]] = dataclasses.field(default_factory=list)  # at the activations' peak


COLLECTIVES = {  # op name -> (kind, which argument's bytes count)
    "allreduce_": ("all_reduce", 0), "broadcast_": ("broadcast", 0), "_allgather_base_": ("all_gather", 0),
    "allgather_": ("all_gather", 0), "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1), "alltoall_base_": ("all_to_all", 1),
    "alltoall_": ("all_to_all", 1), "send": ("send", 0), "recv_": ("recv", 0),
    "all_reduce": ("all_reduce", 0), "all_reduce_": ("all_reduce", 0),
    "all_gather_into_tensor": ("all_gather", "out"), "reduce_scatter_tensor": ("reduce_scatter", 0),
    "all_to_all_single": ("all_to_all", 0),
}


def func_takes_group_name(name: str) -> bool:
    return name in ("all_reduce", "all_reduce_", "all_gather_into_tensor", "reduce_scatter_tensor",
                    "all_to_all_single")


def _nbytes(value: Any) -> int:
    leaves, _ = tree_flatten(value)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


class StepRecorder(TorchDispatchMode):
    """Sees every operation: the storages its outputs allocate (freed when Python drops them),
    FSDP's storage resizes, and the collectives."""

    def __init__(self, layouts: dict[str, list[list[int]]]) -> None:
        super().__init__()
        self.layouts = layouts  # every dimension's groups as rank lists (its name: the group's)
        self.ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # storage -> its number
        self.events: list[tuple[int, int]] = []  # (storage number, bytes added, negative: freed)
        self.live: dict[int, int] = {}
        self.collectives: list[Collective] = []
        self.made_by: dict[int, str] = {}  # storage number -> the operation and tensor that made it
        self.step_events = 0  # events of the step (then the checkpoint's gather)

    def see(self, storage: torch.UntypedStorage) -> int:
        """A storage's number, and its allocation when first seen."""
        number = self.ids.get(storage)
        if number is None:
            number = len(self.ids) + len(self.events) + 1
            self.ids[storage] = number
            nbytes = storage.nbytes()
            self.live[number] = nbytes
            self.events.append((number, nbytes))
            weakref.finalize(storage, self.freed, number)
        return number

    def freed(self, number: int) -> None:
        nbytes = self.live.pop(number, 0)
        if nbytes:
            self.events.append((number, -nbytes))

    def resized(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        number = self.see(storage)
        change = nbytes - self.live.get(number, 0)
        self.live[number] = nbytes
        if change:
            self.events.append((number, change))

    def number_of(self, t: torch.Tensor) -> int | None:
        if is_traceable_wrapper_subclass(t):  # a DTensor: its local tensor's operations are seen too
            return None
        try:
            return self.see(t.untyped_storage())
        except (RuntimeError, NotImplementedError):  # a tensor without storage
            return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        namespace = func.namespace
        out = func(*args, **kwargs)
        if namespace in ("c10d", "_c10d_functional", "_c10d_functional_autograd") and name in COLLECTIVES:
            self.record_collective(name, args, kwargs, out)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                number = self.number_of(t)
                if number is not None:
                    self.made_by.setdefault(number, f"{name} {tuple(t.shape)} {str(t.dtype)[6:]}")
        return out

    def record_collective(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        kind, which = COLLECTIVES[name]
        nbytes = _nbytes(out) if which == "out" else _nbytes(args[which])
        group = None
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
                group = dist.ProcessGroup.unbox(a)  # c10d's ops take the process group boxed
            elif isinstance(a, str) and func_takes_group_name(name):  # functional collectives: its name
                group = dist.distributed_c10d._resolve_process_group(a)
        ranks = dist.get_process_group_ranks(group) if group is not None else []
        label = next((dim for dim, groups in self.layouts.items() if sorted(ranks) in groups),
                     f"{len(ranks)} ranks")
        self.collectives.append(Collective(kind, label, len(ranks), nbytes))


def balanced(experts: int, ep: int, ep_rank: int, assignments: int) -> list[int]:
    """The MoE layer's counts under balanced routing (the cost model's assumption): what this rank
    sends to each of the ``experts``, then what each of the ``ep`` ranks sends to each of its own
    experts (every rank routes alike)."""
    each, more = divmod(assignments, experts)
    sent = [each + (e < more) for e in range(experts)]
    mine = sent[ep_rank * experts // ep:(ep_rank + 1) * experts // ep]
    return sent + mine * ep


class _Done:
    """A collective's handle whose future holds its tensor, as gloo's and NCCL's do (the fake
    group's holds nothing, and torch's compression hooks read it)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def wait(self, *args: Any) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result([self.tensor])
        return future


_all_reduce = dist.all_reduce


def all_reduce_with_value(tensor: torch.Tensor, *args: Any, async_op: bool = False, **kwargs: Any) -> Any:
    work = _all_reduce(tensor, *args, async_op=async_op, **kwargs)
    return _Done(tensor) if async_op else work


def allocated(module: torch.nn.Module, *, device: Any, recurse: bool = True) -> torch.nn.Module:
    from distributed.parallelize import allocate

    allocate(module, torch.device(device))
    return module


def real_tensors(function: Any) -> Any:
    """``function`` run with real tensors: a DeviceMesh reads its ranks' values."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def run(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return function(*args, **kwargs)

    return run


def static_stage_shapes(cfg: Any, local_batch: int) -> contextlib.AbstractContextManager:
    """torch's pipeline stages, given no example input and output, learn their neighbours'
    shapes at the first step from pickled objects the stages send each other, which a fake
    process group cannot carry. Given examples they skip that: each stage gets a fake
    micro-batch of its input (the image on the first stage, tokens on the others) and its own
    output for it, computed here in the run's precision."""
    from torch.distributed import pipelining

    from utils import device as dev

    original = pipelining.PipelineStage
    micro = local_batch // cfg.layout.num_microbatches
    (h, w), p = cfg.model.img_size, cfg.model.patch_size
    tokens = (h // p) * (w // p) // cfg.layout.context_parallel
    amp = "none" if cfg.layout.sharded else cfg.optim.amp_mode  # FSDP's policy casts itself

    def stage(submodule: torch.nn.Module, stage_index: int, num_stages: int, device: Any, *args: Any,
              **kwargs: Any) -> Any:
        shape = (micro, cfg.model.n_in_channels, *cfg.model.img_size) if stage_index == 0 \
            else (micro, tokens, cfg.model.embed_dim)
        example = torch.empty(shape, device=device, requires_grad=stage_index > 0)  # tokens: a gradient back
        with dev.autocast(torch.device(device), amp):  # (with autograd: the output needs a gradient)
            out = submodule(example)
        for module in submodule.modules():  # FSDP keeps the root's gathered weights after a forward
            if hasattr(module, "reshard"):
                module.reshard()
        return original(submodule, stage_index, num_stages, device, *args, input_args=(example,),
                        output_args=(out,), **kwargs)

    return mock.patch.object(pipelining, "PipelineStage", stage)


def own_pipeline_vote() -> contextlib.AbstractContextManager:
    """torch's pipeline schedules (2.13) start with a vote over the stages, read with ``.item()``,
    on whether the stages' shapes are static; a fake tensor has no value to read. Each stage here
    takes its own vote: the stages of one job vote alike (they are given the same shapes)."""
    from torch.distributed.pipelining import schedules

    original = getattr(schedules._PipelineSchedule, "_warmup_p2p", None)
    if original is None:
        return contextlib.nullcontext()
    mode = schedules.InferenceMode

    def own_vote(self: Any, stages: list[Any], has_backward: bool, *rest: Any) -> None:
        for stage in stages:
            stage._inference_mode = mode.DYNAMIC if mode.needs_dynamic(stage._user_meta, has_backward) \
                else mode.STATIC

    return mock.patch.object(schedules._PipelineSchedule, "_warmup_p2p", own_vote)


def resizes_seen(recorder: StepRecorder) -> contextlib.AbstractContextManager:
    """FSDP frees and re-allocates its gathered weights by resizing their storage in place."""
    original = torch.UntypedStorage.resize_

    def resize_(storage: torch.UntypedStorage, size: int) -> Any:
        result = original(storage, size)
        recorder.resized(storage, size)
        return result

    return mock.patch.object(torch.UntypedStorage, "resize_", resize_)


def peaks(events: list[tuple[int, int]], kind_of: dict[int, str]) -> tuple[dict[str, int], dict[str, int]]:
    """Replay the allocations: each kind's own peak, and what each held at the total's peak."""
    live = dict.fromkeys((*KINDS, "total"), 0)
    peak = dict(live)
    at_peak = dict(live)
    for number, change in events:
        kind = kind_of.get(number, "activations")
        if kind not in live:  # in host memory
            continue
        live[kind] += change
        live["total"] += change
        peak[kind] = max(peak[kind], live[kind])
        if live["total"] > peak["total"]:
            peak["total"] = live["total"]
            at_peak = dict(live)
    return peak, at_peak


def largest_at_peak(events: list[tuple[int, int]], kind_of: dict[int, str],
                    n: int = 5) -> list[tuple[int, int]]:
    """The ``n`` largest storages of activations and temporaries live at their kind's peak."""
    live: dict[int, int] = {}
    total = best = 0
    kept: dict[int, int] = {}
    for number, change in events:
        if kind_of.get(number, "activations") != "activations":
            continue
        live[number] = live.get(number, 0) + change
        total += change
        if total > best:
            best, kept = total, dict(live)
    return sorted(((v, k) for k, v in kept.items() if v), reverse=True)[:n]


# ------------------------------------------------------------------ playing one rank ---
def local_tensors(tensors: Any) -> list[torch.Tensor]:
    """The tensors behind parameters, gradients or states (a DTensor's local shard)."""
    out = []
    for t in tree_flatten(tensors)[0]:
        if isinstance(t, torch.Tensor):
            out.append(t.to_local() if hasattr(t, "to_local") else t)
    return out


def optimizer_states(optimizer: Any) -> list[torch.Tensor]:
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer holds torch's optimizer
    return local_tensors([list(s.values()) for s in inner.state.values()])


def layouts_of(cfg: Any, ranks: int, per_node: int) -> dict[str, list[list[int]]]:
    """Every group of the job as rank lists, by dimension (the mesh's, the experts', HSDP's),
    computed without a process group (distributed/mesh.py)."""
    from distributed import mesh as meshes

    layouts = meshes.group_layouts(ranks, meshes.requested_sizes(cfg.layout), cfg.layout.parallel_order)
    sizes = meshes.check_sizes(ranks, meshes.requested_sizes(cfg.layout), cfg.layout.parallel_order)
    if cfg.layout.expert_parallel > 1:
        layouts.update(meshes.expert_layouts(ranks, sizes, "-".join(sizes), cfg.layout.expert_parallel))
    if cfg.layout.hsdp:
        shard = meshes.hsdp_shard(cfg.layout, sizes[meshes.DATA], per_node)
        layouts.update(meshes.hsdp_layouts(ranks, shard))
    layouts["world"] = [list(range(ranks))]
    return layouts


def check_torch() -> None:
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < MIN_TORCH:
        raise ValueError(f"the dry run needs torch {'.'.join(map(str, MIN_TORCH))} or newer (this is "
                         f"{torch.__version__}: it has no fake kernels for some collectives)")


def play(job: Job, rank: int, checkpoint: bool = True) -> RankReport:
    """One step of ``rank`` of ``job``, on fake tensors over a fake process group, then (with
    ``checkpoint``) a checkpoint's gather of the weights."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from distributed import experts, mappings, sharding
    from distributed import mesh as meshes
    from training.launcher import arg_parser, check_layout, resolve_config, step_for
    from training.trainer import EagerStep

    check_torch()
    parsed = arg_parser().parse_args(job.args)
    cfg = resolve_config(parsed)
    if cfg.optim.enable_jit:  # compile's graphs are not traced here (its fused kernels keep less)
        cfg = cfg.replace(enable_jit=False)
    sizes, local_batch = check_layout(cfg, parsed.config, job.entry == "train_mp.py", job.ranks, job.per_node)
    step = step_for(cfg, EagerStep)
    refuse(cfg, step)
    layouts = layouts_of(cfg, job.ranks, job.per_node)
    if not 0 <= rank < job.ranks:
        raise ValueError(f"--rank {rank}: the job has ranks 0 to {job.ranks - 1}")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=job.ranks)
    with contextlib.ExitStack() as shims:
        # the values do not matter: a truncated normal's resampling asks for data, which a fake
        # tensor has not; where the ranks sit is computed, not gathered (a fake gather returns nothing)
        shims.enter_context(mock.patch.object(torch.nn.init, "trunc_normal_", lambda t, *a, **k: t))
        shims.enter_context(mock.patch.object(meshes, "log_placement", lambda mesh: None))
        shims.enter_context(mock.patch.object(experts, "gather_placement", lambda mesh, names: [
            ("dry run", {n: next(g for g in layouts[n] if r in g) for n in names})
            for r in range(job.ranks)]))
        shims.enter_context(own_pipeline_vote())
        shims.enter_context(static_stage_shapes(cfg, local_batch))
        shims.enter_context(mock.patch.object(dist, "all_reduce", all_reduce_with_value))
        backends = (*mappings.REDUCE_SCATTER_BACKENDS, "fake")  # the fake group reduce-scatters as NCCL
        shims.enter_context(mock.patch.object(mappings, "REDUCE_SCATTER_BACKENDS", backends))  # as NCCL
        shims.enter_context(mock.patch.object(experts, "host_counts", lambda counts, total: balanced(
            len(counts) // 2, cfg.layout.expert_parallel, mesh.coords.get("ep", 0), total)))
        shims.enter_context(mock.patch.object(sharding, "hsdp_mesh", real_tensors(sharding.hsdp_mesh)))
        shims.enter_context(mock.patch.dict(os.environ, LOCAL_WORLD_SIZE=str(job.per_node)))  # HSDP's groups
        if job.ranks == 1:  # Module.to_empty swaps each meta tensor for a fake one, which fake
            # tensors refuse; the parallel path's allocation makes new parameters instead
            shims.enter_context(mock.patch.object(torch.nn.Module, "to_empty", allocated))
        shims.callback(dist.destroy_process_group)
        mesh = meshes.build_mesh(meshes.requested_sizes(cfg.layout), cfg.layout.parallel_order, "cpu")
        shims.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        recorder = StepRecorder(layouts)
        kind_of, step_collectives = record_step(cfg, job, rank, mesh, local_batch, step, recorder, checkpoint)
        peak, at_peak = peaks(recorder.events[:recorder.step_events], kind_of)
        peak["checkpoint"] = peaks(recorder.events, kind_of)[0]["total"]
        largest = [(nbytes, recorder.made_by.get(number, "?"))
                   for nbytes, number in largest_at_peak(recorder.events[:recorder.step_events], kind_of, 3)]
        coords = dict(mesh.coords)
    predicted, predicted_coll = prediction(cfg, sizes, local_batch, job.per_node, coords)
    return RankReport(rank, coords, peak, at_peak, recorder.collectives[:step_collectives],
                      recorder.collectives[step_collectives:], predicted, predicted_coll, largest)


def record_step(cfg: Any, job: Job, rank: int, mesh: Any, local_batch: int, step: type,
                recorder: StepRecorder, checkpoint: bool = True) -> tuple[dict[int, str], int]:
    """Build the rank's Trainer and run its step under ``recorder``, then the checkpoint's gather.
    Returns each storage's kind and the number of collectives before the gather."""
    from training.context import RunContext
    from training.trainer import Trainer

    device = torch.device("cpu")
    kind_of: dict[int, str] = {}

    def mark(kind: str, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            number = recorder.number_of(t)
            if number is not None:
                kind_of.setdefault(number, kind)

    with tempfile.TemporaryDirectory() as run_dir:
        ctx = RunContext(device=device, run_dir=Path(run_dir), rank=rank, world_size=job.ranks,
                         local_rank=rank % job.per_node, mesh=mesh)
        with mock.patch.object(Trainer, "build_data", lambda self, split, train: NoBatches()):
            trainer = Trainer(cfg, ctx, local_batch, step=step)
        optimizer = trainer.optimizer

        def parameters() -> list[torch.Tensor]:  # the trainable ones
            return [p for group in optimizer.param_groups for p in group["params"]]

        with resizes_seen(recorder), recorder:
            inp = torch.empty((local_batch, cfg.model.n_in_channels, *cfg.model.img_size), device=device)
            tar = torch.empty((local_batch, cfg.model.n_out_channels, *cfg.model.img_size), device=device)
            # the batch is on the device where the rank's stages read it (a pipeline's first stage
            # the input, its last the target: training/pipelined.py), else in host memory
            if not getattr(trainer.model, "is_first", True):
                mark("host", [inp])
            if not getattr(trainer.model, "is_last", True):
                mark("host", [tar])
            mark("parameters", local_tensors(list(trainer.model.parameters()) + parameters()))
            hooks = [optimizer.register_step_pre_hook(lambda *_: mark("gradients", local_tensors(
                         [p.grad for p in parameters() if p.grad is not None]))),
                     optimizer.register_step_post_hook(
                         lambda *_: mark("optimizer_state", optimizer_states(optimizer)))]
            trainer.train_step(inp, tar)
            for hook in hooks:
                hook.remove()
            done = len(recorder.collectives)
            recorder.step_events = len(recorder.events)
            if checkpoint and cfg.layout.pipeline_parallel == 1:  # (a pipeline gathers pickled tensors)
                trainer.model_state()  # a checkpoint's gather of the weights
    return kind_of, done


def refuse(cfg: Any, step: type) -> None:
    """The layouts the dry run cannot play, in one line each."""
    if cfg.layout.engine == "deepspeed":
        raise ValueError("DeepSpeed's engine runs its own kernels and communication, which fake tensors "
                         "do not reach: dry-run its native equivalent (--data_parallel zero1 or fsdp)")


class NoBatches:
    """The data loader's place in a dry run's Trainer: the step is handed a fake batch instead."""

    batches_per_epoch = 1

    def set_epoch(self, *args: Any) -> None:
        pass

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def give_back(self, *args: Any) -> None:
        pass


def prediction(cfg: Any, sizes: dict[str, int], local_batch: int, per_node: int,
               coords: dict[str, int]) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
    """The cost model's memory and collective bytes of the rank at ``coords``."""
    from distributed import mesh as meshes

    mode = cfg.layout.data_parallel
    dp = sizes[meshes.DATA]
    shard = meshes.hsdp_shard(cfg.layout, dp, per_node) if mode == "hsdp" else 0  # 0: resolved per node
    lay = replace(cm.layout_from(cfg, math.prod(sizes.values())), batch=local_batch * dp, dp_shard=shard)
    m = cm.Model.from_config(cfg)
    dtype = "float32" if cfg.optim.amp_mode == "none" else "bfloat16"
    memory = cm.memory(m, lay, coords.get("pp", 0), coords.get("dp", 0), dtype=dtype)
    coll: dict[tuple[str, str], int] = {}
    element = 2 if cfg.layout.grad_compression in ("bf16", "fp16") else cm.E
    # the cost model's names of FSDP's group (all of dp) and of HSDP's all-reduce (across the groups)
    named = {"dp_shard": "dp" if mode == "fsdp" else "dp_shard",
             "dp": "dp_replicate" if mode == "hsdp" else "dp"}
    for kind, _, nbytes, _, dim in cm.collective_parts(m, lay, coords.get("pp", 0), with_dims=True,
                                                       dtype=dtype, grad_element=element):
        key = (kind, named.get(dim, dim))
        coll[key] = coll.get(key, 0) + nbytes
    return memory, coll


# ------------------------------------------------------------------ report ---
def collective_sums(report: RankReport) -> dict[tuple[str, str], int]:
    """Bytes of the step's collectives by (kind, dimension), the cost model's kinds included."""
    sums = dict.fromkeys(report.predicted_collectives, 0)
    for c in report.collectives:
        sums[(c.kind, c.group)] = sums.get((c.kind, c.group), 0) + c.nbytes
    return dict(sorted(sums.items()))


def table(report: RankReport) -> str:
    lines = [f"rank {report.rank} ({', '.join(f'{k} {v}' for k, v in report.coords.items())})",
             f"  {'memory (MiB)':<24}{'dry run':>12}{'cost model':>12}"]
    for kind in KINDS:
        lines.append(f"  {kind:<24}{report.peak[kind] / MIB:>12.1f}"
                     f"{report.predicted.get(kind, 0) / MIB:>12.1f}")
    unchecked = sum(v for k, v in report.predicted.items() if "not checked" in k)
    lines.append(f"  {'  + what it leaves out':<24}{'':>12}{unchecked / MIB:>12.1f}")
    lines.append(f"  {'peak of all':<24}{report.peak['total'] / MIB:>12.1f}"
                 f"{(report.predicted.get('total', 0) + unchecked) / MIB:>12.1f}")
    lines.append(f"  {'with the checkpoint':<24}{report.peak['checkpoint'] / MIB:>12.1f}")
    for nbytes, made in report.largest:  # what to shrink first: the operation, shape and dtype
        lines.append(f"  {'  largest: ' + made:<48}{nbytes / MIB:>10.1f}")
    lines.append(f"  {'collectives (MiB)':<24}{'dry run':>12}{'cost model':>12}")
    for key, nbytes in collective_sums(report).items():
        lines.append(f"  {key[0] + ' over ' + key[1]:<24}{nbytes / MIB:>12.1f}"
                     f"{report.predicted_collectives.get(key, 0) / MIB:>12.1f}")
    gathered = sum(c.nbytes for c in report.checkpoint)
    lines.append(f"  {'checkpoint gather':<24}{gathered / MIB:>12.1f}")
    return "\n".join(lines)


def default_ranks(job: Job) -> list[int]:
    """Rank 0, and the last pipeline stage's rank in its pipeline (it holds the head and the loss)."""
    from training.launcher import arg_parser, resolve_config

    cfg = resolve_config(arg_parser().parse_args(job.args))
    last = next(g for g in layouts_of(cfg, job.ranks, job.per_node)["pp"] if 0 in g)[-1]
    return sorted({0, last})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=None, help="the job's world size (with SCRIPT ARGS)")
    parser.add_argument("--rank", type=int, action="append", help="a rank to play (default: rank 0 and the "
                        "last pipeline stage's)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="sbatch ... or SCRIPT ARGS")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        job = job_from(shlex.split(" ".join(args.command)) if len(args.command) == 1 else args.command,
                       args.ranks)
        for rank in args.rank or default_ranks(job):
            print(table(play(job, rank)))
    except ValueError as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
