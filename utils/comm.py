"""Communicator groups for tensor (tp), context (cp) and data (dp) parallelism.

The ranks are laid out on a tp x cp x dp grid. The order string (default ``tp-cp-dp``)
says which dimension varies fastest: with ``tp-cp-dp`` the ranks of one tensor-parallel
group are consecutive (on one node, over NVLink), and data parallelism spans nodes.

Example, 8 ranks, ``tp=4``: model groups [0, 1, 2, 3] and [4, 5, 6, 7]; data groups
[0, 4], [1, 5], [2, 6], [3, 7].

:func:`group_layouts` computes every group as lists of ranks without a process group
(a pure function, easy to test); :func:`init_comm` then creates them with
``dist.new_group``. Every rank must create every group, in the same order, even those
it is not a member of; that is what :func:`init_comm` does.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

log = logging.getLogger(__name__)

DIMS = ("tp", "cp", "dp")
GROUP_NAMES = ("tp", "cp", "dp", "tp-cp")  # tp-cp: one model replica


def parse_order(order: str) -> tuple[str, ...]:
    names = tuple(order.split("-"))
    if sorted(names) != sorted(DIMS):
        raise ValueError(f"parallel_order {order!r} must name tp, cp and dp once each, "
                         f"separated by '-', for example 'tp-cp-dp'")
    return names


def check_sizes(world_size: int, tp: int, cp: int, order: str = "tp-cp-dp") -> int:
    """Validate the parallel sizes; returns the data-parallel size."""
    parse_order(order)
    if tp < 1 or cp < 1:
        raise ValueError(f"tensor_parallel ({tp}) and context_parallel ({cp}) must be at least 1")
    if world_size % (tp * cp):
        raise ValueError(
            f"world size {world_size} is not divisible by tensor_parallel x context_parallel = "
            f"{tp} x {cp} = {tp * cp}; the product tp x cp x dp must equal the number of ranks")
    return world_size // (tp * cp)


def check_model(tp: int, cp: int, embed_dim: int, num_heads: int, mlp_hidden: int,
                num_tokens: int) -> None:
    """The model must split: whole heads and equal MLP slices per tp rank, a token per cp rank."""
    sizes = f"(tensor_parallel={tp}, context_parallel={cp}, embed_dim={embed_dim}, " \
            f"num_heads={num_heads}, mlp hidden={mlp_hidden}, tokens={num_tokens})"
    if num_heads % tp:
        raise ValueError(f"num_heads must be divisible by tensor_parallel {sizes}; "
                         f"choose tensor_parallel among the divisors of num_heads")
    if embed_dim % tp or mlp_hidden % tp:
        raise ValueError(f"embed_dim and the MLP hidden size must be divisible by tensor_parallel "
                         f"{sizes}")
    if cp > num_tokens:
        raise ValueError(f"context_parallel exceeds the number of tokens {sizes}; "
                         f"use fewer context-parallel ranks or smaller patches")


def group_layouts(world_size: int, tp: int, cp: int, order: str = "tp-cp-dp") -> dict[str, list[list[int]]]:
    """Every group of every kind as sorted rank lists, computed without a process group.

    A rank's coordinate along the i-th name of ``order`` has stride = product of the sizes
    of the names before it. A group of kind ``tp`` holds the ranks that differ only in their
    tp coordinate; ``tp-cp`` those that differ only in tp and cp (one model replica).
    """
    dp = check_sizes(world_size, tp, cp, order)
    sizes = {"tp": tp, "cp": cp, "dp": dp}
    names = parse_order(order)
    strides, s = {}, 1
    for name in names:
        strides[name] = s
        s *= sizes[name]

    def ranks(varying: tuple[str, ...]) -> list[list[int]]:
        fixed = [n for n in DIMS if n not in varying]
        groups = []
        for fixed_coords in itertools.product(*(range(sizes[n]) for n in fixed)):
            base = sum(c * strides[n] for n, c in zip(fixed, fixed_coords))
            members = [base + sum(c * strides[n] for n, c in zip(varying, coords))
                       for coords in itertools.product(*(range(sizes[n]) for n in varying))]
            groups.append(sorted(members))
        return sorted(groups)

    return {"tp": ranks(("tp",)), "cp": ranks(("cp",)), "dp": ranks(("dp",)),
            "tp-cp": ranks(("tp", "cp"))}


@dataclass
class Comm:
    """This rank's place in every group. ``groups[name]`` is None when there is no process group
    (world size 1), which every collective here treats as "nothing to do"."""

    tp_size: int = 1
    cp_size: int = 1
    dp_size: int = 1
    order: str = "tp-cp-dp"
    rank: int = 0
    members: dict[str, list[int]] = field(default_factory=dict)  # this rank's group per kind
    groups: dict[str, Any] = field(default_factory=dict)

    def size(self, name: str) -> int:
        return len(self.members[name]) if name in self.members else 1

    def rank_in(self, name: str) -> int:
        return self.members[name].index(self.rank) if name in self.members else 0

    def group(self, name: str) -> Any:
        return self.groups.get(name)

    @property
    def tp_rank(self) -> int:
        return self.rank_in("tp")

    @property
    def cp_rank(self) -> int:
        return self.rank_in("cp")

    @property
    def dp_rank(self) -> int:
        return self.rank_in("dp")

    @property
    def tp_group(self) -> Any:
        return self.group("tp")

    @property
    def cp_group(self) -> Any:
        return self.group("cp")

    @property
    def dp_group(self) -> Any:
        return self.group("dp")

    @property
    def model_parallel(self) -> bool:
        return self.tp_size * self.cp_size > 1

    def describe(self) -> str:
        return (f"rank {self.rank}: tp {self.tp_rank}/{self.tp_size}, cp {self.cp_rank}/{self.cp_size}, "
                f"dp {self.dp_rank}/{self.dp_size} (order {self.order})")


def init_comm(tp: int = 1, cp: int = 1, order: str = "tp-cp-dp") -> Comm:
    """Create every tp, cp, dp and tp-cp group (collective: every rank must call this)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    dp = check_sizes(world, tp, cp, order)
    layouts = group_layouts(world, tp, cp, order)
    comm = Comm(tp_size=tp, cp_size=cp, dp_size=dp, order=order, rank=rank)
    for name in GROUP_NAMES:
        for members in layouts[name]:
            group = None
            if dist.is_initialized():
                # every rank takes part in creating every group
                group = dist.group.WORLD if len(members) == world else dist.new_group(members)
            if rank in members:
                comm.members[name] = members
                comm.groups[name] = group
    log.info("parallel layout %s", comm.describe())
    return comm
