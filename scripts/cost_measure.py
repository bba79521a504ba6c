#!/usr/bin/env python
"""What scripts/cost_model.py predicts, measured: one layout's real training run, and this
machine's constants (`--calibrate`).

A layout's run is train.py's (or train_mp.py's) own loop on `--num_iters` steps, with a Trainer
that counts, on every rank:

* the bytes each collective moves in a training step (its payload: the tensor an all-reduce or
  broadcast reduces, an all-gather's whole output, a reduce-scatter's whole input, what a
  point-to-point send or receive carries; DDP's gradient all-reduce through a comm hook, as it
  runs in C++). Object collectives (the pipeline shares its loss as a Python number) are not
  tensors and are not counted;
* the FLOPs of one step (torch.utils.flop_counter.FlopCounterMode: matmuls, convolutions and
  attention), in a step that is not timed;
* the peak of the bytes autograd keeps for backward (utils/profiling.SavedTensorMeter);
* the bytes of parameters, gradients and optimizer state this rank holds after a step;
* the seconds of each later step (the ranks start it together, after a barrier).

Rank 0 collects every rank's record into RUN_DIR/cost_measure.json.

The calibration (`calibrate`) times, in processes started together as ranks are: matmuls of a
given size per dtype, and all-reduce, all-gather and point-to-point transfers of growing sizes,
and fits latency + bytes / bandwidth to them.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from training.trainer import Callback  # noqa: E402
from utils.profiling import SavedTensorMeter  # noqa: E402

RECORD_FILE = "cost_measure.json"


# ------------------------------------------------------------ activations ---
class ActivationMeter(SavedTensorMeter):
    """Saved tensors, weights left out: a linear layer saves its weight as ``weight.t()``, a
    view made in forward, not the Parameter object; such a view has one input in the
    graph, the parameter's gradient accumulator, and shares its storage. (Under autocast a
    layer saves a bf16 copy of its weight instead: new memory, counted.)"""

    def pack(self, t: torch.Tensor) -> object:
        fn = t.grad_fn
        if fn is not None and len(fn.next_functions) == 1:
            source = getattr(fn.next_functions[0][0], "variable", None)
            if isinstance(source, torch.nn.Parameter) and \
                    t.untyped_storage().data_ptr() == source.untyped_storage().data_ptr():
                return t
        return super().pack(t)


# ------------------------------------------------------------ the worker (one rank) ---
def worker(argv: list[str]) -> int:
    from training.launcher import main

    model_parallel = "--model_parallel" in argv
    argv = [a for a in argv if a != "--model_parallel"]
    return main(argv=argv, description="a training run measuring its costs", model_parallel=model_parallel,
                callbacks=[CostMeter()])


class CostMeter(Callback):
    """The measurements of a layout's run (a callback of training/trainer.py's Trainer): step
    ``FLOP_STEP`` counts FLOPs, step ``BYTE_STEP`` bytes (collectives, saved activations, what
    the rank holds), every later step is timed; at the end rank 0 writes every rank's record."""

    FLOP_STEP, BYTE_STEP = 1, 2  # untimed steps: counting costs time

    def __init__(self) -> None:
        from scripts.instruments import CollectiveCounter

        self.collectives = CollectiveCounter().install()
        self.record: dict[str, Any] = {"seconds": [], "flops": 0, "saved_peak_bytes": 0}
        self.stack = contextlib.ExitStack()

    def model_built(self, trainer: Any) -> None:
        from scripts.instruments import count_ddp_gradients

        count_ddp_gradients(trainer.model, trainer.ctx.dp_group)

    def step_start(self, trainer: Any) -> None:
        import torch.distributed as dist
        from torch.utils.flop_counter import FlopCounterMode

        from utils import attention
        from utils import device as dev

        index = len(self.record["seconds"])
        if index == self.FLOP_STEP:
            # attention by the math kernel in this step: FlopCounterMode counts its matmuls (it does
            # not know the CPU's fused attention kernel and would count 0); around the whole step
            # too: activation checkpointing recomputes attention in backward
            self.stack.enter_context(trainer.attention_kernel_as("math"))
            self.flops = self.stack.enter_context(FlopCounterMode(display=False))
            self.stack.enter_context(attention.kernel("math"))
        elif index == self.BYTE_STEP:
            self.meter = ActivationMeter()
            self.stack.enter_context(self.collectives.counting(reset=True))
            hooks = torch.autograd.graph.saved_tensors_hooks(self.meter.pack, self.meter.unpack)
            self.stack.enter_context(hooks)
        else:
            if dist.is_initialized():
                dist.barrier()  # the ranks start the step together
            dev.synchronize(trainer.device)
            self.start = time.perf_counter()

    def step_end(self, trainer: Any, loss: torch.Tensor) -> None:
        from utils import device as dev

        index = len(self.record["seconds"])
        self.stack.close()
        if index == self.FLOP_STEP:
            by_op = {str(op): n for op, n in self.flops.get_flop_counts()["Global"].items()}
            self.record.update(flops=self.flops.get_total_flops(), flops_by_op=by_op)
            self.record["seconds"].append(None)
        elif index == self.BYTE_STEP:
            self.record.update(saved_peak_bytes=self.meter.peak, comm_bytes=dict(self.collectives.bytes),
                               comm_calls=dict(self.collectives.calls), held=held_now(trainer),
                               pp_rank=trainer.ctx.mesh.rank_in("pp"), dp_rank=trainer.ctx.mesh.rank_in("dp"))
            self.record["seconds"].append(None)
        else:
            dev.synchronize(trainer.device)
            self.record["seconds"].append(time.perf_counter() - self.start)

    def fit_end(self, trainer: Any) -> None:
        import torch.distributed as dist

        records = [{"rank": trainer.ctx.rank, **self.record}]
        if dist.is_initialized():
            records = [None] * dist.get_world_size()
            dist.all_gather_object(records, {"rank": trainer.ctx.rank, **self.record})
        if trainer.ctx.is_main:
            (trainer.ctx.run_dir / RECORD_FILE).write_text(json.dumps(records))


def held_now(trainer: Any) -> dict[str, int]:
    """Bytes the rank holds after the step, by kind, with the gradients a step holds (zero_grad
    freed them before this is read)."""
    from distributed.shards import local

    held = trainer.held_bytes()
    if "step_gradients" not in held:
        held["step_gradients"] = sum(local(p).numel() * local(p).element_size()
                                     for p in trainer.model.parameters() if p.requires_grad)
    return held


# ------------------------------------------------------------------ the driver ---
def measure_layout(name: str, ranks: int, flags: list[str], out: Path, config: str,
                   yaml_config: str | None = None, steps: int = 10) -> list[dict[str, Any]]:
    """Train ``config`` in the layout ``flags`` on ``ranks`` ranks for ``steps`` steps; every
    rank's record (see the module's docstring)."""
    from scripts.workers import run_worker, worker_env

    flags = [f"--config={config}", f"--run_num={name}", f"--expdir={out}", f"--num_iters={steps}",
             "--checkpoint_every=0", "--limit_nsamples_val=8", "--model_parallel", *flags]
    if yaml_config:
        flags.insert(0, f"--yaml_config={yaml_config}")
    run_worker(__file__, ranks, flags, worker_env())
    run_dir = next((out / config).glob(f"*/{name}"))
    return json.loads((run_dir / RECORD_FILE).read_text())


# ------------------------------------------------------------------ calibration ---
CALIBRATION_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "all_to_all")
CALIBRATION_SIZES = (2**12, 2**18, 2**20, 2**22)  # payload bytes
BROADCAST_BATCH = 8  # broadcasts in one timed call (their latency per call is what is fitted)


def layer_products(tokens: int, k: int, n: int, dtype: torch.dtype,
                   device: torch.device) -> tuple[Callable[[], Any], int]:
    """A linear layer of ``k`` features to ``n`` over ``tokens`` rows, its three matmuls as a
    training step runs them: forward x (tokens, k) @ w^T, the input's gradient g (tokens, n) @ w,
    the weight's g^T @ x (transposed operands run at other speeds than a plain product). Returns
    the call that runs the three and their FLOPs (2 per multiply-add, 2 * tokens * k * n each)."""
    x, w, g = (torch.randn(*shape, dtype=dtype, device=device)
               for shape in ((tokens, k), (n, k), (tokens, n)))
    return (lambda: (x @ w.t(), g @ w, g.t() @ x)), 3 * 2 * tokens * k * n


def seconds_per_call(fn: Callable[[], Any], device: torch.device, seconds: float, group: bool) -> float:
    """``fn``'s time per call: as many calls as make about ``seconds`` (one, when the first alone
    took longer: bf16 on a CPU without bf16 arithmetic, seconds for one large product); with a
    process group, the same number on every rank, started together, timed until the last is done."""
    import torch.distributed as dist

    from utils import device as dev

    start = time.perf_counter()
    fn()
    dev.synchronize(device)
    runs, slow = 0, time.perf_counter() - start > seconds
    start = time.perf_counter()
    while not slow and time.perf_counter() - start < seconds / 5:
        fn()
        dev.synchronize(device)
        runs += 1
    calls = torch.tensor([max(1, 5 * runs)], device=device)
    if group:  # the same number on every rank
        dist.all_reduce(calls, op=dist.ReduceOp.MIN)
        dist.barrier()
    start = time.perf_counter()
    for _ in range(int(calls)):
        fn()
    dev.synchronize(device)
    if group:
        dist.barrier()
    return (time.perf_counter() - start) / int(calls)


def compute_rates(seconds: float = 0.25) -> dict[str, Any]:
    """This rank's achieved matmul FLOP/s per dtype: "large", a 1024 x 1024 x 1024 product;
    "small", a small model's layer (2048 tokens of 128 features to 384), its three products as a
    step runs them (forward, the input's gradient, the weight's: transposed operands run at other
    speeds); "attention", the fused attention kernel the trainer takes for the dtype (16 samples,
    4 heads, 128 tokens of 32), forward and backward, per FLOP of its two products. Also memory
    bandwidth (bytes read + written by an add of 64 MiB tensors) and Adam's seconds per
    parameter (torch's default implementation on a million parameters in 8 tensors).

    With several ranks (a process group) every rank does the same number of calls, started
    together, and the time is until the last one is done: ranks that share cores share them
    over the whole measurement, as in a training step, whatever the scheduler did meanwhile.

    The matmuls run under the Trainer's settings (utils.device.configure_matmul: TF32 for fp32
    on a GPU); true fp32 would be several times slower on Ampere and newer than training is."""
    import torch
    import torch.distributed as dist

    from utils import device as dev

    group = dist.is_initialized()
    device = calibration_device()
    dev.configure_matmul(device)

    def timed(fn) -> float:
        return seconds_per_call(fn, device, seconds, group)

    from utils import attention

    out: dict[str, Any] = {"matmul_flops": {}}
    for dtype in (torch.float32, torch.bfloat16):
        rates = {}
        a, b = (torch.randn(1024, 1024, dtype=dtype, device=device) for _ in range(2))
        rates["large"] = 2 * 1024**3 / timed(lambda a=a, b=b: a @ b)
        products, flops = layer_products(2048, 128, 384, dtype, device)
        rates["small"] = flops / timed(products)
        shape = (16, 4, 128, 32)  # (batch, heads, tokens, head dim)
        q, key, v = (torch.randn(shape, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
        grad = torch.randn(shape, dtype=dtype, device=device)
        chosen = attention.choose("auto", device, dtype, shape[2])

        def attend(q=q, key=key, v=v, grad=grad, chosen=chosen) -> None:
            with attention.kernel(chosen):
                out = torch.nn.functional.scaled_dot_product_attention(q, key, v)
            out.backward(grad)

        b_, h, n, d = shape  # q k^T and (..) v: 2 n n d each per head, forward and twice in backward
        rates["attention"] = 3 * 2 * (2 * b_ * h * n * n * d) / timed(attend)
        out["matmul_flops"][str(dtype).removeprefix("torch.")] = rates
    x, y = torch.randn(2**24, device=device), torch.randn(2**24, device=device)
    out["memory_bandwidth"] = 3 * x.numel() * 4 / timed(lambda: torch.add(x, y))
    params = [torch.nn.Parameter(torch.randn(2**17, device=device)) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    adam = torch.optim.Adam(params, lr=1e-3)
    out["adam_seconds_per_parameter"] = timed(adam.step) / 2**20
    return out


def calibration_device() -> torch.device:
    """This rank's GPU (NCCL), or the CPU (gloo)."""
    from utils import device as dev

    if dev.cuda_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def collective_call(kind: str, n: int, world: int, rank: int):
    """A function that runs collective ``kind`` on a payload of ``n`` fp32 elements (and waits for
    it: on a GPU, until the device is done)."""
    from utils import device as dev

    device = calibration_device()
    x = torch.ones(n, device=device)
    call = collective_on(kind, x, n, world, rank)
    return lambda: (call(), dev.synchronize(device))


def collective_on(kind: str, x: torch.Tensor, n: int, world: int, rank: int):
    """The call of collective ``kind`` on ``x`` (``n`` elements) and the buffers it needs."""
    import torch.distributed as dist

    if kind == "all_reduce":
        return lambda: dist.all_reduce(x)
    if kind == "broadcast":  # as ZeRO-1 broadcasts its tensors: all issued at once, then waited for
        parts = list(x.chunk(BROADCAST_BATCH))
        return lambda: [w.wait() for w in [dist.broadcast(t, src=0, async_op=True) for t in parts]]
    if kind == "all_gather":  # payload: the whole output
        part, parts = x[: n // world].clone(), [torch.empty_like(x[: n // world]) for _ in range(world)]
        return lambda: dist.all_gather(parts, part)
    if kind == "reduce_scatter":  # payload: the whole input
        out = torch.empty_like(x[: n // world])
        return lambda: dist.reduce_scatter_tensor(out, x)
    if kind == "all_to_all":
        out = torch.empty_like(x)
        return lambda: dist.all_to_all_single(out, x)
    # send: a pair of ranks exchanging, rank r sends to r + 1 and receives from r - 1
    buf = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, (rank + 1) % world), dist.P2POp(dist.irecv, buf, (rank - 1) % world)]
    return lambda: [w.wait() for w in dist.batch_isend_irecv(ops)]


def busy(seconds: float) -> None:
    """Matmuls for about ``seconds`` (the computation between two collectives in a step), done
    when it returns: on a GPU the host only queues them, and a collective timed right after would
    wait behind the queue."""
    from utils import device as dev

    a = torch.randn(256, 256, device=calibration_device())
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ a
        dev.synchronize(a.device)  # each one done before the clock is read again


def calibration_worker(calls: int = 30, seconds: float = 0.25) -> int:
    """One rank of the collectives' calibration (torchrun, gloo): each collective and size timed
    over 30 calls; rank 0 prints {kind: [[bytes, seconds], ...]} as JSON, and, started with
    every rank busy at once, this rank's compute rates (as a layout's ranks share the cores)."""
    import torch
    import torch.distributed as dist

    from utils import device as dev

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device = dev.pick_device(int(os.environ.get("LOCAL_RANK", "0")),
                             int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    dist.init_process_group(dev.backend_for(device))
    world, rank = dist.get_world_size(), dist.get_rank()
    dist.barrier()
    rates = compute_rates(seconds)
    every = [None] * world
    dist.all_gather_object(every, rates)
    times: dict[str, list[list[float]]] = {}
    for kind in CALIBRATION_KINDS if world > 1 else ():
        for size in CALIBRATION_SIZES:
            run = collective_call(kind, size // 4, world, rank)
            run()
            seconds = []
            for _ in range(calls):  # each call timed as training meets it: right after some compute
                # (a rank that has just computed finds the others a little early or late, and gloo's
                # threads wake on busy cores); the mean of the calls, slow ones included, as a
                # step's many calls add up to it
                busy(0.005)
                start = time.perf_counter()
                run()
                seconds.append(time.perf_counter() - start)
            times.setdefault(kind, []).append([size, sum(seconds) / len(seconds)])
    dist.barrier()
    if rank == 0:
        print(json.dumps({"collectives": times, "compute": every}), flush=True)
    os._exit(0)  # no teardown: gloo's transfer threads abort the interpreter's exit otherwise


def fit_latency_bandwidth(points: list[list[float]]) -> tuple[float, float]:
    """t = latency + bytes / bandwidth: the latency is the fastest call's time (gloo on a busy CPU
    has slow moments even for small payloads), the bandwidth the least-squares fit of the larger
    payloads through that latency."""
    latency = min(t for _, t in points)
    rest = sorted(points)[1:]
    slope = sum(x * (y - latency) for x, y in rest) / sum(x * x for x, _ in rest)
    return latency, 1.0 / max(slope, 1e-15)


def rank_limit() -> int | None:
    """The most ranks this machine runs at once: one per GPU (NCCL refuses two ranks on one GPU);
    None on a CPU, whose gloo ranks share the cores."""
    from utils import device as dev

    return dev.gpu_count() or None


def ranks_that_fit(ranks: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``ranks`` split into those this machine can start and those it cannot (rank_limit)."""
    limit = rank_limit()
    return (tuple(r for r in ranks if limit is None or r <= limit),
            tuple(r for r in ranks if limit is not None and r > limit))


def calibrate(ranks: tuple[int, ...] = (1, 2, 4), calls: int = 30, seconds: float = 0.25) -> dict[str, Any]:
    """This machine's constants: compute rates with 1, 2 and 4 ranks busy at once, collectives
    over 2 and 4 ranks (gloo); on a GPU machine, of those, the counts it has GPUs for."""
    import platform
    import subprocess

    import torch

    from scripts.workers import worker_env
    from utils import device as dev

    env = worker_env()
    ranks, left_out = ranks_that_fit(ranks)
    if left_out:
        print(f"calibrating on {', '.join(map(str, ranks))} rank(s) at once; left out "
              f"{', '.join(map(str, left_out))}: this machine has {rank_limit()} GPU(s)", flush=True)
    if not ranks:
        raise SystemExit("error: no rank count to calibrate fits this machine; give --calibrate_ranks 1")

    gpu = dev.gpu_facts(0)["name"] if dev.cuda_available() else None
    cpu = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, gloo"
    where = f"{gpu}, NCCL" if gpu else cpu
    result: dict[str, Any] = {"name": f"this machine: {where}, torch {torch.__version__}",
                              "source": "measured by scripts/cost_model.py --calibrate",
                              # a GPU computes while NCCL's kernels move gradients; gloo's threads share
                              # the CPU's cores with the computation
                              "overlap": 1.0 if gpu else 0.0, "cores": None if gpu else os.cpu_count(),
                              "by_ranks": {}}
    for r in ranks:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={r}",
               str(Path(__file__).resolve()), "--calibration-worker", str(calls), str(seconds)]
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"error: the calibration on {r} ranks failed:\n{done.stderr[-2000:]}")
        data = json.loads(done.stdout.strip().splitlines()[-1])
        every = data["compute"]
        mean = lambda get, every=every: sum(get(c) for c in every) / len(every)
        first = every[0]["matmul_flops"]
        entry = {"matmul_flops": {d: {s: mean(lambda c, d=d, s=s: c["matmul_flops"][d][s]) for s in first[d]}
                                  for d in first},
                 "memory_bandwidth": mean(lambda c: c["memory_bandwidth"]),
                 "adam_seconds_per_parameter": mean(lambda c: c["adam_seconds_per_parameter"])}
        if r > 1:
            entry["collectives"] = {k: list(fit_latency_bandwidth(v)) for k, v in data["collectives"].items()}
            entry["collectives"]["broadcast"][0] /= BROADCAST_BATCH  # the latency of one of the batch
        result["by_ranks"][str(r)] = entry
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["--calibration-worker"]:
        sys.exit(calibration_worker(int(sys.argv[2]), float(sys.argv[3])))
    if sys.argv[1:2] == ["--worker"]:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        sys.exit(worker(sys.argv[2:]))
    raise SystemExit("usage: run through scripts/cost_model.py --check (this is its worker)")
