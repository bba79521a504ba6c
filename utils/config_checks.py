"""Validation of a Config: every key's type, then the values and their combinations.

Called by ``Config.__post_init__``, so no Config exists that has not passed these checks.
Each error is one line that names the key and says what to do.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from utils.config import Config


def check_config(cfg: Config) -> None:
    hints = typing.get_type_hints(Config)
    for name, hint in hints.items():
        value = getattr(cfg, name)
        if not _type_ok(value, hint):
            raise ValueError(
                f"config key '{name}' must be {_type_name(hint)}, got {value!r}; "
                f"fix it in the YAML file or on the command line"
            )
    _check_values(cfg)


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
        return (
            isinstance(value, tuple)
            and len(value) == len(args)
            and all(_type_ok(v, a) for v, a in zip(value, args))
        )
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _type_name(hint: Any) -> str:
    return str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"config key '{name}' is {value!r}; choose one of {', '.join(choices)}")


def _check_values(cfg: Config) -> None:
    for f in dataclasses.fields(cfg):
        if "choices" in f.metadata:
            _check_choice(f.name, getattr(cfg, f.name), f.metadata["choices"])
    names = cfg.parallel_order.split("-")
    if not all(n.isalpha() for n in names) or len(set(names)) != len(names):
        raise ValueError(f"config key 'parallel_order' is {cfg.parallel_order!r}; name each parallel "
                         f"dimension once, separated by '-', fastest-varying first, e.g. 'tp-cp-dp'")
    if cfg.amp_mode == "fp16" and cfg.tensor_parallel > 1:  # each rank's GradScaler decides alone
        raise ValueError("amp_mode fp16 does not work with tensor_parallel > 1 (the ranks' loss "
                         "scalers would skip different steps); use --amp_mode bf16")
    _check_data_parallel(cfg)
    _check_pipeline(cfg)
    _check_sequence_parallel(cfg)
    _check_experts(cfg)
    _check_freezing(cfg)
    if cfg.bucket_cap_mb <= 0:
        raise ValueError(f"config key 'bucket_cap_mb' must be positive, got {cfg.bucket_cap_mb}")
    _check_schedule(cfg)
    if not all(0.0 <= b < 1.0 for b in cfg.adam_betas):
        raise ValueError(f"config key 'adam_betas' must be two numbers in [0, 1), got {cfg.adam_betas}")
    positive = ("patch_size", "embed_dim", "depth", "num_heads", "n_in_channels",
                "n_out_channels", "dt", "num_iters", "global_batch_size",
                "tensor_parallel", "context_parallel", "stop_check_every", "grad_accum_steps",
                "pipeline_parallel", "num_microbatches", "stages_per_rank",
                "rendezvous_timeout_s", "collective_timeout_s")
    for name in positive:
        if getattr(cfg, name) < 1:
            raise ValueError(f"config key '{name}' must be at least 1, got {getattr(cfg, name)}")
    for name in ("warmup", "num_data_workers", "checkpoint_every", "seed", "grad_clip_norm"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"config key '{name}' must be 0 or more, got {getattr(cfg, name)}")
    for name in ("limit_nsamples", "limit_nsamples_val", "local_batch_size"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ValueError(f"config key '{name}' must be None or at least 1, got {value}")
    _check_profiling(cfg)
    if not 0.0 <= cfg.dropout < 1.0:
        raise ValueError(f"config key 'dropout' must be in [0, 1), got {cfg.dropout}")
    if cfg.lr <= 0:
        raise ValueError(f"config key 'lr' must be positive, got {cfg.lr}")
    h, w = cfg.img_size
    if h % cfg.patch_size or w % cfg.patch_size:
        raise ValueError(
            f"img_size {h} x {w} is not divisible by patch_size {cfg.patch_size}; "
            f"choose a patch size that divides both"
        )
    if cfg.embed_dim % cfg.num_heads:
        raise ValueError(
            f"embed_dim {cfg.embed_dim} is not divisible by num_heads {cfg.num_heads}; "
            f"change one of them"
        )
    if cfg.n_out_channels > cfg.n_in_channels:
        raise ValueError(
            f"n_out_channels {cfg.n_out_channels} exceeds n_in_channels {cfg.n_in_channels}"
        )


def _check_deepspeed(cfg: Config) -> None:
    """What DeepSpeed's engine runs here (training/deepspeed_engine.py): its ZeRO stages over plain
    data parallelism, with torch's Adam or AdamW (or SGD), in fp32 or bf16."""
    if cfg.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"config key 'zero_stage' must be 0, 1, 2 or 3, got {cfg.zero_stage}")
    if cfg.engine == "native":
        if cfg.zero_stage:
            raise ValueError("--zero_stage is DeepSpeed's: add --engine deepspeed (this project's own "
                             "sharding is --data_parallel zero1 or fsdp)")
        return
    refused = [
        (cfg.data_parallel != "ddp", f"--data_parallel {cfg.data_parallel} (DeepSpeed shards with "
                                     f"--zero_stage; leave --data_parallel ddp)"),
        (cfg.optimizer_type == "LAMB", "--optimizer LAMB (DeepSpeed's LAMB has no CPU build; use Adam "
                                       "or AdamW)"),
        (cfg.amp_mode == "fp16", "--amp_mode fp16 (use bf16, which needs no loss scaling)"),
        (cfg.cpu_offload and cfg.zero_stage == 0, "--cpu_offload at --zero_stage 0 (ZeRO-Offload "
                                                  "needs stage 1, 2 or 3)"),
        (cfg.grad_compression != "none", f"--grad_compression {cfg.grad_compression} (a DDP hook; "
                                         f"DeepSpeed reduces gradients itself)"),
        (cfg.noddp, "--noddp"),
    ]
    for bad, what in refused:
        if bad:
            raise ValueError(f"--engine deepspeed does not run {what}")


def _check_data_parallel(cfg: Config) -> None:
    _check_deepspeed(cfg)
    if cfg.engine == "deepspeed":  # its own sharding and offload, checked above
        return
    if cfg.cpu_offload and cfg.data_parallel not in ("fsdp", "hsdp"):
        raise ValueError(f"--cpu_offload moves FSDP's shards to host memory; use it with "
                         f"--data_parallel fsdp or hsdp, not {cfg.data_parallel}")
    if cfg.dp_shard < 0:
        raise ValueError(f"config key 'dp_shard' must be 0 (the ranks of one node) or more, got "
                         f"{cfg.dp_shard}")
    if cfg.data_parallel == "hsdp" and (cfg.tensor_parallel > 1 or cfg.context_parallel > 1
                                        or cfg.pipeline_parallel > 1):
        raise ValueError("data_parallel hsdp combines with no other parallel dimension here; use "
                         "--data_parallel fsdp with tensor or pipeline parallelism")
    _check_compression(cfg)
    if cfg.data_parallel == "ddp":
        return
    if cfg.noddp:
        raise ValueError(f"--noddp switches gradient synchronisation off, which data_parallel "
                         f"{cfg.data_parallel} needs; use --data_parallel ddp with --noddp")
    if cfg.data_parallel not in ("fsdp", "hsdp"):
        return
    if cfg.amp_mode == "fp16":  # FSDP2 keeps no per-rank inf check in sync; bf16 needs no scaler
        raise ValueError(f"amp_mode fp16 is not supported with data_parallel {cfg.data_parallel} (its "
                         f"loss scaler would need the sharded gradients' inf checks combined); use "
                         f"--amp_mode bf16")
    if cfg.context_parallel > 1:  # cp needs a gradient sum over cp, which FSDP's reduction lacks
        raise ValueError("data_parallel fsdp does not combine with context_parallel > 1 here; use "
                         "--data_parallel ddp or zero1 with context parallelism")


def _check_schedule(cfg: Config) -> None:
    if cfg.weight_decay < 0 or not 0.0 <= cfg.momentum < 1.0:
        raise ValueError(f"config keys 'weight_decay' (0 or more) and 'momentum' (in [0, 1)) are "
                         f"{cfg.weight_decay} and {cfg.momentum}")
    if cfg.lr_schedule != "onecycle":
        return
    if not 0.0 < cfg.onecycle_pct_start < 1.0 or cfg.onecycle_div_factor <= 0 \
            or cfg.onecycle_final_div_factor <= 0:
        raise ValueError(f"onecycle needs 0 < onecycle_pct_start < 1 and positive div factors, got "
                         f"{cfg.onecycle_pct_start}, {cfg.onecycle_div_factor} and "
                         f"{cfg.onecycle_final_div_factor}")
    if cfg.warmup:
        raise ValueError(f"--lr_schedule onecycle warms up by itself (over onecycle_pct_start of the "
                         f"steps); pass --warmup 0 (the config sets {cfg.warmup})")


def _check_compression(cfg: Config) -> None:
    """Compression is a DDP communication hook: layouts whose gradients DDP does not reduce alone
    (FSDP's reduce-scatter, tensor/context parallel sums, pipelines) are refused."""
    if cfg.powersgd_rank < 1:
        raise ValueError(f"config key 'powersgd_rank' must be at least 1, got {cfg.powersgd_rank}")
    if cfg.grad_compression == "none":
        return
    other = [f"--{name} {getattr(cfg, name)}" for name in ("tensor_parallel", "context_parallel",
                                                            "pipeline_parallel") if getattr(cfg, name) > 1]
    if cfg.data_parallel not in ("ddp", "zero1"):
        other.insert(0, f"--data_parallel {cfg.data_parallel}")
    if cfg.noddp:
        other.insert(0, "--noddp")
    if other:
        raise ValueError(f"--grad_compression {cfg.grad_compression} compresses DDP's gradient "
                         f"all-reduce; it does not combine with {', '.join(other)}: use it with "
                         f"--data_parallel ddp or zero1 alone")


def _check_sequence_parallel(cfg: Config) -> None:
    """Sequence parallelism leaves every replicated parameter with a partial gradient (its tp
    rank's tokens only), summed over tp by the parameter tags: DDP's comm hook or the tag hooks
    do it, FSDP's reduction and the pipeline's gradient average do not."""
    if not cfg.sequence_parallel:
        return
    if cfg.tensor_parallel < 2:
        raise ValueError("--sequence_parallel splits what tensor parallelism replicates; use it with "
                         "--tensor_parallel 2 or more")
    if cfg.data_parallel in ("fsdp", "hsdp") or cfg.pipeline_parallel > 1:
        other = "--pipeline_parallel" if cfg.pipeline_parallel > 1 else f"--data_parallel {cfg.data_parallel}"
        raise ValueError(f"--sequence_parallel does not combine with {other} here (the replicated "
                         f"layers' gradients need a sum over tp that it does not do); use it with "
                         f"--data_parallel ddp or zero1")


def _check_experts(cfg: Config) -> None:
    """A mixture of experts computes its capacity and balancing statistics per sample: a sample's
    tokens must be on one rank (no context or sequence parallelism), and its auxiliary loss
    must reach the loss (no pipeline stages, which see only their own blocks)."""
    if cfg.num_experts < 0 or cfg.moe_every < 1 or cfg.moe_capacity_factor < 0 or cfg.moe_aux_weight < 0:
        raise ValueError(f"config keys num_experts (0 or more), moe_every (1 or more), moe_capacity_factor "
                         f"and moe_aux_weight (0 or more) are {cfg.num_experts}, {cfg.moe_every}, "
                         f"{cfg.moe_capacity_factor} and {cfg.moe_aux_weight}")
    if cfg.expert_parallel < 1:
        raise ValueError(f"config key 'expert_parallel' must be at least 1, got {cfg.expert_parallel}")
    if cfg.expert_parallel > 1 and not cfg.num_experts:
        raise ValueError("--expert_parallel splits the experts of a mixture of experts; give --num_experts "
                         "too")
    if not cfg.num_experts:
        return
    if cfg.num_experts % cfg.expert_parallel:
        raise ValueError(f"num_experts {cfg.num_experts} is not divisible by expert_parallel "
                         f"{cfg.expert_parallel}; each rank holds as many experts")
    if cfg.expert_parallel > 1 and (cfg.data_parallel != "ddp" or cfg.noddp):
        what = "--noddp" if cfg.noddp else f"--data_parallel {cfg.data_parallel}"
        raise ValueError(f"--expert_parallel runs with DDP here (its hook averages the experts over the "
                         f"ranks that hold them), not with {what}; use --data_parallel ddp")
    if cfg.expert_parallel > 1 and cfg.amp_mode == "fp16":  # a rank's scaler sees its own experts' infs
        raise ValueError("amp_mode fp16 does not work with expert_parallel > 1 (each rank's loss scaler "
                         "sees only its own experts' gradients: the ranks would skip different steps and "
                         "the replicated weights drift apart); use --amp_mode bf16")
    if not 1 <= cfg.moe_top_k <= min(2, cfg.num_experts):
        raise ValueError(f"moe_top_k must be 1 or 2 and at most num_experts ({cfg.num_experts}), got "
                         f"{cfg.moe_top_k}")
    other = [f"--{name}" for name in ("context_parallel", "pipeline_parallel") if getattr(cfg, name) > 1]
    if cfg.sequence_parallel:
        other.append("--sequence_parallel")
    if other:
        raise ValueError(f"--num_experts does not combine with {', '.join(other)} here (its capacity and "
                         f"balancing are computed over each sample's tokens on one rank); use data or "
                         f"tensor parallelism")


INTERLEAVED = ("interleaved_1f1b", "zero_bubble")  # schedules with several stages on each rank


def pipeline_stages(cfg: Config) -> int:
    """Stages of the whole pipeline: one per rank, or ``stages_per_rank`` with interleaving."""
    per_rank = cfg.stages_per_rank if cfg.pipeline_schedule in INTERLEAVED else 1
    return cfg.pipeline_parallel * per_rank


def _check_pipeline(cfg: Config) -> None:
    pp, m = cfg.pipeline_parallel, cfg.num_microbatches
    if pp < 2:
        return
    if cfg.amp_mode == "fp16":  # each stage's scaler would find infs in its own gradients only
        raise ValueError("amp_mode fp16 is not supported with pipeline_parallel > 1 (the stages' loss "
                         "scalers would skip different steps); use --amp_mode bf16")
    if cfg.context_parallel > 1:
        raise ValueError("pipeline_parallel does not combine with context_parallel > 1 here; use "
                         "tensor and data parallelism with pipeline stages")
    if cfg.grad_accum_steps > 1:
        raise ValueError("with pipeline_parallel > 1 the micro-batches are the gradient accumulation: "
                         "use --num_microbatches instead of --grad_accum_steps")
    stages = pipeline_stages(cfg)
    if stages > cfg.depth:
        what = (f"pipeline_parallel {pp} x stages_per_rank {cfg.stages_per_rank} = {stages} stages"
                if stages > pp else f"pipeline_parallel {pp} stages")
        raise ValueError(f"{what} for {cfg.depth} transformer blocks: every stage needs at least one "
                         f"block; use fewer stages (or a deeper model)")
    if cfg.pipeline_schedule == "1f1b" and m < pp:
        raise ValueError(f"the 1f1b schedule needs at least as many micro-batches as stages "
                         f"(num_microbatches {m} < pipeline_parallel {pp}); use --num_microbatches {pp} "
                         f"or more")
    rounds = max(1, m // pp)  # interleaving runs the micro-batches in rounds of pp
    if cfg.pipeline_schedule in INTERLEAVED and m % rounds:
        raise ValueError(f"{cfg.pipeline_schedule} runs micro-batches in rounds of pipeline_parallel "
                         f"{pp}: num_microbatches {m} must be a multiple of {pp} (or at most {pp})")
    if cfg.pipeline_schedule == "zero_bubble" and cfg.data_parallel in ("fsdp", "hsdp"):  # seen on torch 2.13
        raise ValueError("the zero_bubble schedule with data_parallel fsdp trains with gradients that "
                         "differ from the serial model's; use --data_parallel ddp or another schedule")
    if cfg.pipeline_schedule == "zero_bubble" and cfg.enable_jit:
        raise ValueError("the zero_bubble schedule splits each backward into its input and weight "
                         "parts, which torch.compile'd blocks do not allow; use --no-enable_jit or "
                         "another schedule")


def _check_freezing(cfg: Config) -> None:
    """Freezing (training/freezing.py) changes which parameters train while the run goes: the
    layouts whose gradients are reduced or split other than by DDP and pipeline stages keep
    every parameter in their own bookkeeping, and are refused."""
    steps = cfg.freeze_steps
    if not 0.0 < cfg.freeze_alpha <= 1.0 or cfg.freeze_every < 0 or cfg.freeze_cache_mib < 0:
        raise ValueError(f"config keys freeze_alpha (in (0, 1]), freeze_every and freeze_cache_mib (0 or "
                         f"more) are {cfg.freeze_alpha}, {cfg.freeze_every} and {cfg.freeze_cache_mib}")
    if (cfg.freeze_schedule == "steps") != bool(steps):
        raise ValueError("--freeze_steps (the step at which each further block freezes) goes with "
                         "--freeze_schedule steps, and that schedule needs it: give both or neither")
    if any(s < 0 for s in steps) or list(steps) != sorted(steps) or len(steps) > cfg.depth:
        raise ValueError(f"--freeze_steps {' '.join(map(str, steps))}: give at most depth ({cfg.depth}) "
                         f"steps, 0 or more, in increasing order (the i-th freezes the i-th block)")
    if cfg.freeze_schedule == "none":
        return
    refused = [
        (cfg.tensor_parallel > 1 or cfg.context_parallel > 1, "tensor or context parallelism"),
        (cfg.data_parallel != "ddp", f"--data_parallel {cfg.data_parallel} (its shards and sharded "
                                     f"optimizer keep every parameter: use ddp)"),
        (cfg.engine != "native", "--engine deepspeed"),
        (cfg.num_experts > 0, "a mixture of experts"),
        (cfg.pipeline_parallel > 1 and cfg.pipeline_schedule in INTERLEAVED,
         f"the {cfg.pipeline_schedule} schedule (several stages per rank: use gpipe or 1f1b)"),
        (cfg.pipeline_parallel > 1 and cfg.freeze_order == "random",
         "--freeze_order random in a pipeline (its frozen blocks are not a prefix the first stage runs)"),
        (cfg.freeze_schedule == "gradnorm" and cfg.freeze_order == "random",
         "--freeze_order random (the gradient test freezes the blocks before a moving one)"),
        (cfg.freeze_schedule == "gradnorm" and cfg.amp_mode == "fp16",
         "the gradnorm schedule with --amp_mode fp16 (its norms would be of the scaled gradients: use bf16)"),
    ]
    for bad, what in refused:
        if bad:
            raise ValueError(f"--freeze_schedule {cfg.freeze_schedule} does not combine with {what} here")
    pp = cfg.pipeline_parallel
    if pp > 1 and cfg.freeze_repipeline and (pp & (pp - 1) or cfg.local_batch_size is not None):
        raise ValueError("--freeze_repipeline halves the pipeline stages and doubles the data-parallel "
                         "ranks as blocks freeze: --pipeline_parallel must be a power of two and the "
                         "local batch follow the global one (no --local_batch_size)")
    if not cfg.freeze_cache_mib:
        return
    if cfg.dropout > 0 or cfg.freeze_order == "random" or cfg.data_loader_config != "pytorch":
        raise ValueError("--freeze_cache_mib keeps each sample's output of the frozen first blocks, which "
                         "is exact only without dropout, with --freeze_order first and the pytorch loader "
                         "(it names each batch's samples); set --freeze_cache_mib 0 or change those")


def _check_profiling(cfg: Config) -> None:
    for name in ("profile_epoch", "profile_start_step"):
        value = getattr(cfg, name)
        if value is not None and value < 0:
            raise ValueError(f"config key '{name}' must be 0 or more, got {value}")
    if cfg.profile_num_steps is not None and cfg.profile_num_steps < 1:
        raise ValueError(f"config key 'profile_num_steps' must be None or at least 1, "
                         f"got {cfg.profile_num_steps}")
    if cfg.profile and cfg.profile_epoch is None:
        raise ValueError("--profile needs a profiling window: add --profile_epoch E "
                         "(and optionally --profile_start_step, --profile_num_steps)")
