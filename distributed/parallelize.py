"""Serial model -> this rank's model: every kind of parallelism applied from outside.

The serial model (a backbone, networks/backbone.py) is built from the seed on every rank, so
every layout starts from the same weights. :func:`parallelize` then transforms it, always in
this order, knowing only the backbone's parts (its units) and its tensor-parallel plan:

1. tensor and context parallel (:func:`apply_model_parallel`): the linear layers of the plan
   are swapped for the Column/Row-parallel versions, which keep this rank's shards of the
   serial weights, and its attentions gather keys and values over cp; the token slots split
   and gather the sequence. Parameters keep
   their serial names and get tags that say how they are split. Then expert parallel
   (distributed/experts.py): each mixture of experts keeps this rank's experts.
2. activation checkpointing (``activation_checkpointing``): the chosen units keep only their
   input for backward and recompute the rest (non-reentrant ``torch.utils.checkpoint``, which
   also replays the dropout masks, so gradients are those of the plain model).
3. torch.compile (``enable_jit``) of each unit (a transformer block), in place
   (``Module.compile``), so parameter names stay serial; per unit, as torchtitan does, so that
   DDP can start a unit's gradient all-reduce while backward still runs through those before it.
4. data parallel over the dp dimension, as ``data_parallel`` says: DDP
   (:func:`~distributed.tags.wrap_data_parallel`, with a comm hook that also sums gradients
   over cp when the tags ask for it; also for zero1, whose sharding is in the optimizer), or
   FSDP (:func:`~distributed.sharding.apply_fsdp`: each unit, then the root). A pipeline
   stage is not wrapped in DDP: it averages its gradients over dp after the pipeline's
   flush (distributed/pipeline.py).

With pipeline parallelism the serial model is first cut into this rank's stages
(distributed/pipeline.py), and each stage goes through the steps above.

An instructor adding a kind of parallelism adds its step here, in its place in the order.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from distributed.consolidate import take_shard
from distributed.mesh import ParallelMesh
from distributed.sharding import apply_fsdp, fsdp_active
from distributed.shards import is_sharded, local, shard_of
from distributed.tags import spec, tag_model, wrap_data_parallel
from networks.backbone import Backbone, replace
from utils.config_groups import MemoryConfig, OptimizerConfig, ParallelConfig

log = logging.getLogger(__name__)


def apply_model_parallel(model: Backbone, mesh: ParallelMesh, sequence_parallel: bool = False,
                         impl: str = "course") -> Backbone:
    """Swap the layers of the model's tensor-parallel plan for tensor/context-parallel ones (in
    place); tag every parameter. With ``sequence_parallel`` (and tp > 1) the tokens between the
    tensor-parallel layers are split over tp as well: after the cp split, each tp rank keeps its
    part of the cp slice. ``impl`` "torch": the same plan by torch's ``parallelize_module``
    (:func:`torch_tensor_parallel`) instead of the course's layers."""
    if mesh.size("tp") == 1 and mesh.size("cp") == 1:  # nothing to split inside the layers
        return model
    # imported here: a run without tensor or context parallelism never needs the layers
    from distributed.layers import (
        ColumnParallelLinear,
        ContextParallelAttention,
        RowParallelLinear,
        SequenceGather,
        SequenceSplit,
        sequence_sizes,
        tp_sequence_sizes,
    )

    plan = model.tp_plan()
    if mesh.size("tp") > 1 and "colwise" not in plan.values():
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan (networks/backbone.py: "
                         f"tp_plan); use --tensor_parallel 1")
    if mesh.size("cp") > 1 and not (model.num_tokens and "context" in plan.values()):
        raise ValueError(f"{type(model).__name__} has no tokens to split or no attention to gather them "
                         f"(networks/backbone.py: num_tokens, tp_plan); use --context_parallel 1")
    sp = sequence_parallel and mesh.size("tp") > 1
    if sp and not model.num_tokens:
        raise ValueError(f"{type(model).__name__} has no tokens to split (networks/backbone.py: num_tokens); "
                         f"leave out --sequence_parallel")
    sizes = sequence_sizes(model.num_tokens, mesh)
    tp_sizes = tp_sequence_sizes(model.num_tokens, mesh) if sp else None
    if impl == "torch":
        torch_tensor_parallel(model, mesh, plan, sp)
    else:
        for path, style in plan.items():
            serial = model.get_submodule(path)
            if style == "colwise":
                replace(model, path, ColumnParallelLinear(serial, mesh, tp_sizes))
            elif style == "rowwise":
                replace(model, path, RowParallelLinear(serial, mesh, tp_sizes))
            elif mesh.size("cp") > 1:  # "context": this rank's queries attend to every rank's keys
                replace(model, path, ContextParallelAttention(serial, mesh, sizes))
    splits, gathers = [], []  # (B, N, D) -> cp slice -> its tp part, and back in reverse
    if mesh.size("cp") > 1:
        splits.append(SequenceSplit(sizes, mesh, "cp"))
        gathers.insert(0, SequenceGather(sizes, mesh, "cp"))
    if sp:
        splits.append(SequenceSplit(tp_sizes, mesh, "tp"))
        gathers.insert(0, SequenceGather(tp_sizes, mesh, "tp"))
    if sp:
        log.info("sequence parallel: between the tensor-parallel layers this rank holds %d of the %d "
                 "tokens", tp_sizes[mesh.rank_in("tp")], model.num_tokens)
    if splits:
        model.seq_split = splits[0] if len(splits) == 1 else nn.Sequential(*splits)
        model.seq_gather = gathers[0] if len(gathers) == 1 else nn.Sequential(*gathers)
    tag_model(model, mesh, sequence_parallel=sp)
    return model


def torch_tensor_parallel(model: Backbone, mesh: ParallelMesh, plan: dict[str, str], sp: bool) -> None:
    """The plan applied by torch's ``parallelize_module`` (what production code uses): "colwise" as
    ``ColwiseParallel``, "rowwise" as ``RowwiseParallel``. Their weights become DTensors on the mesh
    dimension "tp", which know how they are split (consolidation, clipping and the initial values
    read that); a row-parallel bias is a replicated DTensor, its gradient complete from DTensor's
    backward. The inputs and outputs stay plain tensors: with sequence parallelism a colwise layer
    takes this rank's tokens (``Shard(1)``: all-gathered first) and a rowwise one gives them back
    (``Shard(1)``: its partial sums reduce-scattered), as the course's layers do."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if mesh.dp_size > 1 or mesh.size("cp") > 1 or mesh.size("pp") > 1:
        raise ValueError("--tp_impl torch runs tensor (and sequence) parallelism alone here, every rank in "
                         "the tp group; use --tp_impl course with data, context or pipeline parallelism")
    if sp and model.num_tokens % mesh.size("tp"):
        raise ValueError(f"--tp_impl torch splits the {model.num_tokens} tokens evenly over "
                         f"--tensor_parallel {mesh.size('tp')}; use --tp_impl course for uneven parts")
    tokens = Shard(1)  # (B, N, D) split along N
    styles = {"colwise": lambda: ColwiseParallel(input_layouts=tokens) if sp else ColwiseParallel(),
              "rowwise": lambda: RowwiseParallel(output_layouts=tokens) if sp else RowwiseParallel()}
    torch_plan = {path: styles[style]() for path, style in plan.items() if style in styles}
    parallelize_module(model, mesh.device_mesh["tp"], torch_plan)


def apply_activation_checkpointing(model: Backbone, mode: str) -> Backbone:
    """Recompute the activations of every unit (``full``) or of every other unit (``selective``:
    half the saving for half the extra forward work) in backward. The unit's ``forward`` is
    wrapped in place, so parameter names (and checkpoints) do not change."""
    if mode == "none":
        return model
    for i, unit in enumerate(model.units().values()):
        if mode == "full" or i % 2 == 0:
            unit.forward = _checkpointed(unit.forward)
    return model


def _checkpointed(forward: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(forward, x, use_reentrant=False)

    return run


InitialValues = Callable[[], Iterator[tuple[str, torch.Tensor]]]


def serial_values(serial: Backbone, seed: int) -> InitialValues:
    """The serial model's initial values, parameter by parameter (``Backbone.initial_values``), from
    a generator seeded with ``seed`` each time they are asked for: every rank, and every
    pipeline stage, draws the same numbers. Kept from a copy of ``serial`` as built (on the meta
    device a copy costs nothing), since parallelizing replaces its layers."""
    reference = copy.deepcopy(serial)
    return lambda: reference.initial_values(torch.Generator().manual_seed(seed))


def allocate(model: nn.Module, device: torch.device) -> None:
    """Give every parameter and buffer of a model built on the meta device real, uninitialised
    memory on ``device``, as ``model.to_empty`` does. FSDP's parameters (DTensors it keeps its own
    references to) need ``to_empty``; the others are replaced here by ``torch.empty`` of their
    shape, because ``to_empty`` copies a meta tensor with ``empty_like``, which loads torch's
    Python meta kernels: 0.4 s of every process's start-up, measured here, for nothing."""
    if any(is_sharded(p) for p in model.parameters()):
        model.to_empty(device=device)
        return
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                               requires_grad=p.requires_grad))
        for name, b in list(module.named_buffers(recurse=False)):
            setattr(module, name, torch.empty(b.shape, dtype=b.dtype, device=device))


def materialize(model: nn.Module, mesh: ParallelMesh, device: torch.device,
                initial_values: InitialValues) -> nn.Module:
    """A model whose parameters are on the meta device (shapes only), already cut to this
    rank's part: allocate that part on ``device`` and fill it with the serial model's values.
    One whole serial parameter exists at a time (on the CPU); each rank keeps its slice of it
    (tensor parallel: ``take_shard``; FSDP: its shard, ``shard_of``), so building a model that
    would not fit one device never needs it whole."""
    tags = {name: p.mp_spec for name, p in model.named_parameters() if hasattr(p, "mp_spec")}
    allocate(model, device)  # uninitialised memory for this rank's parameters only
    own = dict(model.named_parameters())
    for name, p in own.items():  # allocating makes new Parameter objects: tags back on
        if name in tags:
            p.mp_spec = tags[name]
    with torch.no_grad():
        for name, value in initial_values():
            p = own.pop(name, None)
            if p is None:  # another pipeline stage's parameter
                continue
            piece = shard_of(take_shard(value, spec(p), mesh), p)
            local(p).copy_(piece)
    if own:
        raise RuntimeError(f"no initial value for {sorted(own)}")
    return model


def parallelize(model: Backbone, mesh: ParallelMesh, device: torch.device, layout: ParallelConfig,
                memory: MemoryConfig, optim: OptimizerConfig, seed: int = 0,
                initial_values: InitialValues | None = None) -> nn.Module:
    """This rank's model, on ``device``, ready to train (see the module docstring for the order):
    the parallel ``layout``, ``memory``'s activation checkpointing and offload, ``optim``'s
    compile and precision (FSDP's bf16 policy); ``seed``: PowerSGD's.

    ``model`` is built on the meta device when ``initial_values`` is given: nothing is
    allocated until the model is split, then each rank allocates its own part (materialize)."""
    meta = initial_values is not None
    model = apply_model_parallel(model, mesh, layout.sequence_parallel, layout.tp_impl)
    if layout.expert_parallel > 1:  # imported only then: the experts split over data-parallel ranks
        from distributed.experts import apply_expert_parallel

        model = apply_expert_parallel(model, mesh, layout.expert_parallel)
    if not meta:
        model = model.to(device)
    model = apply_activation_checkpointing(model, memory.activation_checkpointing)
    if optim.enable_jit:
        for unit in model.units().values():
            unit.compile()
    if fsdp_active(layout, mesh):  # on meta: only the shards' shapes
        model = apply_fsdp(model, mesh, layout, optim.amp_mode, memory.cpu_offload)
        return materialize(model, mesh, device, initial_values) if meta else model
    if meta:
        model = materialize(model, mesh, device, initial_values)
    if mesh.size("pp") > 1:  # a pipeline stage averages its gradients itself (distributed/pipeline.py)
        return model
    return wrap_data_parallel(model, mesh, device, layout, seed)
