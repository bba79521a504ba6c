"""The device mesh: every rank's place on a grid of named parallel dimensions.

The ranks are laid out on a grid with one axis per parallel dimension (tp, cp, dp and
pp). The order string (default ``tp-cp-dp``) says which dimension varies fastest:
with ``tp-cp-dp`` the ranks of one tensor-parallel group are consecutive (on one node,
over NVLink), data parallelism spans nodes, and pipeline stages (appended when the order
does not name pp) vary slowest: the cheap point-to-point activations cross the slowest links.

Example, 8 ranks, ``tp=4``: tensor-parallel groups [0, 1, 2, 3] and [4, 5, 6, 7]; data
groups [0, 4], [1, 5], [2, 6], [3, 7].

:func:`group_layouts` computes every group as lists of ranks without a process group
(a pure function, easy to test). :func:`build_mesh` then creates the groups as one
``torch.distributed.device_mesh.DeviceMesh`` with named dimensions, which is what
FSDP, DTensor and pipelining take.

Adding a parallel dimension: add its name and config key to :data:`DIMENSIONS` (and
what it must divide to :func:`check_model`), then its step in distributed/parallelize.py.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from distributed.env import group_timeout
from utils.config_groups import MemoryConfig, ModelConfig, ParallelConfig
from utils.device import node_name, this_rank_device

log = logging.getLogger(__name__)

# name -> config key of its size. Data parallelism ("dp") takes whatever the others leave.
DIMENSIONS: dict[str, str | None] = {
    "tp": "tensor_parallel",
    "cp": "context_parallel",
    "dp": None,
    "pp": "pipeline_parallel",  # last: an order that does not name it puts it slowest (across nodes)
}
DATA = "dp"


def parse_order(order: str) -> tuple[str, ...]:
    """Dimensions fastest-varying first; any the order leaves out follow in DIMENSIONS' order."""
    names = tuple(order.split("-"))
    unknown = [n for n in names if n not in DIMENSIONS]
    if unknown or len(set(names)) != len(names):
        raise ValueError(f"parallel_order {order!r} must name parallel dimensions ({', '.join(DIMENSIONS)}) "
                         f"at most once each, separated by '-', for example 'tp-cp-dp'")
    return names + tuple(n for n in DIMENSIONS if n not in names)


def requested_sizes(layout: ParallelConfig) -> dict[str, int]:
    """The configured size of every dimension but dp."""
    return {name: getattr(layout, k) for name, k in DIMENSIONS.items() if k is not None}


def model_parallel_sizes(layout: ParallelConfig) -> dict[str, int]:
    """The dimensions other than dp that are larger than 1 (empty: a data-parallel-only run)."""
    return {n: s for n, s in requested_sizes(layout).items() if s > 1}


def check_sizes(world_size: int, sizes: dict[str, int], order: str = "tp-cp-dp") -> dict[str, int]:
    """Validate the sizes of every dimension but dp; returns all sizes in layout order (dp filled in)."""
    names = parse_order(order)
    for name, size in sizes.items():
        if size < 1:
            raise ValueError(f"{DIMENSIONS[name]} must be at least 1, got {size}")
    model = math.prod(sizes.values())
    if world_size % model:
        product = " x ".join(DIMENSIONS[n] for n in sizes)
        values = " x ".join(str(s) for s in sizes.values())
        raise ValueError(f"world size {world_size} is not divisible by {product} = {values} = {model}; "
                         f"the product of all parallel sizes (dp included) must equal the number of ranks")
    full = {**sizes, DATA: world_size // model}
    return {n: full.get(n, 1) for n in names}


def check_model(model: ModelConfig, layout: ParallelConfig) -> None:
    """The model must split: whole heads and equal MLP slices per tp rank, a token per cp rank."""
    tp, cp = layout.tensor_parallel, layout.context_parallel
    hidden = int(model.embed_dim * model.mlp_ratio)
    tokens = model.tokens
    sizes = f"(tensor_parallel={tp}, context_parallel={cp}, embed_dim={model.embed_dim}, " \
            f"num_heads={model.num_heads}, mlp hidden={hidden}, tokens={tokens})"
    if model.num_heads % tp:
        raise ValueError(f"num_heads must be divisible by tensor_parallel {sizes}; "
                         f"choose tensor_parallel among the divisors of num_heads")
    if model.embed_dim % tp or hidden % tp:
        raise ValueError(f"embed_dim and the MLP hidden size must be divisible by tensor_parallel {sizes}")
    if cp > tokens:
        raise ValueError(f"context_parallel exceeds the number of tokens {sizes}; "
                         f"use fewer context-parallel ranks or smaller patches")
    if layout.sequence_parallel and tp * cp > tokens:  # each tp rank of a cp slice needs a token
        raise ValueError(f"sequence_parallel needs a token for every tp rank of every cp slice {sizes}; "
                         f"use fewer ranks or smaller patches")


def check_expert_parallel(dp_size: int, ep: int) -> None:
    """The expert-parallel ranks are data-parallel ranks: ``ep`` must divide the dp size."""
    if dp_size % ep:
        raise ValueError(f"expert_parallel {ep} does not divide the {dp_size} data-parallel ranks; "
                         f"choose a divisor (the expert-parallel ranks are data-parallel ranks)")


def hsdp_shard(layout: ParallelConfig, dp_size: int, ranks_per_node: int) -> int:
    """HSDP's sharding group: ``dp_shard`` ranks, by default the ranks of one node."""
    shard = layout.dp_shard or ranks_per_node
    if dp_size % shard:
        raise ValueError(f"--dp_shard {shard} does not divide the {dp_size} data-parallel ranks; "
                         f"choose a divisor (hsdp makes dp / dp_shard groups of dp_shard ranks)")
    return shard


def check_takes_effect(layout: ParallelConfig, memory: MemoryConfig, sizes: dict[str, int],
                       ranks_per_node: int) -> None:
    """A layout flag that these sizes would switch off is refused, not ignored: the run would
    otherwise train something other than what was asked for. ``sizes``: every dimension, dp
    included (check_sizes' result). DeepSpeed's stages are its own (ZeRO-Offload on one rank
    is a use of it)."""
    if layout.engine != "native":
        return
    dp, what = sizes[DATA], None
    if dp == 1 and not layout.replicated:  # distributed/sharding.py: fsdp_active, zero1_active
        offload = " with --cpu_offload" if memory.cpu_offload else ""
        what = f"--data_parallel {layout.data_parallel}{offload} shards over the data-parallel ranks"
    elif dp == 1 and layout.grad_compression != "none":  # DDP's hook: no DDP with one replica
        what = f"--grad_compression {layout.grad_compression} compresses the data-parallel all-reduce"
    if what:
        model = math.prod(sizes.values()) // dp
        split = [f"{DIMENSIONS[n]} {s}" for n, s in sizes.items() if s > 1]
        at = f" at {' x '.join(split)}" if split else ""
        ranks = f"{model} ranks{at} leave" if model > 1 else "1 rank leaves"
        raise ValueError(f"{what}, but {ranks} 1 data-parallel rank: start {2 * model} ranks or more (on "
                         f"Perlmutter nodes x 4 GPUs), or leave the flag out")
    if layout.hsdp:
        shard = hsdp_shard(layout, dp, ranks_per_node)
        if shard == dp:
            raise ValueError(f"--data_parallel hsdp with one sharding group of all {dp} data-parallel ranks "
                             f"is fsdp (nothing is replicated); use --data_parallel fsdp, or more ranks "
                             f"than --dp_shard {shard} (a node's ranks by default)")


def _strides(sizes: dict[str, int]) -> dict[str, int]:
    """A rank's coordinate along a dimension has stride = product of the sizes before it."""
    strides, s = {}, 1
    for name, size in sizes.items():
        strides[name] = s
        s *= size
    return strides


def group_layouts(world_size: int, sizes: dict[str, int], order: str = "tp-cp-dp"
                  ) -> dict[str, list[list[int]]]:
    """Every group of every dimension as sorted rank lists, computed without a process group.

    A group of dimension ``tp`` holds the ranks that differ only in their tp coordinate.
    """
    full = check_sizes(world_size, sizes, order)
    strides = _strides(full)
    layouts = {}
    for name in full:
        others = [n for n in full if n != name]
        groups = []
        for coords in itertools.product(*(range(full[n]) for n in others)):
            base = sum(c * strides[n] for n, c in zip(others, coords))
            groups.append([base + i * strides[name] for i in range(full[name])])
        layouts[name] = sorted(groups)
    return layouts


def expert_layouts(world_size: int, sizes: dict[str, int], order: str, ep: int) -> dict[str, list[list[int]]]:
    """The expert-parallel groups as rank lists (distributed/experts.py): "ep", consecutive blocks
    of ``ep`` ranks of each dp group, which share out the experts; "ep_replicas", the ranks at the
    same place in every block of a dp group, which hold the same experts."""
    others = {n: s for n, s in sizes.items() if n != DATA}
    layouts: dict[str, list[list[int]]] = {"ep": [], "ep_replicas": []}
    for ranks in group_layouts(world_size, others, order)[DATA]:
        check_expert_parallel(len(ranks), ep)
        layouts["ep"] += [ranks[i:i + ep] for i in range(0, len(ranks), ep)]
        layouts["ep_replicas"] += [ranks[j::ep] for j in range(ep)]
    return layouts


def hsdp_layouts(world_size: int, shard: int) -> dict[str, list[list[int]]]:
    """HSDP's groups (dp alone, distributed/sharding.py): "dp_shard", rows of ``shard``
    consecutive ranks that shard the model; "dp_replicate", the ranks at the same place in every
    row, which hold the same shard and average its gradient."""
    rows = [list(range(start, start + shard)) for start in range(0, world_size, shard)]
    return {"dp_shard": rows, "dp_replicate": [list(column) for column in zip(*rows)]}


def mesh_ranks(sizes: dict[str, int]) -> torch.Tensor:
    """The rank grid in DeviceMesh's convention: the last axis varies fastest, so the axes
    are our order reversed (``tp-cp-dp`` -> shape (dp, cp, tp))."""
    return torch.arange(math.prod(sizes.values())).reshape(tuple(reversed(list(sizes.values()))))


@dataclass
class ParallelMesh:
    """This rank's place on the mesh. ``groups[name]`` is None without a process group (one
    process), which every collective here treats as "nothing to do"."""

    sizes: dict[str, int]  # every dimension, fastest-varying first
    rank: int = 0
    coords: dict[str, int] = field(default_factory=dict)
    groups: dict[str, Any] = field(default_factory=dict)
    device_mesh: Any = None  # torch.distributed.device_mesh.DeviceMesh; None for one process
    expert_parallel: int = 1  # ranks of a dp group that split the experts (distributed/experts.py)

    def size(self, name: str) -> int:
        return self.sizes.get(name, 1)

    def rank_in(self, name: str) -> int:
        return self.coords.get(name, 0)

    def group(self, name: str) -> Any:
        return self.groups.get(name)

    @property
    def model_parallel(self) -> bool:
        return any(s > 1 for n, s in self.sizes.items() if n != DATA)

    @property
    def dp_size(self) -> int:
        return self.size(DATA)

    @property
    def dp_rank(self) -> int:
        return self.rank_in(DATA)

    @property
    def dp_group(self) -> Any:
        return self.group(DATA)

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes.values())

    def collective_device(self, fallback: torch.device) -> torch.device:
        """Where the mesh's collectives run: its device type ("cuda": this rank's GPU, NCCL's, which
        refuses a host tensor); ``fallback`` for one process. FSDP's CPU offload keeps shards and
        their gradients in host memory: a sum over ranks moves them here first."""
        if self.device_mesh is None:
            return fallback
        return this_rank_device(self.device_mesh.device_type)

    def layout_name(self) -> str:
        """For run directories: '2GPU_tp2_cp1_dp1' (tp, cp, dp; pp only when it is larger than 1,
        so the names of runs without a pipeline stay as they were: '4GPU_tp1_cp1_dp2_pp2')."""
        return f"{self.world_size}GPU_" + "_".join(f"{n}{self.size(n)}" for n in DIMENSIONS
                                                   if n != "pp" or self.size(n) > 1)

    def describe(self) -> str:
        parts = ", ".join(f"{n} {self.rank_in(n)}/{self.size(n)}" for n in self.sizes)
        return f"rank {self.rank}: {parts} (order {'-'.join(self.sizes)})"


def new_groups(members: list[list[int]]) -> Any:
    """One process group per list of ranks, each with the run's collective timeout; returns this
    rank's group (None where it is in none). Collective: every rank creates every group, in the
    same order."""
    mine = None
    for ranks in members:
        group = dist.new_group(ranks, timeout=group_timeout())
        if dist.get_rank() in ranks:
            mine = group
    return mine


def device_mesh(device_type: str, ranks: torch.Tensor, names: tuple[str, ...]) -> Any:
    """A DeviceMesh over ``ranks`` (one axis per name) built from groups made by :func:`new_groups`:
    a DeviceMesh that makes its own groups gives them torch's default timeout, so a stuck tp or
    dp collective would wait 10 min (NCCL) or 30 (gloo) whatever --collective_timeout_s says.
    Collective."""
    from torch.distributed.device_mesh import DeviceMesh

    # axis i's groups: the rows of the grid once axis i is moved last
    groups = [new_groups(ranks.movedim(i, -1).reshape(-1, ranks.size(i)).tolist())
              for i in range(ranks.dim())]
    return DeviceMesh.from_group(groups, device_type, mesh=ranks, mesh_dim_names=names)


def build_mesh(sizes: dict[str, int], order: str = "tp-cp-dp", device_type: str = "cpu") -> ParallelMesh:
    """Create the mesh's process groups (collective: every rank must call this).

    ``sizes``: every dimension but dp (dp is what is left of the world).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    full = check_sizes(world, sizes, order)
    strides = _strides(full)
    coords = {n: (rank // strides[n]) % full[n] for n in full}
    mesh = ParallelMesh(sizes=full, rank=rank, coords=coords)
    if dist.is_initialized():
        names = tuple(reversed(list(full)))
        mesh.device_mesh = device_mesh(device_type, mesh_ranks(full), names)
        mesh.groups = {n: mesh.device_mesh.get_group(n) for n in full}
        log_placement(mesh)
    else:
        log.info("parallel layout %s", mesh.describe())
    return mesh


def release_groups(mesh: ParallelMesh) -> None:
    """Destroy the mesh's NCCL groups once nothing uses them (a layout that changes mid-run): each
    is a communicator holding GPU buffers until destroyed. gloo's groups (sockets) are left to
    the process's end: destroying them mid-run can deadlock (training/launcher.py's exit).
    Every rank calls it at the same point."""
    seen = set()
    for group in mesh.groups.values():
        if group is None or id(group) in seen:
            continue
        seen.add(id(group))
        if "nccl" in str(dist.get_backend(group)):
            dist.destroy_process_group(group)


def next_mesh(mesh: ParallelMesh, sizes: dict[str, int], order: str, device_type: str) -> ParallelMesh:
    """The mesh of a layout that changes mid-run (training/freezing.py's re-cut pipeline), the old
    one's groups released. New groups even for the same sizes: a pipeline re-cut over the groups
    of the one before it waits for ever (torch's pipelining keeps state of its own per group)."""
    release_groups(mesh)
    return build_mesh(sizes, order, device_type)


# the dimensions whose collectives run in every block: their groups belong inside a node
INSIDE_A_NODE = {"tp": "tensor-parallel", "cp": "context-parallel"}


def gather_placement(mesh: ParallelMesh, names: list[str]) -> list[tuple[str, dict[str, list[int]]]]:
    """Every rank's node and the ranks of its groups of ``names``, as each rank sees them,
    indexed by rank (collective: the ranks gather them)."""
    mine = (node_name(), {n: dist.get_process_group_ranks(mesh.groups[n]) for n in names})
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def log_placement(mesh: ParallelMesh) -> None:
    """Rank 0 logs every rank's node and groups ('rank 2 on node n2: tp 0/2 of [2, 3], cp 0/1,
    dp 1/2 of [0, 2], pp 0/1'; collective), and warns of a tp or cp group that spans nodes: its
    collectives, several per block, would cross the network between nodes."""
    everyone = gather_placement(mesh, [n for n in mesh.sizes if mesh.size(n) > 1])
    if dist.get_rank() != 0:
        return
    for rank, (node, groups) in enumerate(everyone):
        parts = ", ".join(f"{n} {groups[n].index(rank)}/{len(groups[n])} of {groups[n]}" if n in groups
                          else f"{n} 0/1" for n in mesh.sizes)
        log.info("parallel layout rank %d on node %s: %s (order %s)", rank, node, parts, "-".join(mesh.sizes))
    for name, what in INSIDE_A_NODE.items():
        split = [ranks for ranks in sorted({tuple(g[name]) for _, g in everyone if name in g})
                 if len({everyone[r][0] for r in ranks}) > 1]
        if split:
            nodes = sorted({everyone[r][0] for r in split[0]})
            log.warning("%d %s group(s) span nodes (ranks %s on %s): their collectives, several per "
                        "block, cross the network between nodes; make the ranks per node a multiple of "
                        "tensor_parallel x context_parallel, with tp and cp first in --parallel_order",
                        len(split), what, list(split[0]), ", ".join(nodes))
