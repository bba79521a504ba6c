"""The configuration's groups: every key declared once, in its group, with its default, its help
text (shown by --help) and the checks that need only that group's keys.

The groups are what library code takes: the model's builder its ``ModelConfig``, the parallel
layers and layouts (distributed/) a ``ParallelConfig`` and, where they need them, the memory and
optimizer groups, never the whole configuration. utils/config.py puts the groups together
(``Config``), checks what spans several of them, and reads the named configurations of
config/ViT.yaml. Key names are the YAML keys and the flags' names; each group's ``title`` is its
section in ``--help``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

AMP_MODES = ("none", "fp16", "bf16")
DATA_LOADERS = ("pytorch", "dali")
LR_SCHEDULES = ("cosine", "constant", "onecycle")
OPTIMIZERS = ("Adam", "AdamW", "LAMB", "SGD", "OneBitAdam")  # OneBitAdam: distributed/onebit_adam.py
DATA_PARALLEL = ("ddp", "zero1", "fsdp", "hsdp")
GRAD_COMPRESSIONS = ("none", "bf16", "fp16", "powersgd")
ENGINES = ("native", "deepspeed")  # deepspeed: training/deepspeed_engine.py
ATTENTION_KERNELS = ("auto", "default", "flash", "efficient", "cudnn", "math")  # utils/attention.py
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "async_1f1b")
WEIGHT_STASHING = ("none", "stash", "vertical", "2bw")  # async_1f1b: distributed/async_pipeline.py
INTERLEAVED = ("interleaved_1f1b", "zero_bubble")  # schedules with several stages on each rank
FREEZE_SCHEDULES = ("none", "formula", "steps", "gradnorm")  # training/freezing.py
ADAM_BETAS = (0.9, 0.95)  # beta2 0.95, as the tutorial: steadier with large batches


def key(default: Any, help: str, may_change: bool = False, **flag: Any) -> Any:
    """A config key: its default and its help text; ``may_change``: a resumed run may set it anew
    (how data is loaded, profiled, checkpointed, recomputed or laid out; num_iters to extend a
    run), the other keys change the mathematics and are refused (training/run_dir.py). ``flag``
    may add ``aliases`` (other flag names) or ``choices``."""
    return dataclasses.field(default=default, metadata={"help": help, "may_change": may_change, **flag})


class Group:
    """A group of keys: on construction every key's type is checked, then the group's values."""

    title: ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not _type_ok(value, hints[f.name]):
                raise ValueError(f"config key '{f.name}' must be {_type_name(hints[f.name])}, got {value!r}; "
                                 f"fix it in the YAML file or on the command line")
            if isinstance(value, float) and not math.isfinite(value):  # inf and nan pass every < or >
                raise ValueError(f"config key '{f.name}' must be a finite number, got {value}")
            if "choices" in f.metadata and value not in f.metadata["choices"]:
                raise ValueError(f"config key '{f.name}' is {value!r}; choose one of "
                                 f"{', '.join(f.metadata['choices'])}")
        self.check()

    def check(self) -> None:
        """The checks that need only this group's keys (one-line ValueErrors)."""

    def at_least(self, minimum: int, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if value is not None and value < minimum:
                what = "at least 1" if minimum == 1 else f"{minimum} or more"
                if minimum == 1 and type(None) in typing.get_args(_hints(type(self))[name]):
                    what = f"None or {what}"
                raise ValueError(f"config key '{name}' must be {what}, got {value}")


@functools.cache
def _hints(group: type) -> dict[str, Any]:  # resolving the annotations takes milliseconds: once
    return typing.get_type_hints(group)


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:  # tuple[int, ...]: any length
            return isinstance(value, tuple) and all(_type_ok(v, args[0]) for v in value)
        return (isinstance(value, tuple) and len(value) == len(args)
                and all(_type_ok(v, a) for v, a in zip(value, args)))
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _type_name(hint: Any) -> str:
    return str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")


@dataclass(frozen=True)
class ModelConfig(Group):
    """The serial model (networks/backbone.py: the ViT, networks/vit.py and networks/moe.py, or AFNO)."""

    title: ClassVar[str] = "model"
    backbone: str = key("vit", "the model: vit (networks/vit.py) or afno (FourCastNet's, networks/afno.py)")
    img_size: tuple[int, int] = key((360, 720), "grid height and width (the data is cropped to it)")
    patch_size: int = key(8, "side of the square patches that become tokens")
    embed_dim: int = key(384, "token width")
    depth: int = key(12, "transformer blocks")
    num_heads: int = key(8, "attention heads per block")
    mlp_ratio: float = key(4.0, "MLP hidden width / embed_dim")
    dropout: float = key(0.0, "dropout probability")
    num_experts: int = key(0, "mixture of experts: expert MLPs in each MoE block (0: every block keeps "
                              "its dense MLP)")
    moe_top_k: int = key(1, "experts each token is sent to (1: Switch, 2: GShard)")
    moe_every: int = key(2, "every moe_every-th block has a mixture of experts")
    moe_capacity_factor: float = key(0.0, "tokens an expert takes from a sample, as a multiple of an "
                                          "even share (0: no limit, nothing dropped)")
    moe_aux_weight: float = key(0.01, "weight of the load-balancing loss added to the training loss")
    n_in_channels: int = key(20, "input variables (ERA5 channels)")
    n_out_channels: int = key(20, "predicted variables (the first n of the input)")

    def check(self) -> None:
        self.at_least(1, "patch_size", "embed_dim", "depth", "num_heads", "n_in_channels", "n_out_channels")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"config key 'dropout' must be in [0, 1), got {self.dropout}")
        h, w = self.img_size
        if h % self.patch_size or w % self.patch_size:
            raise ValueError(f"img_size {h} x {w} is not divisible by patch_size {self.patch_size}; "
                             f"choose a patch size that divides both")
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}; "
                             f"change one of them")
        if self.n_out_channels > self.n_in_channels:
            raise ValueError(f"n_out_channels {self.n_out_channels} exceeds n_in_channels "
                             f"{self.n_in_channels}")
        if self.num_experts < 0 or self.moe_every < 1 or self.moe_capacity_factor < 0 \
                or self.moe_aux_weight < 0:
            raise ValueError(f"config keys num_experts (0 or more), moe_every (1 or more), "
                             f"moe_capacity_factor and moe_aux_weight (0 or more) are {self.num_experts}, "
                             f"{self.moe_every}, "
                             f"{self.moe_capacity_factor} and {self.moe_aux_weight}")
        if self.num_experts and not 1 <= self.moe_top_k <= min(2, self.num_experts):
            raise ValueError(f"moe_top_k must be 1 or 2 and at most num_experts ({self.num_experts}), got "
                             f"{self.moe_top_k}")
        if self.num_experts > 0 and self.moe_every > self.depth:
            raise ValueError(f"--num_experts {self.num_experts} goes into every moe_every-th block "
                             f"({self.moe_every}); this run would ignore it: use it with --moe_every "
                             f"{self.depth} or less (the model has {self.depth} blocks), or leave it out")

    @property
    def tokens(self) -> int:
        return (self.img_size[0] // self.patch_size) * (self.img_size[1] // self.patch_size)


@dataclass(frozen=True)
class DataConfig(Group):
    """Where the data is and how it is loaded (utils/data_loader.py, utils/data_loader_dali.py)."""

    title: ClassVar[str] = "data"
    data_dir: str = key("/data", "ERA5 folder with train/, valid/, stats/", may_change=True)
    dt: int = key(1, "predict fields[t + dt]; dt in 6-hour steps")
    limit_nsamples: int | None = key(None, "use only the first N training samples")
    limit_nsamples_val: int | None = key(None, "use only the first N validation samples")
    num_data_workers: int = key(0, "DataLoader workers (0 = load in the main process)", may_change=True)
    data_loader_config: str = key("pytorch", "data loader", choices=DATA_LOADERS, may_change=True)
    dali_start_method: str = key("auto", "how DALI starts its worker processes: auto (spawn on a GPU, "
                                 "where forking after CUDA starts is unsafe; fork on a CPU), fork or "
                                 "spawn", choices=("auto", "fork", "spawn"), may_change=True)

    def check(self) -> None:
        self.at_least(1, "dt", "limit_nsamples", "limit_nsamples_val")
        self.at_least(0, "num_data_workers")


@dataclass(frozen=True)
class OptimizerConfig(Group):
    """The optimization: steps, batch, learning rate and its schedule, the optimizer, precision and
    the single-device speed-ups (part 2)."""

    title: ClassVar[str] = "optimisation"
    num_iters: int = key(30000, "optimizer steps to train", may_change=True)
    global_batch_size: int = key(16, "samples per optimizer step over all data-parallel ranks")
    local_batch_size: int | None = key(None, "per-rank batch (default: global_batch_size / "
                                             "data-parallel ranks)")
    lr: float = key(5e-4, "peak learning rate")
    lr_schedule: str = key("cosine", "learning-rate schedule after warm-up (onecycle: its own warm-up, "
                                     "from lr / onecycle_div_factor up to lr, then down)",
                           choices=LR_SCHEDULES)
    warmup: int = key(0, "steps of linear learning-rate warm-up")
    onecycle_pct_start: float = key(0.3, "onecycle: fraction of the steps spent rising to lr")
    onecycle_div_factor: float = key(25.0, "onecycle: the first learning rate is lr / this")
    onecycle_final_div_factor: float = key(1e4, "onecycle: the last learning rate is the first / this")
    optimizer_type: str = key("Adam", "optimizer: Adam, AdamW (decoupled weight decay), LAMB (a trust ratio "
                                      "per tensor), SGD (with momentum) or OneBitAdam (1-bit momenta)",
                              choices=OPTIMIZERS, aliases=("--optimizer",))
    adam_betas: tuple[float, float] = key(ADAM_BETAS, "Adam's beta1 and beta2 (AdamW and LAMB too)")
    onebit_warmup_steps: int = key(100, "OneBitAdam: steps of plain Adam before the momentum is compressed")
    weight_decay: float = key(0.0, "AdamW and LAMB: decoupled weight decay; SGD: L2 penalty")
    momentum: float = key(0.9, "SGD: momentum")
    grad_clip_norm: float = key(0.0, "clip the global norm of the whole model's gradient to this "
                                     "(0 = off); the norm before clipping is logged every step")
    amp_mode: str = key("none", "mixed precision", choices=AMP_MODES)
    attention_kernel: str = key("auto", "scaled-dot-product-attention kernel: auto (torch's pick, but "
                                "math on a CPU in fp16, and in bf16 below 160 tokens), default "
                                "(torch's pick), flash, efficient, cudnn or math",
                                choices=ATTENTION_KERNELS, may_change=True)
    enable_fused: bool = key(False, "fused Adam (--no-enable_fused to switch off)", may_change=True)
    enable_jit: bool = key(False, "torch.compile the model and loss (--no-enable_jit to switch off)",
                           may_change=True)

    def check(self) -> None:
        self.at_least(1, "num_iters", "global_batch_size", "local_batch_size", "onebit_warmup_steps")
        self.at_least(0, "warmup", "grad_clip_norm")
        if self.lr <= 0:
            raise ValueError(f"config key 'lr' must be positive, got {self.lr}")
        if not all(0.0 <= b < 1.0 for b in self.adam_betas):
            raise ValueError(f"config key 'adam_betas' must be two numbers in [0, 1), got {self.adam_betas}")
        if self.weight_decay < 0 or not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"config keys 'weight_decay' (0 or more) and 'momentum' (in [0, 1)) are "
                             f"{self.weight_decay} and {self.momentum}")
        if self.lr_schedule != "onecycle":
            return
        if not 0.0 < self.onecycle_pct_start < 1.0 or self.onecycle_div_factor <= 0 \
                or self.onecycle_final_div_factor <= 0:
            raise ValueError(f"onecycle needs 0 < onecycle_pct_start < 1 and positive div factors, got "
                             f"{self.onecycle_pct_start}, {self.onecycle_div_factor} and "
                             f"{self.onecycle_final_div_factor}")
        if self.warmup:
            raise ValueError(f"--lr_schedule onecycle warms up by itself (over onecycle_pct_start of the "
                             f"steps); pass --warmup 0 (the config sets {self.warmup})")


@dataclass(frozen=True)
class ParallelConfig(Group):
    """The parallel layout: model-parallel sizes (the data-parallel size is what the ranks leave),
    the pipeline, how the data-parallel ranks hold and synchronise the training state, and the
    process group (distributed/)."""

    title: ClassVar[str] = "parallel layout"
    tensor_parallel: int = key(1, "ranks that split each layer (heads, MLP features); "
                                  "--row_parallel_size is the SC23 name",
                               aliases=("--row_parallel_size",), may_change=True)
    context_parallel: int = key(1, "ranks that split the sequence of tokens", may_change=True)
    expert_parallel: int = key(1, "data-parallel ranks that split the experts of each mixture of "
                                  "experts (tokens reach their experts by all-to-all)", may_change=True)
    sequence_parallel: bool = key(False, "with tensor_parallel: the activations between the tensor-"
                                         "parallel layers (norms, residuals, dropout) split along the "
                                         "tokens over the tp ranks; all-gather and reduce-scatter "
                                         "replace the all-reduce", may_change=True)
    tp_impl: str = key("course", "tensor parallelism by the course's layers (distributed/layers.py) or "
                                 "by torch's parallelize_module", choices=("course", "torch"),
                       may_change=True)
    pipeline_parallel: int = key(1, "pipeline stages: each rank holds a contiguous part of the "
                                    "transformer blocks and passes activations on", may_change=True)
    pipeline_schedule: str = key("1f1b", "order of the micro-batches' forward and backward passes on "
                                 "each stage (async_1f1b: 1F1B with no flush between steps, each stage "
                                 "updating its weights as soon as it can; see weight_stashing)",
                                 choices=PIPELINE_SCHEDULES, may_change=True)
    weight_stashing: str = key("stash", "async_1f1b: the weights a micro-batch's backward uses: none (the "
                               "stage's newest: the wrong gradient), stash (the version its forward used, "
                               "PipeDream), vertical (the version the first stage used, on every stage), "
                               "2bw (PipeDream-2BW: the version before the newest, two kept)",
                               choices=WEIGHT_STASHING)
    async_drain_every: int = key(100, "async_1f1b: steps between the pipeline's drains (every micro-batch "
                                 "in flight through its update), a part of its update rule: checkpoints "
                                 "and a stop signal's stop happen only there")
    num_microbatches: int = key(4, "pipeline micro-batches the local batch is split into", may_change=True)
    stages_per_rank: int = key(2, "interleaved_1f1b and zero_bubble: pipeline stages (model chunks) "
                                  "on each rank", may_change=True)
    parallel_order: str = key("tp-cp-dp", "rank layout, fastest-varying dimension first (pp, when "
                                          "not named, varies slowest)", may_change=True)
    data_parallel: str = key("ddp", "how the data-parallel ranks hold the training state: ddp "
                             "(replicated), zero1 (optimizer state sharded), fsdp (parameters, "
                             "gradients and optimizer state sharded), hsdp (fsdp within groups of "
                             "dp_shard ranks, replicated across the groups)",
                             choices=DATA_PARALLEL, may_change=True)
    dp_shard: int = key(0, "hsdp: ranks in each sharding group; the data-parallel ranks form "
                           "dp / dp_shard groups that each hold one sharded copy and average "
                           "gradients between them (0: the ranks of one node)", may_change=True)
    engine: str = key("native", "who runs the step: native (this project's loop and layouts) or "
                                "deepspeed (DeepSpeed's engine: wrapping, backward, step, accumulation, "
                                "clipping; install with `make deepspeed`)",
                      choices=ENGINES, may_change=True)
    zero_stage: int = key(0, "--engine deepspeed: what its ZeRO partitions over the data-parallel "
                             "ranks: 0 nothing (DDP), 1 optimizer state, 2 and gradients, 3 and "
                             "parameters", may_change=True)
    reshard_after_forward: bool = key(True, "fsdp: free the gathered parameters after forward and "
                                            "gather them again in backward (ZeRO-3; "
                                            "--no-reshard_after_forward keeps them: ZeRO-2)", may_change=True)
    bucket_cap_mb: float = key(25.0, "DDP gradient bucket size in MB", may_change=True)
    grad_compression: str = key("none", "DDP: send the gradients compressed (a communication hook, "
                                "distributed/compression.py): none, bf16 or fp16 (half the bytes), "
                                "powersgd (a low-rank approximation)",
                                choices=GRAD_COMPRESSIONS)
    powersgd_rank: int = key(4, "powersgd: rank of each gradient matrix's approximation")
    powersgd_error_feedback: bool = key(True, "powersgd: add each step's compression error to the "
                                              "next step's gradient")
    dist_backend: str = key("auto", "process-group backend: auto (NCCL on GPUs, gloo on CPUs), nccl, or "
                                    "gloo, on GPUs too (tensors go through host memory; ranks may then "
                                    "share a GPU, as make gpu-check does on a machine with one)",
                            choices=("auto", "nccl", "gloo"), may_change=True)
    rendezvous_timeout_s: float = key(60.0, "seconds to wait for every rank to start and meet "
                                            "(srun or plain environment; torchrun meets on its own)",
                                      may_change=True)
    collective_timeout_s: float = key(300.0, "seconds a collective may wait for a rank that stopped "
                                             "responding before every rank fails (on NCCL the heartbeat "
                                             "names it then, NCCL's own timeout is 30 s later)",
                                      may_change=True)
    disable_broadcast_buffers: bool = key(False, "do not broadcast module buffers from rank 0 "
                                                 "every forward", may_change=True)
    noddp: bool = key(False, "no gradient synchronisation: each rank trains alone (profiling "
                             "compute only)")

    def check(self) -> None:
        names = self.parallel_order.split("-")
        if not all(n.isalpha() for n in names) or len(set(names)) != len(names):
            raise ValueError(f"config key 'parallel_order' is {self.parallel_order!r}; name each parallel "
                             f"dimension once, separated by '-', fastest-varying first, e.g. 'tp-cp-dp'")
        self.at_least(1, "tensor_parallel", "context_parallel", "pipeline_parallel", "num_microbatches",
                      "stages_per_rank", "rendezvous_timeout_s", "collective_timeout_s", "expert_parallel",
                      "powersgd_rank", "async_drain_every")
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"config key 'bucket_cap_mb' must be positive, got {self.bucket_cap_mb}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"config key 'zero_stage' must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.dp_shard < 0:
            raise ValueError(f"config key 'dp_shard' must be 0 (the ranks of one node) or more, got "
                             f"{self.dp_shard}")
        self.check_data_parallel()
        self.check_unused()
        self.check_pipeline()
        self.check_sequence_parallel()

    # data_parallel's modes (each takes effect with more than one data-parallel rank)
    @property
    def sharded(self) -> bool:
        """FSDP or HSDP: parameters, gradients and optimizer state sharded."""
        return self.engine == "native" and self.data_parallel in ("fsdp", "hsdp")

    @property
    def replicated(self) -> bool:
        """DDP: every data-parallel rank holds the whole training state."""
        return self.data_parallel == "ddp"

    @property
    def zero1(self) -> bool:
        """ZeRO-1: the optimizer state sharded."""
        return self.data_parallel == "zero1"

    @property
    def hsdp(self) -> bool:
        """FSDP within groups of dp_shard ranks, replicated across them."""
        return self.data_parallel == "hsdp"

    @property
    def stages(self) -> int:
        """Stages of the whole pipeline: one per rank, or ``stages_per_rank`` with interleaving."""
        per_rank = self.stages_per_rank if self.pipeline_schedule in INTERLEAVED else 1
        return self.pipeline_parallel * per_rank

    def check_data_parallel(self) -> None:
        if self.engine == "native":
            if self.zero_stage:
                raise ValueError("--zero_stage is DeepSpeed's: add --engine deepspeed (this project's own "
                                 "sharding is --data_parallel zero1 or fsdp)")
        else:
            refused = [
                (not self.replicated, f"--data_parallel {self.data_parallel} (DeepSpeed shards "
                                              f"with --zero_stage; leave --data_parallel ddp)"),
                (self.grad_compression != "none", f"--grad_compression {self.grad_compression} (a DDP "
                                                  f"hook; DeepSpeed reduces gradients itself)"),
                (self.noddp, "--noddp"),
            ]
            for bad, what in refused:
                if bad:
                    raise ValueError(f"--engine deepspeed does not run {what}")
            return
        if self.hsdp and (self.tensor_parallel > 1 or self.context_parallel > 1
                                             or self.pipeline_parallel > 1):
            raise ValueError("data_parallel hsdp combines with no other parallel dimension here; use "
                             "--data_parallel fsdp with tensor or pipeline parallelism")
        self.check_compression()
        if self.replicated:
            return
        if self.noddp:
            raise ValueError(f"--noddp switches gradient synchronisation off, which data_parallel "
                             f"{self.data_parallel} needs; use --data_parallel ddp with --noddp")
        if self.sharded and self.context_parallel > 1:
            # cp needs a gradient sum over cp, which FSDP's reduction lacks
            raise ValueError("data_parallel fsdp does not combine with context_parallel > 1 here; use "
                             "--data_parallel ddp or zero1 with context parallelism")

    def check_compression(self) -> None:
        """Compression is a DDP communication hook: layouts whose gradients DDP does not reduce alone
        (FSDP's reduce-scatter, tensor/context parallel sums, pipelines) are refused."""
        if self.grad_compression == "none":
            return
        split = ("tensor_parallel", "context_parallel", "pipeline_parallel")
        other = [f"--{name} {getattr(self, name)}" for name in split if getattr(self, name) > 1]
        if self.data_parallel not in ("ddp", "zero1"):
            other.insert(0, f"--data_parallel {self.data_parallel}")
        if self.noddp:
            other.insert(0, "--noddp")
        if other:
            raise ValueError(f"--grad_compression {self.grad_compression} compresses DDP's gradient "
                             f"all-reduce; it does not combine with {', '.join(other)}: use it with "
                             f"--data_parallel ddp or zero1 alone")

    def check_unused(self) -> None:
        """A key that only one layout reads, set for another, would be ignored: refused instead."""
        unused = [
            (self.dp_shard > 0 and not (self.hsdp and self.sharded),
             f"--dp_shard {self.dp_shard} sizes hsdp's sharding groups", "--data_parallel hsdp"),
            (not self.reshard_after_forward and not self.sharded,
             "--no-reshard_after_forward keeps FSDP's gathered weights", "--data_parallel fsdp or hsdp"),
            (self.pipeline_schedule != "1f1b" and self.pipeline_parallel < 2,
             f"--pipeline_schedule {self.pipeline_schedule} orders a pipeline's micro-batches",
             "--pipeline_parallel 2 or more"),
            (self.weight_stashing != "stash" and self.pipeline_schedule != "async_1f1b",
             f"--weight_stashing {self.weight_stashing} picks the weights of the asynchronous pipeline's "
             f"backward", "--pipeline_schedule async_1f1b"),
            (self.async_drain_every != 100 and self.pipeline_schedule != "async_1f1b",
             f"--async_drain_every {self.async_drain_every} spaces the asynchronous pipeline's drains",
             "--pipeline_schedule async_1f1b"),
        ]
        for bad, what, use in unused:
            if bad:
                raise ValueError(f"{what}; this run would ignore it: use it with {use}, or leave it out")

    def check_pipeline(self) -> None:
        pp, m = self.pipeline_parallel, self.num_microbatches
        if pp < 2:
            return
        if self.context_parallel > 1:
            raise ValueError("pipeline_parallel does not combine with context_parallel > 1 here; use "
                             "tensor and data parallelism with pipeline stages")
        if self.pipeline_schedule == "1f1b" and m < pp:
            raise ValueError(f"the 1f1b schedule needs at least as many micro-batches as stages "
                             f"(num_microbatches {m} < pipeline_parallel {pp}); use --num_microbatches "
                             f"{pp} or more")
        rounds = max(1, m // pp)  # interleaving runs the micro-batches in rounds of pp
        if self.pipeline_schedule in INTERLEAVED and m % rounds:
            raise ValueError(f"{self.pipeline_schedule} runs micro-batches in rounds of pipeline_parallel "
                             f"{pp}: num_microbatches {m} must be a multiple of {pp} (or at most {pp})")
        if self.pipeline_schedule == "zero_bubble" and self.sharded:
            # seen on torch 2.13
            raise ValueError("the zero_bubble schedule with data_parallel fsdp trains with gradients that "
                             "differ from the serial model's; use --data_parallel ddp or another schedule")

    def check_sequence_parallel(self) -> None:
        """Sequence parallelism leaves every replicated parameter with a partial gradient (its tp
        rank's tokens only), summed over tp by the parameter tags: DDP's comm hook or the tag hooks
        do it, FSDP's reduction and the pipeline's gradient average do not."""
        if not self.sequence_parallel:
            return
        if self.tensor_parallel < 2:
            raise ValueError("--sequence_parallel splits what tensor parallelism replicates; use it with "
                             "--tensor_parallel 2 or more")
        if self.sharded or self.pipeline_parallel > 1:
            other = "--pipeline_parallel" if self.pipeline_parallel > 1 \
                else f"--data_parallel {self.data_parallel}"
            raise ValueError(f"--sequence_parallel does not combine with {other} here (the replicated "
                             f"layers' gradients need a sum over tp that it does not do); use it with "
                             f"--data_parallel ddp or zero1")


@dataclass(frozen=True)
class MemoryConfig(Group):
    """What trades compute or host memory for device memory (part 6)."""

    title: ClassVar[str] = "memory"
    activation_checkpointing: str = key("none", "recompute activations in backward instead of storing "
                                        "them: none, full (every block), selective (every other one)",
                                        choices=("none", "full", "selective"), may_change=True)
    grad_accum_steps: int = key(1, "micro-batches per optimizer step: the local batch is split into N, "
                                   "gradients add up, one gradient reduction per step", may_change=True)
    cpu_offload: bool = key(False, "fsdp / hsdp: keep the parameters, gradients and Adam's state in "
                                   "host memory (FSDP2's CPUOffloadPolicy); the optimizer steps on "
                                   "the CPU. --engine deepspeed: ZeRO-Offload (Adam's state and step "
                                   "on the CPU; the parameters too at --zero_stage 3)", may_change=True)

    def check(self) -> None:
        self.at_least(1, "grad_accum_steps")


@dataclass(frozen=True)
class FreezingConfig(Group):
    """Freezing the embedding and the first blocks as training goes (training/freezing.py;
    PipeTransformer): the schedule, the activation cache and the pipeline's re-cut."""

    title: ClassVar[str] = "freezing"
    freeze_schedule: str = key("none", "freeze the embedding and the first blocks as training goes: none, "
                               "formula (after e epochs ceil(depth (1 - (1 - freeze_alpha)^e)) blocks), "
                               "steps (--freeze_steps) or gradnorm (per block, the change of its "
                               "gradients' L1 norm between intervals)", choices=FREEZE_SCHEDULES)
    freeze_alpha: float = key(1 / 3, "formula: the share of the still active blocks frozen after each "
                                     "epoch (1/3 conservative, 1/2 PipeTransformer's CIFAR-100 runs)")
    freeze_every: int = key(0, "formula: steps per epoch of the formula; gradnorm: steps per interval "
                               "(0: the data's epoch)")
    freeze_steps: tuple[int, ...] = key((), "steps: the step (0-based) at which each further block "
                                            "freezes: the i-th entry freezes block i (the first also "
                                            "the embedding)")
    freeze_order: str = key("first", "which blocks freeze: first (the earliest, in order) or random "
                                     "(a control: as many blocks drawn from the seed)",
                            choices=("first", "random"))
    freeze_cache_mib: float = key(0.0, "memory for the frozen blocks' output per sample, kept for the "
                                       "next epochs (0: no cache; samples beyond it are recomputed)",
                                  may_change=True)
    freeze_repipeline: bool = key(True, "with pipeline stages: re-cut them as blocks freeze, and once "
                                        "the active blocks fit on half the stages, continue on half "
                                        "the stages with twice the data-parallel ranks", may_change=True)

    def check(self) -> None:
        steps = self.freeze_steps
        if not 0.0 < self.freeze_alpha <= 1.0 or self.freeze_every < 0 or self.freeze_cache_mib < 0:
            raise ValueError(f"config keys freeze_alpha (in (0, 1]), freeze_every and freeze_cache_mib (0 "
                             f"or more) are {self.freeze_alpha}, {self.freeze_every} and "
                             f"{self.freeze_cache_mib}")
        if (self.freeze_schedule == "steps") != bool(steps):
            raise ValueError("--freeze_steps (the step at which each further block freezes) goes with "
                             "--freeze_schedule steps, and that schedule needs it: give both or neither")
        if any(s < 0 for s in steps) or list(steps) != sorted(steps):
            raise ValueError(f"--freeze_steps {' '.join(map(str, steps))}: give steps 0 or more, in "
                             f"increasing order (the i-th freezes the i-th block)")
        if self.freeze_schedule == "gradnorm" and self.freeze_order == "random":
            raise ValueError("--freeze_schedule gradnorm does not combine with --freeze_order random here "
                             "(the gradient test freezes the blocks before a moving one)")


@dataclass(frozen=True)
class RunConfig(Group):
    """Where a run writes, its seed, checkpoints and stop signals."""

    title: ClassVar[str] = "run"
    expdir: str = key("/logs", "root of the run directories", may_change=True)
    seed: int = key(0, "random seed (weights, data order, dropout)")
    checkpoint_every: int = key(0, "steps between checkpoints (0 = only at the end)", may_change=True)
    stop_check_every: int = key(10, "steps between the ranks' checks for a stop signal (TERM, USR1, "
                                    "USR2); on one, training checkpoints and exits with status 75",
                                may_change=True)

    def check(self) -> None:
        self.at_least(1, "stop_check_every")
        self.at_least(0, "checkpoint_every", "seed")


@dataclass(frozen=True)
class ProfilingConfig(Group):
    """The profiling window (utils/profiling.py): steps profile_start_step.. of epoch profile_epoch."""

    title: ClassVar[str] = "profiling"
    profile_epoch: int | None = key(None, "epoch (0-based) whose steps rank 0 brackets with "
                                          "cudaProfilerStart/Stop", may_change=True)
    profile_start_step: int = key(0, "first profiled step of that epoch (0-based)", may_change=True)
    profile_num_steps: int | None = key(None, "steps in the window (default: to epoch end)", may_change=True)
    memory_snapshot: bool = key(False, "record one step's memory by kind (parameters, gradients, "
                                       "optimizer state, activations) into RUN_DIR/memory "
                                       "(scripts/plot_memory.py draws it); on CUDA also the "
                                       "allocator's history for pytorch.org/memory_viz", may_change=True)
    profile: bool = key(False, "write a torch.profiler trace of the window to RUN_DIR/profile "
                               "(CPU or GPU)", may_change=True)

    def check(self) -> None:
        self.at_least(0, "profile_epoch", "profile_start_step")
        self.at_least(1, "profile_num_steps")
        if self.profile and self.profile_epoch is None:
            raise ValueError("--profile needs a profiling window: add --profile_epoch E "
                             "(and optionally --profile_start_step, --profile_num_steps)")


# attribute of Config -> its group
GROUPS: dict[str, type[Group]] = {"model": ModelConfig, "data": DataConfig, "optim": OptimizerConfig,
                                  "layout": ParallelConfig, "memory": MemoryConfig, "run": RunConfig,
                                  "profiling": ProfilingConfig, "freeze": FreezingConfig}
# every key -> the attribute of its group
KEY_GROUP: dict[str, str] = {f.name: attr for attr, group in GROUPS.items()
                              for f in dataclasses.fields(group)}
