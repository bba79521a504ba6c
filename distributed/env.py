"""Process-group wire-up from torchrun's or Slurm's environment, and small collectives.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; ``srun`` sets
SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS and SLURM_NODELIST. Either is enough:
export_DDP_vars.sh (which copies the Slurm values into the torchrun names) is optional.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from utils import device as dev

log = logging.getLogger(__name__)

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def first_host(nodelist: str) -> str:
    """First host of a Slurm node list: 'nid[001-004,010],nid200' -> 'nid001'."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot read a host from SLURM_NODELIST={nodelist!r}; set MASTER_ADDR")
    prefix, ranges = m.group(1), m.group(2)
    if ranges is None:
        return prefix
    return prefix + re.split(r"[-,]", ranges)[0]


def _int(env: dict[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError as err:
        raise ValueError(f"environment variable {name}={env[name]!r} is not an integer") from err


def parse_env(env: dict[str, str] | None = None) -> DistEnv:
    """Read rank, sizes and rendezvous address; torchrun's names win over Slurm's."""
    env = dict(os.environ if env is None else env)
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_PORT
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE")
        return DistEnv(
            rank=_int(env, "RANK"),
            local_rank=_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            world_size=world,
            local_world_size=_int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world,
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=port,
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world = _int(env, "SLURM_NTASKS")
        if "MASTER_ADDR" in env:
            addr = env["MASTER_ADDR"]
        elif world > 1 and "SLURM_NODELIST" in env:
            addr = first_host(env.get("SLURM_STEP_NODELIST", env["SLURM_NODELIST"]))
        else:
            addr = "127.0.0.1"
        per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        nodes = _int(env, "SLURM_NNODES") if "SLURM_NNODES" in env else 1
        local_world = int(per_node) if per_node.isdigit() else max(1, world // max(nodes, 1))
        return DistEnv(
            rank=_int(env, "SLURM_PROCID"),
            local_rank=_int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            world_size=world,
            local_world_size=local_world,
            master_addr=addr,
            master_port=port,
        )
    return DistEnv()


def init_distributed(env: DistEnv, device: torch.device, timeout_s: float = 300.0) -> None:
    """Join the default process group (NCCL on GPU, gloo on CPU); no-op for one process."""
    if not env.is_distributed or dist.is_initialized():
        return
    dist.init_process_group(
        backend=dev.backend_for(device),
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    log.info("process group: %s, world size %d", dev.backend_for(device), env.world_size)


def all_reduce_sum(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum over the ranks of ``group`` in place (a no-op without a process group)."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t
