"""Everything that differs between a GPU and a CPU run, in one place.

Nothing else in the project calls ``torch.cuda`` directly: device choice, the
process-group backend, autocast, the gradient scaler, synchronisation, memory
statistics, NVTX ranges and the CUDA profiler switch all live here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

AMP_DTYPES = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def cuda_available() -> bool:
    return torch.cuda.is_available()


def gpu_count() -> int:
    """Visible CUDA GPUs (0 without CUDA)."""
    return torch.cuda.device_count() if cuda_available() else 0


def slurm_task(environ: dict[str, str] | None = None) -> bool:
    """Whether this process is a task of an srun step (not a rank that torchrun started inside
    one): Slurm then gives it CPUs (and, with --gpus-per-task, a GPU) of its own."""
    env = os.environ if environ is None else environ
    return "SLURM_STEP_ID" in env and "TORCHELASTIC_RUN_ID" not in env


def node_name(env: dict[str, str] | None = None) -> str:
    """This process's node: Slurm's name for it (SLURMD_NODENAME, set in every task), else the
    host name. They are the same on most clusters; they differ where several Slurm nodes share
    one machine (the tests' two-node cluster)."""
    env = os.environ if env is None else env
    return env.get("SLURMD_NODENAME") or socket.gethostname()


def pick_device(local_rank: int = 0, local_world_size: int = 1,
                environ: dict[str, str] | None = None, share_gpus: bool = False) -> torch.device:
    """The GPU of this local rank when CUDA is there, else the CPU.

    One GPU per rank: two ranks on one GPU fail in NCCL (or run slowly and share memory),
    so more ranks on a node than visible GPUs is a user mistake, reported in one line. An
    srun task that sees exactly one GPU was given it (`--gpus-per-task=1` binds each task to
    its own GPU, which it sees as GPU 0), so it takes that one whatever its local rank.
    ``share_gpus`` (gloo on GPUs, which NCCL's one-rank-per-GPU rule does not bind): ranks
    take the visible GPUs in turn.
    """
    if not cuda_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if count == 1 and local_world_size > 1 and slurm_task(environ):
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    if share_gpus:
        torch.cuda.set_device(local_rank % count)
        return torch.device("cuda", local_rank % count)
    if local_world_size > count:
        raise ValueError(f"{local_world_size} ranks on this node but {count} visible GPU(s) "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                         f"start at most one rank per GPU (--nproc_per_node / --ntasks-per-node), "
                         f"or hide the GPUs with CUDA_VISIBLE_DEVICES= to train on the CPU")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def this_rank_device(kind: str) -> torch.device:
    """This process's device of type ``kind`` ("cuda": its current GPU), where a process group of
    that device type runs its collectives."""
    return torch.device(kind, torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)


def backend_for(device: torch.device, choice: str = "auto") -> str:
    """The process-group backend: NCCL on GPUs, gloo on CPUs, unless ``choice`` names one."""
    if choice == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    return choice


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity (what srun's -c and binding, taskset or a
    container leave it), not the node's count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1  # macOS: no affinity masks


def cpu_threads(ranks_on_node: int, environ: dict[str, str] | None = None) -> int:
    """Threads for torch's CPU work in this rank. A task of an srun step has CPUs of its own
    (the submit scripts give each task `-c` CPUs, bound); ranks that torchrun (or a plain
    start) put on one node share the CPUs they all see, so they split them."""
    own = slurm_task(environ)
    return max(1, usable_cpus() if own else usable_cpus() // max(1, ranks_on_node))


def set_cpu_threads(ranks_on_node: int) -> None:
    """Give this rank its share of the usable CPUs, unless the user chose OMP_NUM_THREADS."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    torch.set_num_threads(cpu_threads(ranks_on_node))


def configure_matmul(device: torch.device, allow_tf32: bool = True) -> None:
    """TF32 tensor cores for fp32 matmuls on Ampere and newer (no effect on CPU)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
        torch.backends.cudnn.allow_tf32 = allow_tf32


def autocast(device: torch.device, amp_mode: str,
             cache_enabled: bool = True) -> contextlib.AbstractContextManager:
    """Mixed-precision region for the forward pass; a no-op for amp_mode 'none'.
    ``cache_enabled=False`` for CUDA graph capture (cached casts would outlive the graph)."""
    dtype = AMP_DTYPES[amp_mode]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype, cache_enabled=cache_enabled)


def low_precision_slowdown(device: torch.device, amp_mode: str, n: int = 256, reps: int = 3) -> float:
    """How many times longer a square matmul takes in ``amp_mode``'s dtype than in fp32 on this
    CPU (best of ``reps``); 1.0 on a GPU or without autocast. A CPU without bf16 (or fp16)
    arithmetic has no fast kernel for them, and torch computes them in generic code: 10 to 60
    times slower than fp32 measured on an AMD EPYC with AVX2 only (torch 2.13)."""
    dtype = AMP_DTYPES[amp_mode]
    if dtype is None or device.type != "cpu":
        return 1.0
    best = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core's speed: threads waiting on a busy machine would blur it
    try:
        for dt in (torch.float32, dtype):
            a, b = torch.ones(n, n, dtype=dt), torch.ones(n, n, dtype=dt)
            a @ b  # first call: kernel choice, buffers
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                a @ b
                times.append(time.perf_counter() - start)
            best[dt] = min(times)
    finally:
        torch.set_num_threads(threads)
    return best[dtype] / max(best[torch.float32], 1e-9)


def make_grad_scaler(device: torch.device, amp_mode: str) -> torch.amp.GradScaler | None:
    """fp16 needs loss scaling to keep small gradients from underflowing; bf16 does not."""
    if amp_mode != "fp16":
        return None
    return torch.amp.GradScaler(device.type)


def adam_kernel(fused: bool) -> dict[str, bool]:
    """Adam's implementation: fused (one kernel per step, the ladder's --enable_fused), else the
    multi-tensor ``foreach`` path. torch picks foreach by default only for CUDA tensors; on CPU
    it is bit-identical to the single-tensor loop and measured 1.6 to 2.7 times faster for the
    tiny and small models here."""
    return {"fused": True} if fused else {"foreach": True}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int | None:
    """Allocator peak on CUDA; None on CPU, where there is no allocator to ask."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return None


def process_peak_rss_bytes() -> int:
    """The largest resident memory this process has had since it started or since
    reset_process_peak: Linux's VmHWM, else the resource module's maximum (Linux reports KiB)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_process_peak() -> None:
    """Start the resident-memory peak again from now (Linux; elsewhere nothing happens)."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # 5: reset the peak resident set size (VmHWM) to the current one


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)  # also seeds every CUDA device


def rng_state(device: torch.device) -> dict:
    """The CPU generator's state and, on a GPU, that of this rank's device only: saving one per
    visible GPU (get_rng_state_all) would fail to load where fewer GPUs are visible."""
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda_device"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda_device" in state:
        torch.cuda.set_rng_state(state["cuda_device"], device)


# Extra context managers entered around every named range (scripts/benchmark.py times the
# trainer's phases with CUDA events through this; nothing in training uses it).
RANGE_HOOKS: list[Callable[[str], contextlib.AbstractContextManager]] = []


@contextlib.contextmanager
def nvtx_range(name: str) -> Iterator[None]:
    """A named range: NVTX for Nsight Systems on CUDA, a profiler label everywhere.

    ``torch.cuda.nvtx`` raises on CPU-only builds, so it is only touched with CUDA.
    """
    use_nvtx = cuda_available()
    if use_nvtx:
        torch.cuda.nvtx.range_push(name)
    try:
        with torch.profiler.record_function(name), contextlib.ExitStack() as hooks:
            for hook in RANGE_HOOKS:
                hooks.enter_context(hook(name))
            yield
    finally:
        if use_nvtx:
            torch.cuda.nvtx.range_pop()


def timing_event(device: torch.device) -> torch.cuda.Event:
    """A CUDA event that records a time stamp on the current stream."""
    return torch.cuda.Event(enable_timing=True)


def copies_done(device: torch.device) -> torch.cuda.Event | None:
    """An event recorded on the current stream after the work queued so far (copies, say), or
    None on a CPU, where that work is already done."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def gpu_facts(index: int = 0) -> dict:
    """Name, memory, compute capability and count of the GPUs, and the NCCL and cuDNN versions."""
    props = torch.cuda.get_device_properties(index)
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # a build without NCCL
        nccl = None
    return {"name": props.name, "memory_bytes": props.total_memory,
            "capability": f"{props.major}.{props.minor}", "count": torch.cuda.device_count(),
            "nccl": nccl, "cudnn": torch.backends.cudnn.version()}


def cuda_profiler_start() -> None:
    """Open the capture window of `nsys profile -c cudaProfilerApi` (no-op on CPU)."""
    if cuda_available():
        torch.cuda.cudart().cudaProfilerStart()


def cuda_profiler_stop() -> None:
    if cuda_available():
        torch.cuda.cudart().cudaProfilerStop()


def require_cuda(feature: str) -> None:
    """Exit with one line when a GPU-only feature is asked for on a machine without CUDA."""
    if not cuda_available():
        raise SystemExit(f"{feature} need a GPU with CUDA; this machine has none. "
                         f"Run train.py instead.")


def new_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


@contextlib.contextmanager
def on_stream(stream: torch.cuda.Stream, device: torch.device) -> Iterator[None]:
    """Run the block on ``stream`` (a side stream kept for the whole run), ordered after the
    work already queued on the current stream and joined back into it afterwards."""
    current = torch.cuda.current_stream(device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        yield
    current.wait_stream(stream)


def current_stream_handle(device: torch.device) -> int:
    """The raw cudaStream_t of torch's current stream (for libraries such as DALI)."""
    return torch.cuda.current_stream(device).cuda_stream


def new_cuda_graph() -> torch.cuda.CUDAGraph:
    return torch.cuda.CUDAGraph()


def graph_capture(graph: torch.cuda.CUDAGraph,
                  stream: torch.cuda.Stream) -> contextlib.AbstractContextManager:
    """Record the CUDA work of the block, queued on ``stream``, into ``graph`` instead of running it.

    ``thread_local``: capture forbids unsafe CUDA calls (cudaMalloc, cudaHostAlloc, ...) only
    in this thread. The default ("global") would also fail the DataLoader's pin-memory
    thread, which allocates pinned host memory while we capture in the middle of an epoch.
    """
    return torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local")


def environment_summary(device: torch.device) -> str:
    """Versions of torch, CUDA, NCCL and DALI, and the GPUs, for the top of a job's log."""
    parts = [f"torch {torch.__version__}"]
    if device.type == "cuda":
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        parts += [f"CUDA {torch.version.cuda}", f"NCCL {nccl}",
                  f"{torch.cuda.device_count()} GPU(s): {', '.join(names)}"]
    else:
        parts.append(f"CPU only: {cpu_description()}, {torch.get_num_threads()} threads")
    parts.append(f"DALI {dali_version() or 'not installed'}")
    return "; ".join(parts)


# the widest matrix instructions a CPU has, as /proc/cpuinfo names them, widest first: what decides
# how fast its bf16 matmuls are (without bf16 instructions torch computes them in generic code)
INSTRUCTION_SETS = (("amx_bf16", "AMX"), ("avx512_bf16", "AVX-512 BF16"), ("avx512f", "AVX-512"),
                    ("avx2", "AVX2"))


def cpu_description(cpuinfo: str | None = None) -> str:
    """'Intel(R) Xeon(R) Processor, AMX': the CPU's model and its widest matrix instructions (Linux;
    elsewhere the platform's processor name), for every measured number's label."""
    import platform

    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                  if line.startswith("model name")), None) or platform.processor() or platform.machine()
    flags = set(next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines()
                      if line.startswith("flags")), []))
    isa = next((name for flag, name in INSTRUCTION_SETS if flag in flags), None)
    return f"{model}, {isa}" if isa else model


def dali_version() -> str | None:
    """The installed DALI's version, read from package metadata (importing DALI takes seconds)."""
    from importlib import metadata

    for cuda in ("130", "120", "110"):
        try:
            return metadata.version(f"nvidia-dali-cuda{cuda}")
        except metadata.PackageNotFoundError:
            continue
    return None
