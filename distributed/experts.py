"""Expert parallelism: the experts of each mixture-of-experts layer split over ``ep`` ranks.

The ep ranks are data-parallel ranks: each has its own samples, and within each dp group,
consecutive blocks of ep ranks share out the experts (``--expert_parallel E``: rank i of a
block holds experts i x E/ep ... (i + 1) x E/ep - 1). The router and everything else stay
replicated. A token's experts may live on another rank, so each MoE layer

1. routes its tokens (the serial layer's ``route``: top-k, gates, per-sample capacity),
2. sorts the kept (token, choice) assignments by expert and sends each to its expert's rank
   with an **all-to-all** (every rank sends a different amount to every other: first the
   counts, then the tokens),
3. runs its own experts on what it received,
4. sends the outputs back with the reverse all-to-all, and adds them at their tokens,
   weighted by their gates.

The all-to-all's backward is the reverse all-to-all (``distributed/mappings.py``), so the
gradients of the tokens travel back to the ranks they came from, and each expert's weight
gradient sums over the tokens of every rank of its block. Expert weights are different on
each rank of a block, so their gradients are averaged over the ranks that hold the same
experts (``ep_replicas``, one per block), not over all of dp (distributed/tags.py);
every other gradient is averaged over dp as usual. Checkpoints hold every expert under its
serial name (:func:`full_model_state`), so they load into any layout.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distributed.mappings import all_to_all
from distributed.mesh import ParallelMesh, check_expert_parallel, expert_layouts, gather_placement, new_groups
from distributed.tags import spec, tag
from networks.backbone import replace
from networks.moe import MoEMLP, assignment_shares

log = logging.getLogger(__name__)


def add_expert_groups(mesh: ParallelMesh, ep: int) -> None:
    """Create the "ep" groups (consecutive blocks of ``ep`` ranks of each dp group) and the
    "ep_replicas" groups (the ranks at the same place in every block of a dp group). Collective:
    every rank creates every group, in the same order."""
    check_expert_parallel(mesh.dp_size, ep)
    for name, groups in expert_layouts(mesh.world_size, mesh.sizes, "-".join(mesh.sizes), ep).items():
        mesh.groups[name] = new_groups(groups)
    mesh.expert_parallel = ep
    mesh.coords["ep"] = mesh.dp_rank % ep
    everyone = gather_placement(mesh, ["ep", "ep_replicas"])
    if dist.get_rank() == 0:
        for rank, (node, groups) in enumerate(everyone):
            log.info("expert layout rank %d on node %s: experts split over %s, copies of its experts on %s",
                     rank, node, groups["ep"], groups["ep_replicas"])


def sort_by_expert(expert: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For the experts of this rank's assignments (A,): the order that sorts them by expert
    (stable: within an expert, in token order) and the number per expert (E,). On the device:
    no host sync (torch.bincount would read the largest value on the host, on a GPU)."""
    counts = torch.zeros(num_experts, dtype=torch.long, device=expert.device)
    return torch.argsort(expert, stable=True), counts.scatter_add_(0, expert, torch.ones_like(expert))


def host_counts(counts: torch.Tensor, assignments: int) -> list[int]:
    """The counts on the host (the MoE layer's one sync). ``assignments``: how many they add up
    to, which a dry run (scripts/dry_run.py), whose tensors hold no values, shares out evenly."""
    return counts.tolist()


def rank_splits(counts: list[int], ep: int) -> list[int]:
    """The rows sent to (or received from) each of the ``ep`` ranks, from the count of each
    expert (E,) in rank order (expert e lives on rank e // (E / ep)): the all-to-all's split sizes."""
    per_rank = len(counts) // ep
    return [sum(counts[r * per_rank:(r + 1) * per_rank]) for r in range(ep)]


def dispatch_plan(expert: torch.Tensor, num_experts: int,
                  ep: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The dispatch plan in one call: :func:`sort_by_expert`, and the rows sent to each rank of
    the block. (The layer calls the two halves apart, the all-to-all of the counts between them,
    so that one host copy gives both the sent and the received split sizes.)"""
    order, counts = sort_by_expert(expert, num_experts)
    return order, counts, rank_splits(counts.tolist(), ep)


class ExpertParallelMoE(nn.Module):
    """This rank's part of a :class:`~networks.moe.MoEMLP`: the router (replicated) and its own
    experts, under their serial names (``experts.<global index>``)."""

    route = MoEMLP.route  # the serial layer's routing, capacity and balancing loss, unchanged
    capacity = MoEMLP.capacity

    def __init__(self, serial: MoEMLP, mesh: ParallelMesh) -> None:
        super().__init__()
        ep, rank = mesh.expert_parallel, mesh.rank_in("ep")
        if serial.num_experts % ep:
            raise ValueError(f"num_experts {serial.num_experts} is not divisible by expert_parallel {ep}")
        self.num_experts, self.top_k = serial.num_experts, serial.top_k
        self.capacity_factor = serial.capacity_factor
        self.group, self.ep, self.per_rank = mesh.group("ep"), ep, serial.num_experts // ep
        self.first = rank * self.per_rank  # global index of this rank's first expert
        self.router = serial.router
        self.experts = nn.ModuleDict({str(e): serial.experts[str(e)]
                                      for e in range(self.first, self.first + self.per_rank)})
        for p in self.experts.parameters():
            tag(p, spec(p).shard_dim, spec(p).grad_sum, expert=True)
        self.aux_loss = torch.zeros(())
        self.stats = torch.zeros(self.num_experts + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, gates, kept = self.route(x)  # (B, N, k) each, for this rank's tokens
        flat = x.reshape(-1, x.shape[-1])  # (T, D)
        # every (token, choice) assignment, sorted by expert; those the capacity dropped get the
        # key E and sort last (the same order as keeping them first, without a host sync)
        key = torch.where(kept, experts, self.num_experts).flatten()  # (T k,)
        order, counts = sort_by_expert(key, self.num_experts + 1)
        counts = counts[:-1]  # (E,) kept assignments per expert
        # tell every rank how many tokens it gets for each of its experts: (ep, per_rank), the
        # row of rank s says what s sends here
        received_counts = all_to_all(counts.view(self.ep, self.per_rank), self.group)
        # The layer's one host sync: the all-to-alls need their split sizes on the host (NCCL
        # sizes its transfers from them), and so do the shapes of what is received. One copy
        # gives them all: what goes to each expert, and what comes from each rank for each of
        # this rank's experts.
        host = host_counts(torch.cat([counts, received_counts.flatten()]), key.numel())
        sent, got = host[:self.num_experts], host[self.num_experts:]  # (E,), (ep x per_rank,)
        send_splits, recv_splits = rank_splits(sent, self.ep), rank_splits(got, self.ep)
        order = order[:sum(sent)]  # the kept assignments (A,)
        token, choice = order // self.top_k, order % self.top_k
        received = all_to_all(flat[token], self.group, recv_splits, send_splits)  # (R, D), by source
        # then by expert within each source: regroup by expert, run each, put back in place
        local = torch.arange(self.per_rank, device=x.device).repeat(self.ep)
        owner = torch.repeat_interleave(local, received_counts.flatten(), output_size=sum(got))  # (R,)
        by_expert = torch.argsort(owner, stable=True)
        per_expert = [sum(got[j::self.per_rank]) for j in range(self.per_rank)]
        outputs = [self.experts[str(self.first + j)](rows)  # every expert runs, on no token if need be
                   for j, rows in enumerate(received[by_expert].split(per_expert))]
        done = torch.cat(outputs)[torch.argsort(by_expert)]  # back in the received order
        back = all_to_all(done, self.group, send_splits, recv_splits)  # (A, D) in the sent order
        weight = gates.reshape(-1, self.top_k)[token, choice].unsqueeze(-1)
        out = torch.zeros_like(flat).index_add(0, token, (back * weight.to(back.dtype)).to(flat.dtype))
        self.stats = assignment_shares(sent, experts.numel())  # from the host copy
        return out.view_as(x)


def apply_expert_parallel(model: nn.Module, mesh: ParallelMesh, ep: int) -> nn.Module:
    """Replace every MoE layer by this rank's part of it (in place)."""
    add_expert_groups(mesh, ep)
    layers = []
    for path, serial in [(n, m) for n, m in model.named_modules() if isinstance(m, MoEMLP)]:
        layers.append(ExpertParallelMoE(serial, mesh))
        replace(model, path, layers[-1])
    if layers:
        log.info("expert parallel %d: this rank holds experts %d-%d of the %d of each MoE layer", ep,
                 layers[0].first, layers[0].first + layers[0].per_rank - 1, layers[0].num_experts)
    return model


def expert_layers(model: nn.Module) -> list[tuple[str, ExpertParallelMoE]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, ExpertParallelMoE)]


def _every_expert(model: nn.Module):
    """(serial name, owner's place in the ep block, the name of this rank's tensor of the same
    shape) of every expert tensor of every MoE layer, in serial order: what consolidation walks."""
    for layer_name, layer in expert_layers(model):
        leaves = [leaf for leaf, _ in layer.experts[str(layer.first)].named_parameters()]
        for e in range(layer.num_experts):
            for leaf in leaves:
                yield (f"{layer_name}.experts.{e}.{leaf}", e // layer.per_rank,
                       f"{layer_name}.experts.{layer.first}.{leaf}")


def _broadcast(value: Any, owner: int, group: Any, device: torch.device) -> Any:
    """The owner's ``value`` on every rank of ``group``, in host memory (consolidated state is
    kept there). It travels through ``device``: NCCL sends device tensors only, and Adam's step
    counts live in host memory."""
    if not torch.is_tensor(value):  # (SGD's momentum buffer without momentum: None everywhere)
        return value
    value = value.detach().to(device, copy=True)
    dist.broadcast(value, group=group, group_src=owner)
    return value.cpu()


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def serial_names(model: nn.Module) -> list[str]:
    """The serial model's parameter names, in its order: this rank's, with every expert of every
    MoE layer in place of its own."""
    every: dict[str, list[str]] = {}
    for name, _, mine in _every_expert(model):
        every.setdefault(mine.split(".experts.")[0], []).append(name)
    names = []
    for name, _ in model.named_parameters():
        layer = name.split(".experts.")[0] if ".experts." in name else None
        if layer in every:
            names += every.pop(layer)  # all the layer's experts where its own first one was
        elif layer is None:
            names.append(name)
    return names


@torch.no_grad()
def full_model_state(model: nn.Module, mesh: ParallelMesh, state: dict[str, torch.Tensor]
                     ) -> dict[str, torch.Tensor]:
    """``state`` (this rank's consolidated parameters) with every rank's experts, in the serial
    model's order: each expert's owner broadcasts it over its ep block."""
    me, group, device = mesh.rank_in("ep"), mesh.group("ep"), _device(model)
    for name, owner, mine in _every_expert(model):
        state[name] = _broadcast(state[name] if owner == me else state[mine], owner, group, device)
    return {n: state[n] for n in serial_names(model)}


def full_optimizer_state(model: nn.Module, mesh: ParallelMesh, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (this rank's consolidated optimizer state, indexed by this rank's parameters)
    re-indexed by the serial model's parameters, every rank's experts' state included."""
    own = [n for n, _ in model.named_parameters()]
    by_name = {own[i]: s for i, s in state["state"].items()}
    me, group, device = mesh.rank_in("ep"), mesh.group("ep"), _device(model)
    for name, owner, mine in _every_expert(model):
        template = by_name.get(mine)
        if template is None:  # no step taken yet: no state anywhere
            continue
        source = by_name[name] if owner == me else template
        by_name[name] = {k: _broadcast(source[k], owner, group, device) for k in sorted(template)}
    names = serial_names(model)
    full = dict(state)
    full["state"] = {i: by_name[n] for i, n in enumerate(names) if n in by_name}
    full["param_groups"] = [{**g, "params": list(range(len(names)))} for g in state["param_groups"]]
    return full


def local_optimizer_state(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """A serial (consolidated) optimizer state re-indexed by this rank's parameters."""
    index = {n: i for i, n in enumerate(serial_names(model))}
    own = [n for n, _ in model.named_parameters()]
    local = dict(state)
    local["state"] = {j: state["state"][index[n]] for j, n in enumerate(own) if index[n] in state["state"]}
    local["param_groups"] = [{**g, "params": list(range(len(own)))} for g in state["param_groups"]]
    return local


def local_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's part of a serial (consolidated) state: every name checked, own experts kept."""
    from distributed.consolidate import check_names

    check_names(serial_names(model), state)
    return {n: state[n] for n, _ in model.named_parameters()}
