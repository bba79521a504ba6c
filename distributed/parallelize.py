"""Serial model -> this rank's model: every kind of parallelism applied from outside.

The serial ViT (networks/vit.py) is built from the seed on every rank, so every layout
starts from the same weights. :func:`parallelize` then transforms it, always in this order:

1. tensor and context parallel (:func:`apply_model_parallel`): each block's attention and
   MLP are swapped for the Column/Row-parallel versions, which keep this rank's shards of
   the serial weights; the token slots split and gather the sequence. Parameters keep
   their serial names and get tags that say how they are split.
2. activation checkpointing (``activation_checkpointing``): the chosen blocks keep only their
   input for backward and recompute the rest (non-reentrant ``torch.utils.checkpoint``, which
   also replays the dropout masks, so gradients are those of the plain model).
3. torch.compile (``enable_jit``) of each transformer block, in place (``Module.compile``), so
   parameter names stay serial; per block, as torchtitan does, so that DDP can start a
   block's gradient all-reduce while backward still runs through the blocks before it.
4. data parallel over the dp dimension, as ``data_parallel`` says: DDP
   (:func:`~distributed.tags.wrap_data_parallel`, with a comm hook that also sums gradients
   over cp when the tags ask for it; also for zero1, whose sharding is in the optimizer), or
   FSDP (:func:`~distributed.sharding.apply_fsdp`: each block, then the root). A pipeline
   stage is not wrapped in DDP: it averages its gradients over dp after the pipeline's
   flush (distributed/pipeline.py).

With pipeline parallelism the serial model is first cut into this rank's stages
(distributed/pipeline.py), and each stage goes through the steps above.

An instructor adding a kind of parallelism adds its step here, in its place in the order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from distributed.mesh import ParallelMesh
from distributed.sharding import apply_fsdp, fsdp_active
from distributed.tags import tag_model, wrap_data_parallel
from networks.vit import ViT
from utils.config import Config

log = logging.getLogger(__name__)


def apply_model_parallel(model: ViT, mesh: ParallelMesh) -> ViT:
    """Swap the serial layers for tensor/context-parallel ones (in place); tag every parameter."""
    if mesh.size("tp") == 1 and mesh.size("cp") == 1:  # nothing to split inside the layers
        return model
    # imported here: a run without tensor or context parallelism never needs the layers
    from distributed.layers import (
        DistributedAttention,
        DistributedMLP,
        SequenceGather,
        SequenceSplit,
        sequence_sizes,
    )

    sizes = sequence_sizes(model.num_tokens, mesh)
    for block in model.blocks.values():
        block.attn = DistributedAttention(block.attn, mesh, sizes)
        block.mlp = DistributedMLP(block.mlp, mesh)
    if mesh.size("cp") > 1:
        model.seq_split = SequenceSplit(sizes, mesh)
        model.seq_gather = SequenceGather(sizes, mesh)
    tag_model(model, mesh)
    return model


def apply_activation_checkpointing(model: ViT, mode: str) -> ViT:
    """Recompute the activations of every block (``full``) or of every other block
    (``selective``: half the saving for half the extra forward work) in backward. The block's
    ``forward`` is wrapped in place, so parameter names (and checkpoints) do not change."""
    if mode == "none":
        return model
    for i, block in enumerate(model.blocks.values()):
        if mode == "full" or i % 2 == 0:
            block.forward = _checkpointed(block.forward)
    return model


def _checkpointed(forward: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(forward, x, use_reentrant=False)

    return run


def parallelize(model: ViT, mesh: ParallelMesh, cfg: Config, device: torch.device) -> nn.Module:
    """This rank's model, on ``device``, ready to train (see the module docstring for the order)."""
    model = apply_model_parallel(model, mesh).to(device)
    model = apply_activation_checkpointing(model, cfg.activation_checkpointing)
    if cfg.enable_jit:
        for block in model.blocks.values():
            block.compile()
    if fsdp_active(cfg, mesh):
        return apply_fsdp(model, mesh, cfg)
    if mesh.size("pp") > 1:  # a pipeline stage averages its gradients itself (distributed/pipeline.py)
        return model
    return wrap_data_parallel(model, mesh, device, cfg)
