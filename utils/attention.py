"""Which scaled-dot-product-attention kernel the model's attention runs on.

``F.scaled_dot_product_attention`` has several implementations (kernels): *flash* (tiled,
never stores the N x N attention matrix), *efficient* (memory-efficient, CUDA only), *cudnn*
(CUDA only) and *math* (the plain softmax(q k^T / sqrt(d)) v in separate ops). torch picks one
by a fixed priority, which is right on a GPU but not always on a CPU: there the flash kernel's
backward in bf16 was measured up to several times slower than the math kernel for short
sequences (the optimizations page has the table), enough to make a whole mixed-precision step
slower than fp32.

The config key ``attention_kernel`` chooses: a kernel's name, ``default`` (torch's own
choice), or ``auto``. ``auto`` keeps torch's choice in fp32 (the parity tests' precision:
every layout then runs the same kernel without measuring anything) and, for bf16 and fp16,
times forward + backward of every kernel this device has on the run's attention shape once,
at start-up, and keeps the fastest, provided it beats torch's choice by ``MARGIN`` (so that
two runs of one command do not flip between two kernels of about the same speed, which
round differently). Every rank adds up the same timings, so all ranks choose alike; trainers
in one process reuse the first answer; a resumed run keeps the kernel its checkpoint names.
The choice is logged.
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

if TYPE_CHECKING:
    from utils.config import Config

log = logging.getLogger(__name__)

KERNELS: dict[str, SDPBackend] = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
CUDA_ONLY = ("efficient", "cudnn")
MARGIN = 1.25  # another kernel replaces torch's choice only when this many times faster
_chosen: dict[tuple, str] = {}  # (device, dtype, shape, kv_len) -> the kernel auto chose


def kernel(name: str) -> contextlib.AbstractContextManager:
    """The region in which every attention call uses kernel ``name`` ('default': torch's pick).
    Only the forward call needs it: autograd runs the backward that belongs to that kernel."""
    if name == "default":
        return contextlib.nullcontext()
    return sdpa_kernel(KERNELS[name])


def check_available(name: str, device: torch.device) -> None:
    """A one-line error for a kernel this device does not have."""
    if name in CUDA_ONLY and device.type != "cuda":
        raise ValueError(f"attention_kernel {name} runs only on CUDA GPUs; on {device.type} use auto, "
                         f"default, flash or math")


def call_shape(cfg: Config, micro_batch: int, tp: int = 1,
               cp: int = 1) -> tuple[tuple[int, int, int, int], int]:
    """One rank's attention call: the queries' shape (micro-batch, heads, tokens, head_dim) with
    tensor parallelism ``tp`` (heads split) and context parallelism ``cp`` (queries split, keys
    and values gathered whole), and the keys' length."""
    tokens = (cfg.img_size[0] // cfg.patch_size) * (cfg.img_size[1] // cfg.patch_size)
    shape = (max(1, micro_batch), cfg.num_heads // tp, math.ceil(tokens / cp), cfg.embed_dim // cfg.num_heads)
    return shape, tokens


def time_kernels(shape: tuple[int, int, int, int], kv_len: int, dtype: torch.dtype,
                 device: torch.device, reps: int = 3) -> dict[str, tuple[float, float]]:
    """Median seconds of one forward and of its backward, per kernel that runs here ('default':
    torch's own pick), for queries of ``shape`` (B, heads, N_q, head_dim) against ``kv_len``
    keys and values."""
    b, h, n, d = shape
    gen = torch.Generator(device=device).manual_seed(0)

    def leaf(length: int) -> torch.Tensor:
        t = torch.randn(b, h, length, d, generator=gen, device=device, dtype=dtype)
        return t.requires_grad_()

    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    q, k, v = leaf(n), leaf(kv_len), leaf(kv_len)
    times: dict[str, tuple[float, float]] = {}
    for name in ("default", *KERNELS):
        if name in CUDA_ONLY and device.type != "cuda":
            continue
        forward, backward = [], []
        try:
            with kernel(name):
                for i in range(reps + 1):  # the first call warms up (allocations, libraries)
                    t0 = clock()
                    out = F.scaled_dot_product_attention(q, k, v)
                    t1 = clock()
                    out.backward(torch.ones_like(out))
                    t2 = clock()
                    if i:
                        forward.append(t1 - t0)
                        backward.append(t2 - t1)
        except (RuntimeError, torch.cuda.OutOfMemoryError):  # not for these shapes or this device
            continue
        times[name] = (statistics.median(forward), statistics.median(backward))
    return times


def choose(setting: str, device: torch.device, dtype: torch.dtype,
           shape: tuple[int, int, int, int], kv_len: int, group=None) -> str:
    """The kernel to use for ``setting`` (see the module's docstring); collective when ``auto``
    times in a distributed run (every rank of ``group``, default the world, must call it)."""
    if setting != "auto":
        check_available(setting, device)
        return setting
    if dtype == torch.float32:
        return "default"
    key = (str(device), dtype, shape, kv_len)
    if key not in _chosen:
        timed = time_kernels((min(shape[0], 4), *shape[1:]), kv_len, dtype, device)
        _chosen[key] = fastest(agree({n: f + b for n, (f, b) in timed.items()}, device, group))
        log.info("attention kernel %s for %s on %s", _chosen[key], str(dtype).removeprefix("torch."),
                 device.type)
    return _chosen[key]


def fastest(times: dict[str, float]) -> str:
    """The fastest kernel of ``times``, unless torch's own pick ('default') is within MARGIN."""
    default = times.get("default")
    named = {n: t for n, t in times.items() if n != "default"}
    if not named:
        return "default"
    best = min(named, key=named.get)
    log.info("attention forward + backward per call: %s",
             ", ".join(f"{n} {1e3 * t:.2f} ms" for n, t in sorted(times.items(), key=lambda x: x[1])))
    return "default" if default is not None and named[best] * MARGIN > default else best


def agree(times: dict[str, float], device: torch.device, group=None) -> dict[str, float]:
    """Every rank's timings summed (the kernels every rank could run), so all ranks decide alike;
    the timings themselves in a single process."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return times
    everyone: list = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(everyone, list(times), group=group)
    names = [n for n in times if all(n in other for other in everyone)]  # same order on every rank
    backend = str(torch.distributed.get_backend(group))
    total = torch.tensor([times[n] for n in names], dtype=torch.float64,
                         device=device if "nccl" in backend else "cpu")
    torch.distributed.all_reduce(total, group=group)
    return dict(zip(names, total.cpu().tolist()))
