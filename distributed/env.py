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
    """Read rank, sizes and rendezvous address; torchrun's names win over Slurm's. Values
    that cannot be right (a rank outside the world, a world of 0) are one-line errors here,
    before any rank waits for the others."""
    return _checked(_read_env(dict(os.environ if env is None else env)))


def _checked(e: DistEnv) -> DistEnv:
    if e.world_size < 1:
        raise ValueError(f"the world size (WORLD_SIZE or SLURM_NTASKS) is {e.world_size}; it must be "
                         f"at least 1")
    if not 0 <= e.rank < e.world_size:
        raise ValueError(f"rank {e.rank} (RANK or SLURM_PROCID) is outside a world of {e.world_size} "
                         f"ranks (0 to {e.world_size - 1}); check the launcher's settings")
    if not 0 <= e.local_rank < max(e.local_world_size, 1):
        raise ValueError(f"local rank {e.local_rank} is outside the {e.local_world_size} ranks of this "
                         f"node; check LOCAL_RANK and LOCAL_WORLD_SIZE")
    if not 0 < e.master_port < 65536:
        raise ValueError(f"MASTER_PORT {e.master_port} is not a port number (1 to 65535)")
    return e


def _read_env(env: dict[str, str]) -> DistEnv:
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


def init_distributed(env: DistEnv, device: torch.device, collective_timeout_s: float = 300.0,
                     rendezvous_timeout_s: float = 60.0, backend: str = "auto") -> None:
    """Join the default process group (NCCL on GPU, gloo on CPU, or ``backend`` where it names
    one); no-op for one process.

    The ranks first meet at a key-value store on rank 0's MASTER_ADDR:MASTER_PORT. Under
    torchrun its agent already runs that store and every rank is a client of it; otherwise
    rank 0 creates it. Waiting for it is bounded by ``rendezvous_timeout_s`` (a missing rank,
    a wrong address or a port in use end in one line, not a 300 s wait and a traceback);
    ``collective_timeout_s`` then bounds every collective of the run.
    """
    if not env.is_distributed or dist.is_initialized():
        return
    from distributed import health  # only distributed runs

    backend = dev.backend_for(device, backend)
    # on NCCL the heartbeat names the missing rank before NCCL's watchdog ends the process
    limits = health.deadlines(collective_timeout_s, backend)
    store = _rendezvous(env, rendezvous_timeout_s)
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=limits.process_group_s),
        device_id=device if backend == "nccl" else None,  # NCCL: this rank's GPU, bound at once
    )
    log.info("process group: %s, world size %d", backend, env.world_size)
    global _heartbeat, _group_timeout
    _group_timeout = datetime.timedelta(seconds=limits.process_group_s)
    _heartbeat = health.start(env.master_addr, env.master_port, env.rank, env.world_size, limits)


_heartbeat = None  # this rank's distributed.health.Heartbeat, once the process group is up
_group_timeout: datetime.timedelta | None = None  # the default group's, once it is up


def group_timeout() -> datetime.timedelta | None:
    """The timeout of the default process group, for every group made after it (None before
    init_distributed: torch's default). A group made by ``new_group`` or a DeviceMesh does not
    inherit the default group's: it waits torch's default, 10 min on NCCL and 30 on gloo."""
    return _group_timeout


def heartbeat():
    """This rank's heartbeat (distributed/health.py), or None in a single process."""
    return _heartbeat


def _rendezvous(env: DistEnv, timeout_s: float) -> dist.Store:
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # set by torchrun
    try:
        return dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                             is_master=env.rank == 0 and not agent,
                             timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=not agent,
                             multi_tenant=not agent)
    except Exception as err:  # DistStoreError, RuntimeError (address in use), OSError
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"rank {env.rank} of {env.world_size} could not meet the others at "
                         f"{env.master_addr}:{env.master_port} within {timeout_s:g} s ({reason}); check "
                         f"that every rank was started with the same MASTER_ADDR, MASTER_PORT and "
                         f"WORLD_SIZE, that rank 0 is running, and that the port is free") from None


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` is true on any rank (collective; the local flag without a process group)."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def all_reduce_sum(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum over the ranks of ``group`` in place (a no-op without a process group)."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_reduce_max(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Maximum over the ranks of ``group`` in place (a no-op without a process group)."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t
