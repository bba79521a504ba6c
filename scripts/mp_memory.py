#!/usr/bin/env python
"""Memory per rank of the tensor/context-parallel ViT, on any device (CPU included).

    torchrun --standalone --nproc_per_node 4 scripts/mp_memory.py --config tiny --tensor_parallel 4
    torchrun --standalone --nproc_per_node 4 scripts/mp_memory.py --config tiny --tensor_parallel 4 \
        --sequence_parallel

Counts the bytes a rank holds: parameters, gradients, Adam's two moments, and the
activations autograd saves for backward in one training forward pass (counted with
saved-tensor hooks, each storage once). On CUDA the allocator's peak over the step is
reported as well. Rank 0 prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distributed.env import init_distributed, parse_env  # noqa: E402
from distributed.mesh import build_mesh, requested_sizes  # noqa: E402
from distributed.parallelize import parallelize  # noqa: E402
from networks.backbone import build  # noqa: E402
from training.launcher import exit_now  # noqa: E402
from training.reporting import memory_report  # noqa: E402
from utils import device as dev  # noqa: E402
from utils.config import DEFAULT_YAML, load_config, with_overrides  # noqa: E402

MIB = 2**20


def saved_activation_bytes(model: Callable[[torch.Tensor], torch.Tensor],
                           x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes of the tensors saved for backward by one forward pass (each storage counted once)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    return sum(seen.values()), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--tensor_parallel", type=int, default=1)
    p.add_argument("--context_parallel", type=int, default=1)
    p.add_argument("--sequence_parallel", action="store_true",
                   help="split the activations between the tensor-parallel layers over tp as well")
    p.add_argument("--local_batch_size", type=int, default=4)
    args = p.parse_args()
    cfg = with_overrides(load_config(DEFAULT_YAML, args.config), tensor_parallel=args.tensor_parallel,
                         context_parallel=args.context_parallel, sequence_parallel=args.sequence_parallel)
    env = parse_env()
    device = dev.pick_device(env.local_rank)
    init_distributed(env, device)
    mesh = build_mesh(requested_sizes(cfg.layout), cfg.layout.parallel_order, device.type)
    torch.manual_seed(cfg.run.seed)
    model = parallelize(build(cfg.model), mesh, device, cfg.layout, cfg.memory, cfg.optim, cfg.run.seed)
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(args.local_batch_size, cfg.model.n_in_channels, *cfg.model.img_size, device=device)
    dev.reset_peak_memory(device)
    for _ in range(2):  # the second step has Adam's state allocated
        act, out = saved_activation_bytes(model, x)
        out.square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    report = {"config": args.config, **{n: mesh.size(n) for n in mesh.sizes}, "sp": args.sequence_parallel,
              "local_batch": args.local_batch_size, **memory_report(model, opt, device),
              "saved_activations_MiB": act / MIB}
    if env.rank == 0:
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in report.items()}),
              flush=True)
    exit_now(0)  # not destroy_process_group: with DDP alive, gloo can deadlock on it


if __name__ == "__main__":
    main()
