"""Differences between the supported PyTorch versions (2.8 to 2.15), in one place, and the
one private name of an optional library the project needs (DeepSpeed's, at its pinned version).

Nothing else in the project branches on ``torch.__version__``. Each entry names the
version that changed the behaviour it papers over.
"""

from __future__ import annotations

import inspect
import re
import sys

import torch

MIN_TORCH = (2, 8)
INSTALL_HINT = ("pip install 'torch>=2.8' (or `make venv`, which installs 2.13.0), or use a container "
                "with PyTorch 2.8 or newer (on Perlmutter: nersc/pytorch:25.06.01)")


def torch_version(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of a version string such as '2.13.0+cpu' or '2.8.0a0+5228986c39.nv25.06'."""
    m = re.match(r"(\d+)\.(\d+)", version or torch.__version__)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def check_torch(version: str | None = None) -> str | None:
    """A one-line complaint when the torch found is older than the floor, else None."""
    found = torch_version(version)
    if found < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        return (f"PyTorch {version or torch.__version__} is too old: this code needs {need} or newer; "
                f"{INSTALL_HINT}")
    return None


def require_supported_torch() -> None:
    """Stop with one line (no traceback) on a torch older than the floor."""
    problem = check_torch()
    if problem:
        sys.stderr.write(f"error: {problem}\n")
        raise SystemExit(2)


def graphs_with_checkpointing_problem(version: str | None = None) -> str | None:
    """Why a CUDA graph cannot capture activation checkpointing on this torch, or None.

    On torch 2.8 and 2.9 the capture fails on the recomputed forward's RNG state (the
    checkpoint saves and restores the CUDA generator's state, which a capture forbids there).
    """
    if torch_version(version) < (2, 10):
        return (f"train_graph.py with --activation_checkpointing needs torch 2.10 or newer (this is "
                f"{version or torch.__version__}: capturing the recomputation's RNG state fails); "
                f"use --activation_checkpointing none, or train.py")
    return None


def ddp_buffer_sync(sync: bool) -> dict[str, bool]:
    """DDP's keyword for broadcasting module buffers from rank 0 at every forward.

    torch 2.13 renamed ``broadcast_buffers`` to ``forward_sync_buffers`` (the old name warns
    there); 2.8 knows only ``broadcast_buffers``, whose False also skips the one broadcast at
    construction. The ViT has no buffers, so both behave the same here.
    """
    from torch.nn.parallel import DistributedDataParallel

    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers": sync}


def fsdp_average_on_gloo(module: torch.nn.Module, backend: str) -> None:
    """Make a ``fully_shard``-ed module average its gradients correctly over gloo.

    torch 2.8's FSDP2 reduce-scatters fp32 and bf16 gradients with ``ReduceOp.AVG``, which
    gloo sums: every gradient came out dp-size times too large. Adam hides the scale in
    training (the same losses), but its saved moments were dp-size (and its square) times
    too large, so a checkpoint resumed at another scale continued differently. Summing, then
    dividing after the reduction (what torch 2.13 does for gloo itself) is right everywhere.
    """
    if backend == "gloo":
        module.set_force_sum_reduction_for_comms(True)


# The CUDA allocator's history (its memory snapshot) has only underscored entry points, in
# every supported version; the memory record (utils/profiling.py) calls them from here.
def cuda_memory_history(enabled: bool) -> None:
    """Start (up to 100000 allocation events, with their Python stacks) or stop recording.

    Python stacks only: the default ("all") adds C++ frames, which the snapshot's dump symbolises
    one by one (minutes for a training step's events), while the rank sits in a training step
    that the heartbeat watches and the other ranks wait in its next collective."""
    torch.cuda.memory._record_memory_history(max_entries=100_000 if enabled else 0,
                                             enabled="all" if enabled else None, stacks="python")


def dump_cuda_memory_snapshot(path: str) -> None:
    """The recorded history as a pickle for https://pytorch.org/memory_viz."""
    torch.cuda.memory._dump_snapshot(path)


def deepspeed_link_optimizer_state(ds_optimizer: object) -> None:
    """Point each parameter's fragment at optimizer state created by hand (DeepSpeed 0.19, pinned
    in requirements-deepspeed.txt; private). ZeRO stages 1-2 and DeepSpeed's bf16 optimizer create
    Adam's state in their first step and only then link every parameter's fragment to it, which
    ``safe_set_full_optimizer_state`` writes through; a checkpoint loaded before the first step
    needs the link made now. ZeRO-3 finds its state without links (no such method)."""
    link = getattr(ds_optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        link()
