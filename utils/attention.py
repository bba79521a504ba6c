"""Which scaled-dot-product-attention kernel the model's attention runs on.

``F.scaled_dot_product_attention`` has several implementations (kernels): *flash* (tiled,
never stores the N x N attention matrix), *efficient* (memory-efficient, CUDA only), *cudnn*
(CUDA only) and *math* (the plain softmax(q k^T / sqrt(d)) v in separate ops). torch picks one
by a fixed priority, which is right on a GPU but not always on a CPU: there the flash kernel's
backward in reduced precision is slow (the optimizations page has the table), enough to make
a whole mixed-precision step slower than fp32.

The config key ``attention_kernel`` chooses: a kernel's name, ``default`` (torch's own
choice), or ``auto``: torch's choice, except on a CPU in reduced precision, where measurements
on this course's machine (forward + backward, ``time_kernels``; scripts/benchmark.py prints
the table for yours) put math ahead of flash in fp16 at every length up to 1024 keys, and in
bf16 below 160 keys (1.5-2.7x at 64-128 keys; flash 1.2-3.5x faster from 192 on). A rule, not
a timing at start-up: two runs of one command must compute alike (timed choices flipped
between processes and changed bf16 losses), and every rank of a layout takes the same kernel
without talking. The choice is logged; a resumed run keeps the kernel its checkpoint names.
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

from utils import device as dev

if TYPE_CHECKING:
    from utils.config_groups import ModelConfig

log = logging.getLogger(__name__)

KERNELS: dict[str, SDPBackend] = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
CUDA_ONLY = ("efficient", "cudnn")
BF16_FLASH_FROM = 160  # keys: on a CPU in bf16, flash from here on (measured: between 128 and 192)


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


def call_shape(cfg: ModelConfig, micro_batch: int, tp: int = 1,
               cp: int = 1) -> tuple[tuple[int, int, int, int], int]:
    """One rank's attention call: the queries' shape (micro-batch, heads, tokens, head_dim) with
    tensor parallelism ``tp`` (heads split) and context parallelism ``cp`` (queries split, keys
    and values gathered whole), and the keys' length."""
    tokens = (cfg.img_size[0] // cfg.patch_size) * (cfg.img_size[1] // cfg.patch_size)
    shape = (max(1, micro_batch), cfg.num_heads // tp, math.ceil(tokens / cp),
             cfg.embed_dim // cfg.num_heads)
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
        dev.synchronize(device)
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
        except RuntimeError:  # not for these shapes or this device (out of memory included)
            continue
        times[name] = (statistics.median(forward), statistics.median(backward))
    return times


def choose(setting: str, device: torch.device, dtype: torch.dtype, kv_len: int) -> str:
    """The kernel for ``setting`` (see the module's docstring) for attention over ``kv_len`` keys."""
    if setting != "auto":
        check_available(setting, device)
        return setting
    kernel = "default"
    if device.type == "cpu" and (dtype == torch.float16
                                 or (dtype == torch.bfloat16 and kv_len < BF16_FLASH_FROM)):
        kernel = "math"
    log.info("attention kernel %s (%s on %s, %d keys)", kernel, str(dtype).removeprefix("torch."),
             device.type, kv_len)
    return kernel
