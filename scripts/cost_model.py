#!/usr/bin/env python
"""Predict before you run: FLOPs, memory, bytes sent and step time of every layout, from
formulas; checked against real runs of the same code on the same machine.

    python scripts/cost_model.py --config tiny --ranks 2 --data_parallel fsdp    # one prediction
    python scripts/cost_model.py --calibrate                   # this machine's constants
    python scripts/cost_model.py --check --out logs/cost_model # 15 layouts: predicted vs measured
    python scripts/cost_model.py --config tiny --plan --gpus 4 --gpu_memory_gb 1

Everything is per rank and per training step (fp32 weights and Adam, as train.py trains by
default). The formulas read the model's sizes from the config: B samples of N tokens of width
D, L blocks with h heads and an MLP of F hidden features, C_in/C_out channels in p x p patches.
The page docs/11-cost-model.md derives each one. What the model leaves out is said where it
is left out.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

E = 4  # bytes of an fp32 element: weights, gradients, Adam's moments, activations (no AMP)
MIB = 2**20
CONSTANTS_FILE = "machine.json"  # in --out: --calibrate and --check write it, the rest read it


# ------------------------------------------------------------------ the model ---
@dataclass(frozen=True)
class Model:
    """The ViT's sizes (networks/vit.py)."""

    img: tuple[int, int]
    patch: int
    c_in: int
    c_out: int
    dim: int
    depth: int
    heads: int
    mlp_ratio: float = 4.0
    num_experts: int = 0
    top_k: int = 1
    moe_every: int = 2

    @property
    def tokens(self) -> int:  # N
        return (self.img[0] // self.patch) * (self.img[1] // self.patch)

    @property
    def hidden(self) -> int:  # F
        return int(self.dim * self.mlp_ratio)

    @property
    def pixels(self) -> int:  # H W
        return self.img[0] * self.img[1]

    def moe(self, block: int) -> bool:
        return bool(self.num_experts) and (block + 1) % self.moe_every == 0

    @classmethod
    def from_config(cls, cfg: Any) -> Model:
        if cfg.model.backbone != "vit":
            raise ValueError(f"the cost model's formulas are the ViT's (docs/11-cost-model.md); it has "
                             f"none for backbone {cfg.model.backbone}")
        m = cfg.model
        return cls(tuple(m.img_size), m.patch_size, m.n_in_channels, m.n_out_channels, m.embed_dim,
                   m.depth, m.num_heads, m.mlp_ratio, m.num_experts, m.moe_top_k, m.moe_every)


@functools.cache
def serial_model(m: Model) -> Any:
    """The serial model of these sizes, built on the meta device (shapes only, nothing drawn):
    the parameters and the tensor-parallel split are read from it, not kept by hand."""
    from networks.backbone import build_on_meta  # torch is needed only from here on
    from utils.config_groups import ModelConfig

    return build_on_meta(ModelConfig(
        img_size=m.img, patch_size=m.patch, n_in_channels=m.c_in, n_out_channels=m.c_out, embed_dim=m.dim,
        depth=m.depth, num_heads=m.heads, mlp_ratio=m.mlp_ratio, num_experts=m.num_experts,
        moe_top_k=m.top_k, moe_every=m.moe_every))[0]


@functools.cache
def _shapes(m: Model) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((name, tuple(p.shape)) for name, p in serial_model(m).named_parameters())


def parameter_shapes(m: Model) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter of the serial model with its shape, in the model's order."""
    return list(_shapes(m))


@functools.cache
def tp_dims(m: Model) -> dict[str, int]:
    """Parameter name -> the dimension tensor parallelism splits, from the model's plan
    (``Backbone.tp_plan``): a column-parallel layer's weight and bias by rows, a row-parallel
    layer's weight by columns (its bias is added once, whole); the rest is replicated."""
    dims = {}
    for path, style in serial_model(m).tp_plan().items():
        if style == "colwise":
            dims.update({f"{path}.weight": 0, f"{path}.bias": 0})
        elif style == "rowwise":
            dims[f"{path}.weight"] = 1
    return dims


def part_of(m: Model, name: str) -> str | int:
    """A parameter's part of the model: "stem", its unit's index, "tail" (``Backbone.part_of``)."""
    return serial_model(m).part_of(name)


# ------------------------------------------------------------------ the layout ---
@dataclass(frozen=True)
class Layout:
    """How ``ranks`` ranks split the model and the batch (the flags of train.py/train_mp.py)."""

    ranks: int = 1
    data_parallel: str = "ddp"  # ddp | zero1 | fsdp | hsdp
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    schedule: str = "1f1b"
    microbatches: int = 4
    stages_per_rank: int = 2  # interleaved schedules only
    checkpointing: str = "none"  # none | full | selective
    batch: int = 16  # global batch
    dp_shard: int = 0  # hsdp: ranks of a sharding group (0: all the data-parallel ranks)
    stashing: str = "stash"  # async_1f1b only: none | stash | vertical | 2bw
    sp: bool = False  # sequence parallelism (with tp): its collectives; its memory counted as tp's

    @property
    def asynchronous(self) -> bool:  # 1F1B with no flush between steps (distributed/async_pipeline.py)
        return self.pp > 1 and self.schedule == "async_1f1b"

    @property
    def dp(self) -> int:
        return self.ranks // (self.tp * self.cp * self.pp)

    @property
    def sharded(self) -> bool:  # FSDP or HSDP over more than one rank
        return self.data_parallel in ("fsdp", "hsdp") and self.dp > 1

    @property
    def shard(self) -> int:  # the ranks that shard each tensor (HSDP: its group; FSDP: all dp ranks)
        return (self.dp_shard or self.dp) if self.data_parallel == "hsdp" else self.dp

    @property
    def local_batch(self) -> int:
        return self.batch // self.dp

    @property
    def chunks(self) -> int:  # pipeline stages per rank
        return self.stages_per_rank if self.schedule in ("interleaved_1f1b", "zero_bubble") else 1

    @property
    def name(self) -> str:
        mode = f"_{self.data_parallel}" if self.data_parallel != "ddp" else ""
        mode += f"{self.shard}" if self.data_parallel == "hsdp" else ""
        parts = [f"dp{self.dp}{mode}" if self.dp > 1 else ""]
        parts += [f"{k}{v}" for k, v in (("tp", self.tp), ("cp", self.cp), ("ep", self.ep)) if v > 1]
        if self.pp > 1:
            parts.append(f"pp{self.pp}_{self.schedule}_m{self.microbatches}")
        if self.asynchronous:
            parts.append(self.stashing)
        if self.checkpointing != "none":
            parts.append(f"ckpt_{self.checkpointing}")
        return "_".join(p for p in parts if p) or "serial"

    def flags(self) -> list[str]:
        """The layout as train_mp.py's flags."""
        f = [f"--global_batch_size={self.batch}", f"--data_parallel={self.data_parallel}",
             f"--tensor_parallel={self.tp}", f"--context_parallel={self.cp}",
             f"--expert_parallel={self.ep}", f"--activation_checkpointing={self.checkpointing}",
             f"--dp_shard={self.dp_shard}"]
        if self.pp > 1:
            f += [f"--pipeline_parallel={self.pp}", f"--pipeline_schedule={self.schedule}",
                  f"--num_microbatches={self.microbatches}", f"--stages_per_rank={self.stages_per_rank}"]
        if self.asynchronous:
            f.append(f"--weight_stashing={self.stashing}")
        return f


def stage_blocks(m: Model, lay: Layout, pp_rank: int) -> tuple[list[int], bool, bool]:
    """The blocks of this pipeline rank's stages, and whether it holds the embedding (first
    stage) and the head (last): distributed/pipeline.py's split, the middle stages one block
    longer when the blocks do not divide."""
    from distributed.pipeline import rank_stages, split_blocks

    n_stages = lay.pp * lay.chunks
    ranges = split_blocks(m.depth, n_stages)
    stages = rank_stages(pp_rank, lay.pp, lay.chunks)
    return [i for s in stages for i in ranges[s]], 0 in stages, n_stages - 1 in stages


# ------------------------------------------------------------------ FLOPs ---
def block_matmuls(m: Model, lay: Layout, block: int) -> dict[str, tuple[int, int, int]]:
    """One block's matrix products for one sample, (rows, inner, columns) each: 2 x rows x inner
    x columns FLOPs. Tensor parallelism splits the heads and the MLP features (columns of qkv
    and fc1, inner dimension of proj and fc2); context parallelism the tokens (rows), except
    that queries meet all N keys. A mixture of experts sends each token to top_k experts
    (balanced routing assumed: the real count depends on the data)."""
    D, F, N, tp = m.dim, m.hidden, m.tokens, lay.tp
    n = N // lay.cp  # this rank's tokens
    mm = {"qkv": (n, D, 3 * D // tp),
          "attention scores": (n, D // tp, N),  # q k^T for h heads of D/h: h x n x (D/h) x N
          "attention values": (n, N, D // tp),  # softmax(..) v
          "proj": (n, D // tp, D)}
    if m.moe(block):
        mm["router"] = (n, D, m.num_experts)
        # the ep ranks' b n k assignments each, spread over the ep ranks' experts: b n k per rank
        # when the routing is balanced (a rank's count depends on the data, the group's does not)
        routed = n * m.top_k
        mm["fc1"], mm["fc2"] = (routed, D, F), (routed, F, D)
    else:
        mm["fc1"], mm["fc2"] = (n, D, F // tp), (n, F // tp, D)
    return mm


def recomputed(lay: Layout, block: int) -> bool:
    """Whether activation checkpointing recomputes this block (selective: every other one)."""
    return lay.checkpointing == "full" or (lay.checkpointing == "selective" and block % 2 == 0)


def flops(m: Model, lay: Layout, pp_rank: int = 0) -> dict[str, int]:
    """Matmul FLOPs of one step on one rank, as torch.utils.flop_counter counts them:
    2 per multiply-add, forward (F) and backward (2 F: the gradient of the input and of the
    weight, each as large as the forward product). The patch embedding's backward is F only:
    the input image needs no gradient. Recomputed blocks (activation checkpointing) run their
    forward again in backward, all but fc2: torch's checkpoint stops recomputing once every
    tensor backward needs is back, and nothing keeps fc2's output."""
    blocks, first, last = stage_blocks(m, lay, pp_rank)
    b = lay.local_batch
    fwd = {"blocks": 0, "recompute": 0}
    for i in blocks:
        mm = block_matmuls(m, lay, i)
        fwd["blocks"] += sum(2 * r * k * c for r, k, c in mm.values())
        if recomputed(lay, i):
            fwd["recompute"] += sum(2 * r * k * c for name, (r, k, c) in mm.items() if name != "fc2")
    if async_recomputes(lay, pp_rank):  # the stage's whole forward again, in backward
        fwd["recompute"] += fwd["blocks"]
    out = {"blocks": 3 * b * fwd["blocks"], "recompute": b * fwd["recompute"]}
    if first:  # a convolution of C_in p p inputs to D outputs per token: a matmul, every token
        out["patch embedding"] = (2 + async_recomputes(lay, pp_rank)) * 2 * b * m.tokens * m.c_in \
            * m.patch**2 * m.dim
    if last:  # on this rank's N / cp tokens
        out["head"] = 3 * 2 * b * (m.tokens // lay.cp) * m.dim * m.c_out * m.patch**2
    out["total"] = sum(out.values())
    return out


def async_recomputes(lay: Layout, pp_rank: int) -> bool:
    """The asynchronous schedule keeps each micro-batch's input and runs the stage's forward again
    in its backward, on every stage but the last (whose backward follows its forward at once)."""
    return lay.asynchronous and pp_rank < lay.pp - 1


# ------------------------------------------------------------------ freezing ---
def freezing_flops(m: Model, batch: int, frozen: int, cached: bool = False) -> dict[str, int]:
    """Matmul FLOPs of one step on one device with the embedding and the first ``frozen`` blocks
    frozen (training/freezing.py). An active block runs forward and backward (3 F, backward about
    twice forward); a frozen one its forward only (F), or nothing when the activation cache holds
    its output; the frozen embedding likewise (F, or nothing; active: 2 F, its input needs no
    gradient). The norm and head always train (3 F)."""
    lay = Layout(batch=batch)
    fwd = [batch * sum(2 * r * k * c for r, k, c in block_matmuls(m, lay, i).values())
           for i in range(m.depth)]  # each block's forward
    embed = 2 * batch * m.tokens * m.c_in * m.patch**2 * m.dim
    frozen_times = 0 if cached else 1
    out = {"active blocks": 3 * sum(fwd[frozen:]), "frozen blocks": frozen_times * sum(fwd[:frozen]),
           "patch embedding": (frozen_times if frozen else 2) * embed,
           "head": 3 * 2 * batch * m.tokens * m.dim * m.c_out * m.patch**2}
    out["total"] = sum(out.values())
    return out


def cache_bytes(m: Model, samples: int, element: int = E) -> int:
    """The activation cache when it holds every sample: each sample's frozen-prefix output is its
    N tokens of width D (fp32), whatever the number of frozen blocks."""
    return samples * m.tokens * m.dim * element


def freezing_table(m: Model, batch: int, samples: dict[str, int]) -> str:
    """Per number of frozen blocks, the step's FLOPs against nothing frozen, without and with the
    cache; then the cache's size for the given data sets."""
    whole = freezing_flops(m, batch, 0)["total"]
    lines = ["| frozen blocks | step FLOPs, recomputed | with the cache |", "|---|---|---|"]
    for k in range(m.depth + 1):
        lines.append(f"| {k} | {freezing_flops(m, batch, k)['total'] / whole:.2f} | "
                     f"{freezing_flops(m, batch, k, cached=True)['total'] / whole:.2f} |")
    lines.append("")
    per = cache_bytes(m, 1)
    lines += [f"cache: {per / 2**10:.0f} KiB per sample ({m.tokens} tokens x {m.dim} x 4 bytes)"]
    lines += [f"  {name}: {n} samples, {cache_bytes(m, n) / MIB:,.1f} MiB" for name, n in samples.items()]
    return "\n".join(lines)


# ------------------------------------------------------------------ memory ---
def weight_versions(lay: Layout, pp_rank: int = 0) -> int:
    """Weight versions a pipeline rank holds at most, its newest weights included (one for every
    synchronous schedule). The asynchronous schedule with m micro-batches per step: stage s keeps
    d = p - 1 - s micro-batches in flight beyond the newest and updates every m of them, so with
    stashing the versions its forwards used span 1 + ceil(d / m) (p - s at m = 1); vertical sync
    and 2BW use the first stage's version for each micro-batch, ceil((p - 1) / m) updates behind
    the newest, on every stage: p versions at m = 1, 2 with m >= p - 1 (2BW's two buffers)."""
    if not lay.asynchronous or lay.stashing == "none":
        return 1
    behind = lay.pp - 1 - pp_rank if lay.stashing == "stash" else lay.pp - 1
    return 1 + math.ceil(behind / lay.microbatches)


def tp_shape(m: Model, name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """This tp rank's part of a parameter (the ViT: qkv and fc1 split by rows, proj and fc2
    weights by columns; norms, embedding, head and experts replicated)."""
    dim = tp_dims(m).get(name)
    if tp == 1 or dim is None:
        return shape
    return tuple(n // tp if d == dim else n for d, n in enumerate(shape))


def rank_parameters(m: Model, lay: Layout, pp_rank: int = 0) -> list[tuple[str, tuple[int, ...]]]:
    """The parameters this rank's model part has (before any data-parallel sharding)."""
    blocks, first, last = stage_blocks(m, lay, pp_rank)
    keep = []
    for name, shape in parameter_shapes(m):
        part = part_of(m, name)
        if isinstance(part, int):
            if part not in blocks:
                continue
            if ".experts." in name and int(name.split(".")[4]) // (m.num_experts // lay.ep) != 0:
                continue  # expert parallel: rank i of an ep block holds experts i E/ep ... (i+1) E/ep - 1
                # (rank 0 here; every rank holds as many)
        elif part == "stem" and not first or part == "tail" and not last:
            continue
        keep.append((name, tp_shape(m, name, shape, lay.tp)))
    return keep


def fsdp_rows(rows: int, dp: int, dp_rank: int) -> int:
    """FSDP2 shards dim 0 as torch.chunk does: ceil(rows / dp) each, the last ranks what is left
    (a (1, N, D) positional embedding: all on rank 0, nothing on the others)."""
    per = math.ceil(rows / dp)
    return max(0, min(per, rows - dp_rank * per))


def zero1_owner(shapes: list[tuple[str, tuple[int, ...]]], dp: int) -> dict[str, int]:
    """ZeroRedundancyOptimizer's partition: largest tensors first, each to the rank that owns the
    fewest elements so far (the first such rank)."""
    sizes, owner = [0] * dp, {}
    for name, shape in sorted(shapes, key=lambda s: math.prod(s[1]), reverse=True):
        r = sizes.index(min(sizes))
        owner[name] = r
        sizes[r] += math.prod(shape)
    return owner


def activation_bytes(m: Model, lay: Layout, pp_rank: int = 0, dtype: str = "float32") -> dict[str, int]:
    """Bytes autograd keeps for backward at the peak of one step, counted tensor by tensor (the
    page lists them). Per token of a block: its input x, the normalised x (saved by qkv), the
    q/k/v projection (3D / tp), the attention output (D / tp) and its log-sum-exp (h / tp), x
    after attention, its normalisation, fc1's output and GELU's (F / tp each), and two floats of
    mean and 1/std per layer norm: 4 D + 4 + (4 D + h + 2 F) / tp. Context parallelism adds the
    gathered keys and values (2 N D / tp per sample); a checkpointed block keeps its input only.
    A pipeline stage holds the micro-batches in flight: all m (GPipe), pp - rank (1F1B); the
    asynchronous pipeline, one micro-batch's (it recomputes each forward in backward). A mixture
    of experts' block is an estimate (balanced routing; the indices it keeps are left out): not
    checked.

    ``dtype`` bfloat16 (or float16): the run's matmuls under autocast. They save their inputs
    and outputs in 2 bytes (the normalised x, q/k/v, the attention output, fc1's and GELU's
    outputs, the head's input, the patch embedding's input) and a 2-byte copy of each weight
    they use; the residual stream x, the layer norms' statistics, the log-sum-exp and the
    loss stay fp32."""
    D, F, h, N, tp = m.dim, m.hidden, m.heads, m.tokens, lay.tp
    low = 2 if dtype in ("bfloat16", "float16") else E  # bytes of a matmul's saved element
    n = N // lay.cp
    blocks, first, last = stage_blocks(m, lay, pp_rank)

    def per_sample_block(i: int, kept: bool) -> int:
        if not kept:  # checkpointed: the input only
            return E * n * D
        # x and x after attention (the residual stream), the norms' statistics, the two normalised x
        replicated = E * n * (2 * D + 4) + low * n * 2 * D
        if m.moe(i):  # router logits and probabilities, then each routed token's MLP (balanced)
            mlp = E * n * 2 * m.num_experts + low * n * m.top_k * (D + 2 * F)  # balanced: see block_matmuls
            return replicated + low * (n * 4 * D // tp) + E * (n * h // tp) + mlp
        split = low * (n * (4 * D + 2 * F) // tp) + E * (n * h // tp)
        return replicated + split + (low * 2 * N * D // tp if lay.cp > 1 else 0)

    ckpt = {i: not recomputed(lay, i) for i in blocks}
    sample = {"blocks": sum(per_sample_block(i, ckpt[i]) for i in blocks)}
    if last:  # final norm's input and stats, the head's input; the loss keeps pred - target, and
        sample["head and loss"] = E * n * (D + 2) + low * n * D + E * (m.c_out * m.pixels + m.c_out)
        # ||target||^2 per channel
    if first and lay.cp > 1:  # the first block's input is a slice (a view) of the whole sequence
        sample["blocks"] += E * (N - n) * D
    b = lay.local_batch
    if lay.asynchronous:  # autograd holds one micro-batch's at a time (the others: their inputs)
        b = b // lay.microbatches  # the recomputed convolution keeps its micro-batch's input
        out = {k: v * b for k, v in sample.items()}
    elif lay.pp > 1:  # micro-batches alive at once on this rank
        flight = lay.microbatches if lay.schedule == "gpipe" else min(lay.microbatches, lay.pp - pp_rank)
        if lay.chunks > 1:  # interleaved: each chunk's micro-batches in flight, at most all
            flight = min(lay.microbatches, lay.pp - pp_rank + (lay.chunks - 1) * lay.pp)
        per_mb = b // lay.microbatches
        out = {k: v * per_mb * flight for k, v in sample.items()}
    else:
        out = {k: v * b for k, v in sample.items()}
    if first:  # the convolution keeps the input batch (micro-batches are views of it)
        out["input"] = low * b * m.c_in * m.pixels
    if low != E:  # autocast's low-precision copy of each weight a kept forward multiplies by
        out["weight copies"] = low * sum(math.prod(s) for name, s in rank_parameters(m, lay, pp_rank)
                                         if _matmul_weight(name) and ckpt.get(_block_of(m, name), True))
    out["total"] = sum(out.values())
    return out


def _matmul_weight(name: str) -> bool:
    return name.endswith("weight") and not name.split(".")[-2].startswith("norm")


def _block_of(m: Model, name: str) -> int | None:
    part = part_of(m, name)
    return part if isinstance(part, int) else None


def memory(m: Model, lay: Layout, pp_rank: int = 0, dp_rank: int = 0,
           dtype: str = "float32") -> dict[str, int]:
    """Bytes this rank holds, by kind. Adam keeps two moments per element and a 4-byte step count
    per tensor. ddp: everything; zero1: the moments of the tensors it owns; fsdp: its dim-0 shard
    of everything (hsdp: its shard within its group). Also: the recomputed block of activation
    checkpointing (one block's activations while its backward runs) and FSDP's communication
    buffers (one block's gathered weights and gradients, the next block's prefetched weights), the
    batch's input and target on the device; not checked: none is in the tensors a run can count
    on a CPU (scripts/dry_run.py counts them). ``dtype``: the matmuls' precision under autocast
    (the activations, see activation_bytes); weights, gradients and Adam's state stay fp32.
    The asynchronous pipeline holds older versions of its weights (:func:`weight_versions`,
    checked) and the inputs of the micro-batches in flight (not
    checked: they are not autograd's)."""
    shapes = rank_parameters(m, lay, pp_rank)
    if lay.sharded:  # HSDP's groups are rows of dp_shard consecutive data-parallel ranks
        local = {n: fsdp_rows(s[0], lay.shard, dp_rank % lay.shard) * math.prod(s[1:]) for n, s in shapes}
        owned = set(local)
    else:
        local = {n: math.prod(s) for n, s in shapes}
        owner = zero1_owner(shapes, lay.dp) if lay.data_parallel == "zero1" and lay.dp > 1 else {}
        owned = {n for n in local if owner.get(n, dp_rank) == dp_rank}
    act = activation_bytes(m, lay, pp_rank, dtype)
    out = {"parameters": E * sum(local.values()), "gradients": E * sum(local.values()),
           "optimizer_state": sum(2 * E * local[n] + 4 for n in owned),
           "activations": act["total"]}
    extra = {}
    if lay.asynchronous:  # older versions of the weights; the inputs of the micro-batches in flight
        out["weight versions"] = (weight_versions(lay, pp_rank) - 1) * out["parameters"]
        first = stage_blocks(m, lay, pp_rank)[1]
        one = (m.c_in * m.pixels if first else m.tokens * m.dim) * E * (lay.local_batch // lay.microbatches)
        extra["inputs in flight"] = (lay.pp - 1 - pp_rank) * one
    if lay.checkpointing != "none":
        blocks = stage_blocks(m, lay, pp_rank)[0]
        full = activation_bytes(m, replace(lay, checkpointing="none", pp=1, ranks=lay.ranks // lay.pp),
                                dtype=dtype)
        extra["recompute (one block)"] = (full["blocks"] // max(1, m.depth)) if blocks else 0
    if lay.sharded:
        block = sum(math.prod(s) for n, s in shapes if part_of(m, n) == 0)
        extra["fsdp buffers"] = E * 3 * block  # gathered weights (this and the next block), gradients
    first, last = stage_blocks(m, lay, pp_rank)[1:]
    low = 2 if dtype in ("bfloat16", "float16") else E  # the batch on the device: the fp32 input (when
    # autocast keeps a 2-byte copy instead), the target (the loss keeps only pred - target)
    extra["the batch"] = E * lay.local_batch * m.pixels * ((m.c_in if first and low != E else 0)
                                                           + (m.c_out if last else 0))
    out["total"] = sum(out.values())
    return {**out, **{f"{k} (not checked)": v for k, v in extra.items()}}


# ------------------------------------------------------------------ communication ---
def padded(shapes: list[tuple[str, tuple[int, ...]]], dp: int) -> int:
    """Elements FSDP all-gathers for these tensors: every rank's shard padded to ceil(rows / dp)."""
    return sum(dp * math.ceil(s[0] / dp) * math.prod(s[1:]) for _, s in shapes)


def tensor_parallel_parts(m: Model, lay: Layout, shapes: list[tuple[str, tuple[int, ...]]], blocks: int,
                          recomputed_blocks: int,
                          mbs: int, low: int, last: bool) -> list[tuple]:
    """collective_parts' tensor-parallel collectives of L blocks (R of them recomputed), ``low``
    bytes per element of the matmuls' outputs."""
    D, N, b, tp = m.dim, m.tokens, lay.local_batch, lay.tp
    L, R = blocks, recomputed_blocks  # noqa: N806 (the page's symbols)
    if lay.sp:  # per block: gather the normalised tokens before qkv and fc1 (fp32), and
        # again in backward for their weight gradients (not kept); reduce-scatter proj's and fc2's
        # outputs, and all-gather their gradients in backward; the head's output gathered.
        # The parameters that tp does not split sum their gradients over tp.
        n_pad = tp * math.ceil(N / tp)
        tokens = b * n_pad * D
        head = low * b * n_pad * m.c_out * m.patch**2 if last else 0
        whole = [s for name, s in shapes if tp_shape(m, name, s, tp) == s]
        return [("all_gather", tp, L * (2 * E + 2 * (low + E)) * tokens + head, 6 * L + last, "tp"),
                ("reduce_scatter", tp, L * 4 * low * tokens, 4 * L, "tp"),
                ("all_reduce", tp, E * sum(math.prod(s) for s in whole), len(whole), "tp")]
    # Megatron: forward sums proj's and fc2's partial outputs, backward the input gradients of
    # qkv and fc1 (each (b, n, D))
    back = low if lay.sharded else E  # FSDP's bf16 policy computes in bf16 throughout
    forward = (2 * L + R) * low * b * (N // lay.cp) * D  # proj's and fc2's outputs (again if recomputed)
    backward = 2 * L * back * b * (N // lay.cp) * D  # the input gradients of qkv and fc1
    return [("all_reduce", tp, forward + backward, (4 * L + R) * mbs, "tp")]


def data_parallel_parts(m: Model, lay: Layout, shapes: list[tuple[str, tuple[int, ...]]],
                        blocks: list[int], moe: list[int], low: int, grad_element: int) -> list[tuple]:
    """collective_parts' data-parallel collectives: FSDP's and HSDP's, DDP's (experts too), ZeRO-1's."""
    parts: list[tuple] = []
    L = len(blocks)  # noqa: N806 (the page's symbol)
    grad_bytes = E * sum(math.prod(s) for _, s in shapes)
    if lay.sharded:  # blocks gathered in forward and again in backward; the root (embedding,
        # norm, head) once: it is not resharded after forward. HSDP gathers within its group,
        # then all-reduces its gradient shard with the other groups
        g = lay.shard
        block_elems = [padded([s for s in shapes if part_of(m, s[0]) == i], g) for i in blocks]
        root = padded([s for s in shapes if not isinstance(part_of(m, s[0]), int)], g)
        # a pipeline stage gathers its blocks for each micro-batch's forward, then once for all
        # the backwards (torch's schedule keeps them gathered until the last)
        passes = lay.microbatches + 1 if lay.pp > 1 else 2
        gathered = low * (passes * sum(block_elems) + root)
        parts.append(("all_gather", g, gathered, passes * L + 1, "dp_shard"))
        parts.append(("reduce_scatter", g, E * (sum(block_elems) + root), L + 1, "dp_shard"))
        if lay.dp > g:
            shard_bytes = E * (sum(block_elems) + root) // g
            parts.append(("all_reduce", lay.dp // g, shard_bytes, L + 1, "dp"))
    elif lay.ep > 1 and moe:  # DDP's hook: the experts' gradients over the ranks that hold the
        # same experts (none when ep = dp), the others over dp, one call each per bucket
        experts = E * sum(math.prod(s) for n, s in shapes if ".experts." in n)
        calls = ddp_buckets(grad_bytes)
        parts.append(("all_reduce", lay.dp, grad_bytes - experts, calls, "dp"))
        if lay.dp > lay.ep:
            parts.append(("all_reduce", lay.dp // lay.ep, experts, calls, "ep_replicas"))
    else:  # DDP's bucketed all-reduce (one flat all-reduce after a pipeline's flush)
        calls = ddp_buckets(grad_bytes) if lay.pp == 1 else 1
        parts.append(("all_reduce", lay.dp, grad_bytes * grad_element // E, calls, "dp"))
        if lay.data_parallel == "zero1":  # each owner broadcasts its updated tensors
            parts.append(("broadcast", lay.dp, grad_bytes, len(shapes), "dp"))
    return parts


def collective_parts(m: Model, lay: Layout, pp_rank: int = 0, with_dims: bool = False,
                     dtype: str = "float32", grad_element: int = E) -> list[tuple]:
    """(kind, group size, bytes, calls) of every collective one step runs on this rank (and the
    mesh dimension it runs over, ``with_dims``): an
    all-reduce or broadcast counts its tensor, an all-gather its whole output, a reduce-scatter
    its whole input, a send or receive its tensor. ``dtype`` bfloat16: the run's matmuls under
    autocast, whose outputs tensor parallelism sums in 2 bytes in forward (backward's gradients
    are fp32: they flow back to fp32 inputs), or FSDP's bf16 policy, which gathers 2-byte weights
    and computes in bf16 throughout (its gradients reduce in fp32). ``grad_element``: bytes per
    gradient element DDP sends (2 with bf16 or fp16 compression)."""
    D, N, b, tp = m.dim, m.tokens, lay.local_batch, lay.tp
    low = 2 if dtype in ("bfloat16", "float16") else E
    blocks, first, last = stage_blocks(m, lay, pp_rank)
    shapes = rank_parameters(m, lay, pp_rank)
    grad_bytes = E * sum(math.prod(s) for _, s in shapes)
    parts: list[tuple] = []
    L = len(blocks)
    R = sum(recomputed(lay, i) for i in blocks)  # recomputing a block runs its forward's collectives
    # again, up to fc2 (where torch's checkpoint stops, see flops())
    mbs = lay.microbatches if lay.pp > 1 else 1  # a pipeline runs each micro-batch's collectives
    if tp > 1:
        parts += tensor_parallel_parts(m, lay, shapes, L, R, mbs, low, last)
    if lay.cp > 1:  # keys and values gathered in forward; in backward their gradients summed
        # and scattered (a reduce-scatter of every rank's slice padded to the longest); the head's
        # output gathered
        # (keys and values are the qkv matmul's outputs: 2 bytes under autocast, their gradients too)
        parts.append(("all_gather", lay.cp, 2 * (L + R) * low * b * N * D // tp, 2 * (L + R), "cp"))
        padded_n = lay.cp * math.ceil(N / lay.cp)
        parts.append(("reduce_scatter", lay.cp, 2 * L * low * b * padded_n * D // tp, 2 * L, "cp"))
        if last:
            parts.append(("all_gather", lay.cp, low * b * N * m.c_out * m.patch**2, 1, "cp"))
        # every gradient summed over cp: by each parameter's hook, or per DDP bucket when DDP runs
        ddp = lay.dp > 1 and lay.pp == 1 and not lay.sharded
        calls = ddp_buckets(grad_bytes) if ddp else len(shapes)
        parts.append(("all_reduce", lay.cp, grad_bytes, calls, "cp"))
    if lay.pp > 1:
        mb = E * (b // lay.microbatches) * N * D  # one micro-batch's tokens at a stage boundary
        # per micro-batch each stage sends its output on (not the last) and its input's
        # gradient back (not the first)
        sends = lay.microbatches * (2 * lay.chunks - (pp_rank == lay.pp - 1) - (pp_rank == 0))
        parts += [("send", 2, sends * mb, sends, "pp"), ("recv", 2, sends * mb, sends, "pp")]
        parts.append(("all_reduce", lay.pp, 4, 1, "pp"))  # the batch's loss, shared by the stages
    moe = [i for i in blocks if m.moe(i)]
    if lay.ep > 1 and moe:  # per mixture of experts: the counts per expert (int64), the tokens to
        # their experts' ranks and the outputs back; backward sends each gradient the reverse way.
        # A rank sends its own b n k assignments (dropless routing); what it receives depends on
        # the routing: balanced here, so the ep group's total is exact, a rank's only on average
        a = b * (N // lay.cp) * m.top_k * D  # elements; forward's in the matmuls' precision
        per_layer = 8 * m.num_experts + 2 * (low + E) * a
        parts.append(("all_to_all", lay.ep, len(moe) * per_layer, 5 * len(moe), "ep"))
    if lay.dp > 1:
        parts += data_parallel_parts(m, lay, shapes, blocks, moe, low, grad_element)
    return parts if with_dims else [p[:4] for p in parts]


def collectives(m: Model, lay: Layout, pp_rank: int = 0) -> dict[str, tuple[int, int]]:
    """(bytes, calls) per kind of collective in one step on this rank."""
    out: dict[str, tuple[int, int]] = {}
    for kind, _, nbytes, calls in collective_parts(m, lay, pp_rank):
        was = out.get(kind, (0, 0))
        out[kind] = (was[0] + nbytes, was[1] + calls)
    return out


def onebit_bytes_per_step(n: int, ranks: int) -> int:
    """What 1-bit Adam (distributed/onebit_adam.py) hands its collectives in a step after its
    warm-up, on one of ``ranks`` ranks, for ``n`` parameters: its signs (8 to a byte, each rank's
    chunk padded to whole bytes) to the all-to-all, its chunk of the average's signs to the
    all-gather, two fp32 scales. Adam's all-reduce takes 4 n."""
    chunk = 8 * math.ceil(n / (8 * ranks))
    return ranks * chunk // 8 + chunk // 8 + 2 * 4


def ddp_buckets(nbytes: int, cap_mb: float = 25.0) -> int:
    """DDP's all-reduce calls per step: buckets of cap_mb (DDP rebuilds its buckets in the order
    of the first backward; a bucket closes at the first tensor that takes it past the cap)."""
    return max(1, math.ceil(nbytes / (cap_mb * MIB)))


# ------------------------------------------------------------------ time ---
def layer_costs(m: Model, lay: Layout, pp_rank: int = 0) -> list[tuple[str, float, float]]:
    """(layer, FLOPs, bytes moved) of one step on this rank, forward and backward together: a
    matmul moves its two inputs and its output (E (r k + k c + r c)); a layer norm, GELU or
    residual add reads and writes its tensors (2 or 3 per element) and does next to no
    arithmetic. Backward does twice the forward's work of each (three times in all)."""
    blocks, first, last = stage_blocks(m, lay, pp_rank)
    b, D, F, tp = lay.local_batch, m.dim, m.hidden, lay.tp
    n = m.tokens // lay.cp
    out: list[tuple[str, float, float]] = []
    for i in blocks:
        again = recomputed(lay, i)
        stage_again = async_recomputes(lay, pp_rank)
        for name, (r, k, c) in block_matmuls(m, lay, i).items():
            # forward, backward (2x), the recomputed forward
            times = 3 + (again and name != "fc2") + stage_again
            out.append((name, times * b * 2 * r * k * c, times * E * (b * r * k + k * c + b * r * c)))
        elementwise = n * (2 * D + 2 * D + 3 * D + 3 * D) + n * 2 * F // tp  # norms, adds, GELU
        out.append(("norms, GELU, residuals", 0.0, (3 + again + stage_again) * E * b * elementwise))
    if first:
        k_in = m.c_in * m.patch**2
        times = 2 + async_recomputes(lay, pp_rank)
        out.append(("patch embedding", times * 2 * b * m.tokens * k_in * D,
                    times * E * (b * m.tokens * k_in + k_in * D + b * m.tokens * D)))
    if last:
        k_out = m.c_out * m.patch**2
        out.append(("head", 3 * 2 * b * n * D * k_out, 3 * E * (b * n * D + D * k_out + b * n * k_out)))
        out.append(("norm and loss", 0.0, 3 * E * b * (2 * n * D + 3 * m.c_out * m.pixels)))
    return out


def machine_for(machine: dict[str, Any], ranks: int) -> dict[str, Any]:
    """The compute constants of one of ``ranks`` ranks running at once: measured for that many
    on a CPU (they share its cores); a GPU's own, whatever the number."""
    if "by_ranks" not in machine:
        return machine
    by = machine["by_ranks"]
    key = str(ranks) if str(ranks) in by else max(by, key=int)
    return by[key]


# the share of a collective's payload that crosses each rank's link in a ring (NCCL's algorithm
# for large messages): an all-reduce is a reduce-scatter then an all-gather
RING = {"all_reduce": lambda g: 2 * (g - 1) / g, "all_gather": lambda g: (g - 1) / g,
        "reduce_scatter": lambda g: (g - 1) / g, "all_to_all": lambda g: (g - 1) / g,
        "broadcast": lambda g: 1.0, "send": lambda g: 1.0}


def collective_seconds(machine: dict[str, Any], kind: str, group: int, nbytes: float, calls: int,
                       spans_nodes: bool = False) -> float:
    """calls x latency + bytes / bandwidth. Measured machines: the latency and payload bandwidth
    fitted for this kind and group size (or the nearest larger one measured). GPU systems: the
    link's (NVLink in a node, the network across nodes) latency and bandwidth, with the ring's
    share of the payload. A receive is timed with its send."""
    if kind == "recv":
        return 0.0
    if "links" in machine:
        latency, bandwidth = machine["links"]["network" if spans_nodes else "node"]
        return calls * latency + RING[kind](group) * nbytes / bandwidth
    by = machine["by_ranks"]
    sizes = sorted(int(k) for k in by if "collectives" in by[k])
    size = next((s for s in sizes if s >= group), sizes[-1])
    latency, bandwidth = by[str(size)]["collectives"][kind]
    return calls * latency + nbytes / bandwidth


def step_time(m: Model, lay: Layout, machine: dict[str, Any], dtype: str = "float32") -> dict[str, float]:
    """Seconds of one step: each layer at the slower of its arithmetic (FLOPs / achieved matmul
    FLOP/s) and its memory traffic (bytes / bandwidth), the roofline; Adam; every collective
    (latency + bytes / bandwidth); for a flushed pipeline the bubble. What overlaps: on a GPU
    machine, ``overlap`` of the gradient synchronisation hides behind backward; on this CPU
    nothing does (gloo's threads share the cores with the computation). The slowest rank sets
    the step's time."""
    c = machine_for(machine, lay.ranks)
    rate = c["matmul_flops"][dtype]
    moved = 0.5 if dtype != "float32" else 1.0  # bf16/fp16 activations: half the bytes
    per_node = machine.get("gpus_per_node") or lay.ranks
    # the ranks of a tp, cp or pp group are neighbours (parallel_order tp-cp-dp, pp slowest):
    # a group leaves the node when it is larger than the node, dp when the model group times dp is
    spans = {"tp": lay.tp > per_node, "cp": lay.tp * lay.cp > per_node, "dp": lay.ranks > per_node,
             "ep": lay.tp * lay.cp * lay.ep > per_node,
             "dp_shard": lay.tp * lay.cp * lay.shard > per_node, "pp": lay.ranks > per_node}
    per_rank = []
    for pp_rank in range(lay.pp):
        compute = 0.0
        for name, f, by in layer_costs(m, lay, pp_rank):
            big = "large" if f > 0 and by and f / by > 64 else "small"  # arithmetic intensity
            if name.startswith("attention") and "attention" in rate:  # the fused kernel's own rate
                big = "attention"
            compute += max(f / rate[big] if f else 0.0, moved * by / c["memory_bandwidth"])
        mem = memory(m, lay, pp_rank)
        optimizer = mem["optimizer_state"] / (2 * E) * c["adam_seconds_per_parameter"]
        comm = {"gradients": 0.0, "activations": 0.0}
        for kind, group, nbytes, calls, dim in collective_parts(m, lay, pp_rank, with_dims=True):
            if not dim.startswith("dp"):  # activations travel in the compute dtype (gradients: fp32)
                nbytes *= moved
            seconds = collective_seconds(machine, kind, group, nbytes, calls, spans[dim])
            comm["gradients" if dim.startswith("dp") else "activations"] += seconds
        hidden = min(comm["gradients"], machine.get("overlap", 0.0) * compute * 2 / 3)
        per_rank.append({"compute": compute, "optimizer": optimizer, "communication":
                         comm["gradients"] - hidden + comm["activations"]})
    worst = max(per_rank, key=lambda r: sum(r.values()))
    out = dict(worst)
    if lay.pp > 1 and not lay.asynchronous:  # (the asynchronous pipeline fills once per run and
        # never drains but for a checkpoint: no bubble in a step)
        # The bubble: (pp - 1) stage-steps of one micro-batch while the pipeline fills
        # and drains; interleaving makes a stage-step 1/v as long; zero bubble fills about two
        # thirds of it with the weight gradients (a rough figure: it depends on the schedule)
        stage = sum(r["compute"] + r["communication"] for r in per_rank) / lay.pp / lay.microbatches
        bubble = (lay.pp - 1) * stage / lay.chunks
        cores = machine.get("cores")
        if cores and lay.ranks > cores:  # ranks share the cores: one that waits lends its core
            bubble *= cores / lay.ranks
        out["pipeline bubble"] = bubble / 3 if lay.schedule == "zero_bubble" else bubble
    out["total"] = sum(out.values())
    return out


# ------------------------------------------------------------------ known GPU systems ---
# Vendor peak figures (dense, no sparsity). The model uses them as they are: on a GPU it
# predicts what the hardware allows, and the gap to a published run is what the code leaves
# on the table (kernel efficiency, launches, the data loader).
GPU_SYSTEMS: dict[str, dict[str, Any]] = {
    "a100-perlmutter": {
        "name": "Perlmutter GPU node: 4 x A100-SXM4 40 GB, NVLink 3, Slingshot 11 (vendor peaks)",
        "source": "NVIDIA A100 datasheet (312 TFLOP/s bf16, 156 TF32, 19.5 fp32; 1555 GB/s HBM2); "
                  "NERSC Perlmutter architecture page (4 NVLink 3 links of 25 GB/s per direction between "
                  "each pair of a node's GPUs: 300 GB/s per GPU, which NCCL's rings share out; 4 Slingshot "
                  "11 NICs of 25 GB/s per node)",
        "gpus_per_node": 4, "overlap": 1.0,
        "matmul_flops": {"bfloat16": {"large": 312e12, "small": 312e12},
                         "float32": {"large": 156e12, "small": 156e12}},  # fp32 matmuls on TF32 cores
        "memory_bandwidth": 1555e9, "adam_seconds_per_parameter": 16 * 4 / 1555e9,  # 16 fp32 reads+writes
        "links": {"node": [10e-6, 300e9], "network": [20e-6, 25e9]},
    },
    "h100-node": {
        "name": "4 x H100-SXM5 80 GB, NVLink 4, 4 x 200 Gb/s network (vendor peaks)",
        "source": "NVIDIA H100 datasheet (989 TFLOP/s bf16, 494 TF32; 3.35 TB/s HBM3; NVLink 4 "
                  "900 GB/s per GPU, both directions); 200 Gb/s (25 GB/s) per NIC",
        "gpus_per_node": 4, "overlap": 1.0,
        "matmul_flops": {"bfloat16": {"large": 989e12, "small": 989e12},
                         "float32": {"large": 494e12, "small": 494e12}},
        "memory_bandwidth": 3350e9, "adam_seconds_per_parameter": 16 * 4 / 3350e9,
        "links": {"node": [10e-6, 450e9], "network": [20e-6, 25e9]},
    },
}

# Published results of the original tutorials (NERSC's SC23 and SC25 "Deep Learning at Scale"),
# as (tutorial, what, config, layout, dtype, samples/s published). Each tutorial's first row, its
# single-GPU run, calibrates the share of the vendor peak its code achieves (see `published`).
# The mp runs are on 4 nodes (16 GPUs, tensor or context parallel 4 inside a node, data parallel
# 4 across): SC23 says so; SC25's memory per GPU (26.6 and 29.3 GB for 64 samples) only fits so.
PUBLISHED = (
    ("SC23", "single A100, last rung (bf16, fused Adam, compile)", "short_opt", Layout(1), 42.8),
    ("SC23", "mp, tensor parallel 4 x data parallel 4, 16 A100s", "mp", Layout(16, tp=4, batch=64), 114.4),
    ("SC23", "mp, data parallel 4 (no tensor parallelism), 4 x 80 GB A100s", "mp", Layout(4, batch=64), 48.0),
    ("SC25", "single A100, bf16 + fused Adam + compile", "short_opt", Layout(1), 64.0),
    ("SC25", "data parallel, 4 A100s (1 node), batch 64", "bs64_opt", Layout(4, batch=64), 203.0),
    ("SC25", "data parallel, 64 A100s (16 nodes), batch 1024", "bs1024_opt", Layout(64, batch=1024), 2545.0),
    ("SC25", "mp, tensor parallel 4 x data parallel 4, 16 A100s", "mp", Layout(16, tp=4, batch=64), 126.4),
    ("SC25", "mp, context parallel 4 x data parallel 4, 16 A100s", "mp", Layout(16, cp=4, batch=64), 165.9),
)


def at_efficiency(machine: dict[str, Any], share: float) -> dict[str, Any]:
    """The machine with its arithmetic and memory running at ``share`` of their peaks."""
    rates = {d: {k: v * share for k, v in r.items()} for d, r in machine["matmul_flops"].items()}
    return {**machine, "matmul_flops": rates, "memory_bandwidth": machine["memory_bandwidth"] * share,
            "adam_seconds_per_parameter": machine["adam_seconds_per_parameter"] / share}


def published(yaml_config: str) -> list[dict[str, Any]]:
    """The model's samples/s for each published run on a Perlmutter A100 node: at the vendor's
    peaks, and at the share of them the tutorial's own single-GPU run achieved."""
    from utils.config import load_config

    a100, share, rows = GPU_SYSTEMS["a100-perlmutter"], {}, []
    for tutorial, what, name, lay, samples in PUBLISHED:
        m = Model.from_config(load_config(yaml_config, name))
        at_peak = lay.batch / step_time(m, lay, a100, "bfloat16")["total"]
        share.setdefault(tutorial, samples / at_peak)
        achieved = lay.batch / step_time(m, lay, at_efficiency(a100, share[tutorial]), "bfloat16")["total"]
        rows.append({"run": f"{tutorial} {what}", "layout": lay.name, "peak": at_peak,
                     "share": share[tutorial], "predicted": achieved, "published": samples})
    return rows


def load_machine(path: Path | None, out: Path) -> dict[str, Any] | None:
    """A constants file, a known GPU system by name, or (no path) the one --calibrate wrote in
    ``out`` if there is one."""
    if path is None:
        mine = out / CONSTANTS_FILE
        return json.loads(mine.read_text()) if mine.is_file() else None
    if str(path) in GPU_SYSTEMS:
        return GPU_SYSTEMS[str(path)]
    if not Path(path).is_file():
        raise SystemExit(f"error: no machine constants at {path}: run `python scripts/cost_model.py "
                         f"--calibrate` or name one of {', '.join(GPU_SYSTEMS)}")
    return json.loads(Path(path).read_text())


# ------------------------------------------------------------------ roofline ---
def block_layers(m: Model, batch: int = 1) -> list[tuple[str, float, float]]:
    """(layer, FLOPs, bytes) of one block's forward for ``batch`` samples, serial, fp32."""
    return [(name, f / 3, by / 3) for name, f, by in layer_costs(m, Layout(1, batch=batch))[:7]]


def plot_roofline(m: Model, machines: list[tuple[dict[str, Any], str]], path: Path) -> None:
    """Attainable FLOP/s = min(peak, intensity x bandwidth) of each machine, with one block's
    layers (16 samples) placed at their arithmetic intensity (FLOPs per byte moved, in the
    machine's dtype)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(machines), figsize=(5.5 * len(machines), 4.2), squeeze=False)
    for ax, (machine, dtype) in zip(axes[0], machines):
        c = machine_for(machine, 1)
        peak, bw = c["matmul_flops"][dtype]["large"], c["memory_bandwidth"]
        per_byte = 2.0 if dtype != "float32" else 1.0  # bf16: half the bytes, twice the intensity
        xs = [2.0**k for k in range(-4, 13)]
        ax.loglog(xs, [min(peak, x * bw) for x in xs], color="0.3")
        ax.axvline(peak / bw, color="0.7", ls=":")
        points: dict[float, list[str]] = {}  # layers of the same intensity share one label
        for name, f, by in block_layers(m, batch=16):
            x = max(per_byte * f / by, 2.0**-3)  # the element-wise layers do next to no arithmetic
            points.setdefault(round(x, 1), []).append(name)
        for k, (x, names) in enumerate(sorted(points.items())):
            ax.scatter(x, min(peak, x * bw), s=20)
            ax.annotate(", ".join(names), (x, min(peak, x * bw)), fontsize=7, textcoords="offset points",
                        xytext=(4, -10 - 9 * (k % 3)))
        ax.set(xlabel="arithmetic intensity (FLOPs per byte)", ylabel=f"attainable {dtype} FLOP/s",
               title=f"{machine['name'][:48]}\nridge at {peak / bw:.0f} FLOP/byte")
        ax.title.set_fontsize(8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------ plan ---
def candidate_layouts(m: Model, ranks: int, batch: int, cfg: Any = None, per_node: int = 0,
                      microbatches: int = 4) -> list[Layout]:
    """Every layout of ``ranks`` ranks that divides this model and batch (and, given the run's
    ``cfg``, that the project's configuration checks accept: some dimensions do not combine).
    HSDP appears where the data-parallel ranks span more than one node of ``per_node`` ranks."""
    from utils.config import with_overrides

    out = []
    divisors = [d for d in range(1, ranks + 1) if ranks % d == 0]
    for tp in divisors:
        for cp in divisors:
            for pp in divisors:
                if ranks % (tp * cp * pp):
                    continue
                dp = ranks // (tp * cp * pp)
                if (m.heads % tp or m.hidden % tp or m.tokens % cp or m.depth < pp or batch % dp
                        or pp > 1 and (batch // dp) % microbatches):
                    continue
                modes = [("ddp", 0), ("zero1", 0), ("fsdp", 0)] if dp > 1 else [("ddp", 0)]
                if per_node and dp > per_node and dp % per_node == 0:
                    modes.append(("hsdp", per_node))
                eps = [e for e in range(1, dp + 1) if dp % e == 0 and m.num_experts % e == 0] \
                    if m.num_experts else [1]  # expert parallelism splits data-parallel ranks
                for (mode, shard), ep in ((x, e) for x in modes for e in eps):
                    for schedule in (("1f1b", "gpipe") if pp > 1 else ("1f1b",)):
                        for ckpt in ("none", "full"):
                            out.append(Layout(ranks, mode, tp, cp, pp, ep, schedule=schedule, batch=batch,
                                              microbatches=microbatches, checkpointing=ckpt, dp_shard=shard))
    if cfg is None:
        return out
    runnable = []
    for lay in out:
        keys = {f[2:].split("=")[0]: f.split("=")[1] for f in lay.flags()}
        try:
            with_overrides(cfg, **{k: int(v) if v.isdigit() else v for k, v in keys.items()})
        except ValueError:  # a combination the code refuses (its one-line error says why)
            continue
        runnable.append(lay)
    return runnable


def plan(m: Model, ranks: int, batch: int, gpu_memory: float, machine: dict[str, Any],
         dtype: str = "float32", cfg: Any = None) -> list[dict[str, Any]]:
    """The layouts whose largest rank fits in ``gpu_memory`` bytes, fastest first, with the
    term that dominates each one's step."""
    rows = []
    for lay in candidate_layouts(m, ranks, batch, cfg, machine.get("gpus_per_node") or 0):
        need = max(memory(m, lay, r, dtype=dtype)["total"] for r in range(lay.pp))  # the fullest stage
        if need > gpu_memory:
            continue
        t = step_time(m, lay, machine, dtype)
        terms = {k: v for k, v in t.items() if k != "total"}
        rows.append({"layout": lay, "seconds": t["total"], "memory": need,
                     "dominant": max(terms, key=terms.get), "terms": terms})
    return sorted(rows, key=lambda r: r["seconds"])


# ------------------------------------------------------------------ check ---
CHECKED: tuple[Layout, ...] = (
    Layout(1), Layout(2), Layout(4), Layout(2, "zero1"), Layout(4, "zero1"), Layout(2, "fsdp"),
    Layout(4, "fsdp"), Layout(2, tp=2), Layout(2, cp=2), Layout(4, tp=2),
    Layout(2, pp=2, schedule="gpipe"), Layout(2, pp=2), Layout(4, pp=4, schedule="gpipe"), Layout(4, pp=4),
    Layout(2, checkpointing="full"),
)


def error(predicted: float, measured: float) -> float:
    return predicted / measured - 1 if measured else (0.0 if predicted == 0 else math.inf)


def check_layout(m: Model, lay: Layout, machine: dict[str, Any], records: list[dict[str, Any]]) -> dict:
    """Predicted against measured, every rank: FLOPs, bytes and memory per rank (the worst
    error over the ranks), step time (the median over the timed steps of the slowest rank)."""
    worst = {"flops": 0.0, "bytes": 0.0, "memory": 0.0}
    for r in records:
        pp_rank, dp_rank = r["pp_rank"], r["dp_rank"]
        mem = memory(m, lay, pp_rank, dp_rank)
        measured_mem = (r["held"]["parameters"] + r["held"]["step_gradients"] + r["held"]["optimizer_state"]
                        + r["held"].get("weight_versions", 0) + r["saved_peak_bytes"])
        sent = {k: v[0] for k, v in collectives(m, lay, pp_rank).items()}
        kinds = set(sent) | set(r["comm_bytes"])
        worst["flops"] = max(worst["flops"], abs(error(flops(m, lay, pp_rank)["total"], r["flops"])))
        worst["memory"] = max(worst["memory"], abs(error(mem["total"], measured_mem)))
        worst["bytes"] = max([worst["bytes"]] + [abs(error(sent.get(k, 0), r["comm_bytes"].get(k, 0)))
                                                 for k in kinds])
    steps = list(zip(*[[s for s in r["seconds"] if s is not None][1:] for r in records]))
    measured_time = sorted(max(s) for s in steps)[len(steps) // 2]
    predicted = step_time(m, lay, machine)
    r0 = records[0]
    return {"layout": lay.name, "ranks": lay.ranks, "flops": r0["flops"], "flops_error": worst["flops"],
            "bytes": sum(r0["comm_bytes"].values()), "bytes_error": worst["bytes"],
            "memory": memory(m, lay)["total"], "memory_error": worst["memory"],
            "predicted_s": predicted["total"], "measured_s": measured_time,
            "time_error": error(predicted["total"], measured_time), "terms": predicted}


def run_check(args: argparse.Namespace, m: Model) -> list[dict[str, Any]]:
    import shutil

    from scripts.cost_measure import calibrate, measure_layout, rank_limit

    saved = args.out / CONSTANTS_FILE
    if saved.is_file() and not args.recalibrate:
        machine = json.loads(saved.read_text())
        print(f"this machine's constants from {saved} (--recalibrate measures them again)", flush=True)
    else:
        print("calibrating this machine (matmuls, memory, Adam, collectives) ...", flush=True)
        machine = calibrate(tuple(int(r) for r in args.calibrate_ranks.split(",")), args.calibrate_calls,
                            args.calibrate_seconds)
        args.out.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(machine, indent=1))
    runs = args.out / "runs"
    shutil.rmtree(runs, ignore_errors=True)  # every check trains from scratch
    rows = []
    limit = rank_limit()
    chosen = [lay for lay in CHECKED if not args.only or lay.name in args.only.split(",")]
    left_out = [lay for lay in chosen if limit is not None and lay.ranks > limit]  # a GPU per rank
    if left_out:
        print(f"left out, more ranks than this machine's {limit} GPU(s): "
              f"{', '.join(lay.name for lay in left_out)}", flush=True)
    for lay in chosen:
        if lay in left_out:
            continue
        print(f"  {lay.name} on {lay.ranks} rank(s)", flush=True)
        flags = lay.flags() + [f"--limit_nsamples={lay.batch * 12}"]
        if args.data_dir:
            flags.append(f"--data_dir={args.data_dir}")
        records = measure_layout(lay.name, lay.ranks, flags, runs, args.config, args.yaml_config,
                                 steps=args.steps)
        rows.append(check_layout(m, lay, machine, records))
    return rows


def check_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| layout | ranks | GFLOP/rank | FLOPs error | MB sent/rank | bytes error | MiB/rank "
             "| memory error | predicted ms | measured ms | time error |", "|" + "---|" * 11]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['ranks']} | {r['flops'] / 1e9:.3f} | {r['flops_error']:.1%} "
                     f"| {r['bytes'] / 1e6:.2f} | {r['bytes_error']:.1%} | {r['memory'] / MIB:.1f} "
                     f"| {r['memory_error']:.1%} | {r['predicted_s'] * 1e3:.0f} "
                     f"| {r['measured_s'] * 1e3:.0f} | {r['time_error']:+.0%} |")
    return "\n".join(lines)


def plot_check(rows: list[dict[str, Any]], path: Path) -> None:
    """Predicted against measured step time, one point per layout, the 25% band shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5))
    top = 1.15 * max(max(r["predicted_s"], r["measured_s"]) for r in rows) * 1e3
    ax.fill_between([0, top], [0, 0.75 * top], [0, 1.25 * top], color="0.9", label="within 25%")
    ax.plot([0, top], [0, top], color="0.5", lw=1)
    for r in rows:
        ax.scatter(r["measured_s"] * 1e3, r["predicted_s"] * 1e3, s=18)
        ax.annotate(r["layout"], (r["measured_s"] * 1e3, r["predicted_s"] * 1e3), fontsize=6,
                    xytext=(3, 2), textcoords="offset points")
    ax.set(xlim=(0, top), ylim=(0, top), xlabel="measured ms per step", ylabel="predicted ms per step",
           title="cost model against runs (tiny, this machine)")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------ command line ---
# train.py's flags that say what the cost model describes: the same declarations (utils/config_groups.py)
LAYOUT_FLAGS = ("data_parallel", "dp_shard", "tensor_parallel", "context_parallel", "pipeline_parallel",
                "expert_parallel", "pipeline_schedule", "num_microbatches", "stages_per_rank",
                "activation_checkpointing", "global_batch_size", "weight_stashing")


def layout_from(cfg: Any, ranks: int) -> Layout:
    """The layout a run of ``cfg`` on ``ranks`` ranks trains with (its flags resolved as train.py
    resolves them)."""
    lay = cfg.layout
    return Layout(ranks, lay.data_parallel, lay.tensor_parallel, lay.context_parallel, lay.pipeline_parallel,
                  lay.expert_parallel, lay.pipeline_schedule, lay.num_microbatches, lay.stages_per_rank,
                  cfg.memory.activation_checkpointing, cfg.optim.global_batch_size, lay.dp_shard,
                  lay.weight_stashing, lay.sequence_parallel)


def show(m: Model, lay: Layout, machine: dict[str, Any] | None, dtype: str) -> str:
    lines = [f"{lay.name} on {lay.ranks} rank(s), global batch {lay.batch}:"]
    for pp_rank in range(lay.pp):
        who = f"  pipeline rank {pp_rank}: " if lay.pp > 1 else "  "
        f = flops(m, lay, pp_rank)
        lines.append(f"{who}{f['total'] / 1e9:.3f} GFLOP per step (" +
                     ", ".join(f"{k} {v / 1e9:.3f}" for k, v in f.items() if k != "total") + ")")
        mem = memory(m, lay, pp_rank, dtype=dtype)
        lines.append(f"{who}memory {mem['total'] / MIB:.1f} MiB: " +
                     ", ".join(f"{k} {v / MIB:.1f}" for k, v in mem.items() if k != "total"))
        for kind, (nbytes, calls) in collectives(m, lay, pp_rank).items():
            lines.append(f"{who}{kind}: {nbytes / 1e6:.3f} MB in {calls} call(s)")
    if machine:
        t = step_time(m, lay, machine, dtype)
        lines.append(f"  step {t['total'] * 1e3:.1f} ms on {machine['name']}: " +
                     ", ".join(f"{k} {v * 1e3:.1f}" for k, v in t.items() if k != "total") +
                     f"; {lay.batch / t['total']:.1f} samples/s")
    return "\n".join(lines)


def arg_parser() -> argparse.ArgumentParser:
    from training.launcher import add_config_flags
    from utils.config import DEFAULT_YAML

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--yaml_config", default=str(DEFAULT_YAML))
    p.add_argument("--config", default="tiny")
    p.add_argument("--ranks", type=int, default=1)
    add_config_flags(p, LAYOUT_FLAGS)  # as train.py declares them; left out: the config's value
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the matmuls' precision (autocast): the time, and the activations' bytes (weights, "
                   "gradients and Adam's state are fp32)")
    p.add_argument("--machine", default=None, help="constants file (default: OUT/machine.json, which "
                   "--calibrate and --check write) or "
                   f"a known system: {', '.join(GPU_SYSTEMS)}")
    p.add_argument("--calibrate", action="store_true", help="measure this machine's constants")
    p.add_argument("--check", action="store_true", help="run the checked layouts, compare (with the "
                   "constants in OUT/machine.json, calibrating first if there are none)")
    p.add_argument("--recalibrate", action="store_true", help="--check: calibrate even if OUT has constants")
    p.add_argument("--published", action="store_true", help="the original tutorials' results beside "
                   "the model's predictions for an A100 node")
    p.add_argument("--plan", action="store_true", help="the layouts that fit, fastest first")
    p.add_argument("--freezing", action="store_true", help="freezing blocks (training/freezing.py): a "
                   "step's FLOPs per number of frozen blocks, with and without the activation cache, and "
                   "the cache's size for a year of six-hourly samples and for the config's sample limit")
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--gpu_memory_gb", type=float, default=40.0)
    p.add_argument("--steps", type=int, default=10, help="--check: steps per run (3 untimed)")
    p.add_argument("--data_dir", default=None, help="--check: the runs' data (default: the config's)")
    p.add_argument("--only", default="", help="--check: these layouts only (names, comma-separated)")
    p.add_argument("--calibrate_ranks", default="1,2,4", help="--calibrate: ranks at once to measure "
                   "(on a GPU machine, those it has a GPU per rank for)")
    p.add_argument("--calibrate_calls", type=int, default=30, help="--calibrate: calls timed per collective "
                   "and size (their mean is used)")
    p.add_argument("--calibrate_seconds", type=float, default=0.25, help="--calibrate: seconds per compute "
                   "measurement")
    p.add_argument("--roofline", action="store_true", help="plot one block's layers against the "
                   "machine's roofline (OUT/roofline.png)")
    p.add_argument("--out", type=Path, default=REPO / "logs" / "cost_model")
    return p


def main(argv: list[str] | None = None) -> int:
    from training.launcher import resolve_config

    args = arg_parser().parse_args(argv)
    try:
        cfg = resolve_config(args)
        m = Model.from_config(cfg)
    except (KeyError, ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    args.global_batch_size = cfg.optim.global_batch_size
    if args.calibrate:
        return calibrate_command(args)
    if args.check:
        return check_command(args, m, cfg)
    machine = load_machine(Path(args.machine) if args.machine else None, args.out)
    if args.published:
        return published_command(args)
    if args.roofline:
        return roofline_command(args, m, machine)
    if args.freezing:
        return freezing_command(args, m, cfg)
    if args.plan:
        return plan_command(args, m, cfg, machine)
    print(show(m, layout_from(cfg, args.ranks), machine, args.dtype))
    return 0


def calibrate_command(args: argparse.Namespace) -> int:
    from scripts.cost_measure import calibrate

    machine = calibrate(tuple(int(r) for r in args.calibrate_ranks.split(",")), args.calibrate_calls,
                        args.calibrate_seconds)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / CONSTANTS_FILE).write_text(json.dumps(machine, indent=1))
    for r, c in machine["by_ranks"].items():
        print(f"{r} rank(s) at once: fp32 matmul {c['matmul_flops']['float32']['large'] / 1e9:.0f} "
              f"GFLOP/s, bf16 {c['matmul_flops']['bfloat16']['large'] / 1e9:.0f}, memory "
              f"{c['memory_bandwidth'] / 1e9:.1f} GB/s per rank" + "".join(
                  f"; {k} {lat * 1e6:.0f} us + {bw / 1e9:.2f} GB/s"
                  for k, (lat, bw) in c.get("collectives", {}).items()))
    print(f"written to {args.out / CONSTANTS_FILE}")
    return 0


def check_command(args: argparse.Namespace, m: Model, cfg: Any) -> int:
    from scripts.instruments import write_report

    rows = run_check(args, m)
    table = check_table(rows)
    write_report(args.out, "check", table, rows)
    if importlib.util.find_spec("matplotlib") is None:  # a bare GPU image: the numbers still count
        print("no check.png: matplotlib is not installed (the table is in check.md and check.json)")
    else:
        plot_check(rows, args.out / "check.png")
    print(table)
    good = sum(abs(r["time_error"]) <= 0.25 for r in rows)
    print(f"step time within 25% for {good} of {len(rows)} layouts; written to {args.out}")
    four = [r for r in rows if r["ranks"] == 4]
    if four:
        machine = json.loads((args.out / CONSTANTS_FILE).read_text())
        first = plan(m, 4, cfg.optim.global_batch_size, math.inf, machine, cfg=cfg)[0]["layout"].name
        fastest = min(four, key=lambda r: r["measured_s"])["layout"]
        print(f"plan's first choice on 4 ranks: {first}; the fastest 4-rank layout measured: {fastest}")
    return 0


def published_command(args: argparse.Namespace) -> int:
    print("| published run (samples/s) | at the A100's peaks | share of peak | predicted | published "
          "| error |\n|---|---|---|---|---|---|")
    for r in published(args.yaml_config):
        print(f"| {r['run']} | {r['peak']:.1f} | {r['share']:.0%} | {r['predicted']:.1f} "
              f"| {r['published']} | {r['predicted'] / r['published'] - 1:+.0%} |")
    return 0


def roofline_command(args: argparse.Namespace, m: Model, machine: dict[str, Any] | None) -> int:
    a100 = GPU_SYSTEMS["a100-perlmutter"]
    args.out.mkdir(parents=True, exist_ok=True)
    pairs = [(machine, "float32")] * bool(machine) + [(a100, "bfloat16")]
    plot_roofline(m, pairs, args.out / "roofline.png")
    print(f"one block of {args.config}, 16 samples: FLOPs per byte moved (fp32)")
    for name, f, by in block_layers(m, batch=16):
        print(f"  {name:26} {f / by:8.1f}")
    print(f"written to {args.out / 'roofline.png'}")
    return 0


def freezing_command(args: argparse.Namespace, m: Model, cfg: Any) -> int:
    # a training sample is a pair (t, t + dt) within one year file: a file of T steps holds T - dt
    samples = {"the demo data's training year (make data: 730 steps)": 730 - cfg.data.dt,
               "a year of six-hourly ERA5 (1460 steps)": 1460 - cfg.data.dt}
    if cfg.data.limit_nsamples:
        samples[f"{args.config}'s limit_nsamples"] = cfg.data.limit_nsamples
    print(f"{args.config}, batch {args.global_batch_size}:")
    print(freezing_table(m, args.global_batch_size, samples))
    return 0


def plan_command(args: argparse.Namespace, m: Model, cfg: Any, machine: dict[str, Any] | None) -> int:
    if machine is None:
        raise SystemExit("error: plan needs machine constants: run --calibrate first or give --machine")
    rows = plan(m, args.gpus, args.global_batch_size, args.gpu_memory_gb * 1e9, machine, args.dtype, cfg)
    if not rows:
        print(f"no layout of {args.gpus} ranks fits {args.gpu_memory_gb} GB per rank")
        return 1
    print(f"layouts of {args.config} on {args.gpus} ranks within {args.gpu_memory_gb} GB, fastest first "
          f"({machine['name']}):")
    for r in rows[:12]:
        terms = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in sorted(r["terms"].items(), key=lambda t: -t[1])
                          if v * 1e3 >= 0.5)
        print(f"  {r['layout'].name:32} {r['seconds'] * 1e3:8.1f} ms {r['memory'] / 1e9:7.3f} GB  "
              f"dominated by {r['dominant']} ({terms} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
