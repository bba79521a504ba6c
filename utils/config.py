"""Read, validate and freeze a named configuration from config/ViT.yaml.

The YAML file holds many named configurations that build on each other with anchors
and merge keys (``<<: *base``). :func:`load_config` resolves one of them into a frozen
:class:`Config`; every key must be a known field with the right type, so a misspelled
key is an error instead of a silently ignored setting. Command-line flags are applied
with :func:`with_overrides`, which returns a new validated ``Config``. Runtime values
(local batch size, ranks, shapes) are never written back into it.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_YAML = REPO_ROOT / "config" / "ViT.yaml"

AMP_MODES = ("none", "fp16", "bf16")
DATA_LOADERS = ("pytorch", "dali")
LR_SCHEDULES = ("cosine", "constant", "onecycle")
OPTIMIZERS = ("Adam", "AdamW", "LAMB", "SGD")
DATA_PARALLEL = ("ddp", "zero1", "fsdp", "hsdp")
GRAD_COMPRESSIONS = ("none", "bf16", "fp16", "powersgd")
ENGINES = ("native", "deepspeed")  # deepspeed: training/deepspeed_engine.py
ATTENTION_KERNELS = ("auto", "default", "flash", "efficient", "cudnn", "math")  # utils/attention.py
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
FREEZE_SCHEDULES = ("none", "formula", "steps", "gradnorm")  # training/freezing.py
ADAM_BETAS = (0.9, 0.95)  # beta2 0.95, as the tutorial: steadier with large batches


def key(default: Any, help: str, group: str, **flag: Any) -> Any:
    """A config key: its default, its help text (shown by --help) and the flag group it
    appears in. ``flag`` may add ``aliases`` (other flag names) or ``choices``."""
    return dataclasses.field(default=default, metadata={"help": help, "group": group, **flag})


@dataclass(frozen=True)
class Config:
    """One training configuration. Field names are the YAML keys and the flags' names."""

    # model
    img_size: tuple[int, int] = key((360, 720), "grid height and width (the data is cropped to it)", "model")
    patch_size: int = key(8, "side of the square patches that become tokens", "model")
    embed_dim: int = key(384, "token width", "model")
    depth: int = key(12, "transformer blocks", "model")
    num_heads: int = key(8, "attention heads per block", "model")
    mlp_ratio: float = key(4.0, "MLP hidden width / embed_dim", "model")
    dropout: float = key(0.0, "dropout probability", "model")
    num_experts: int = key(0, "mixture of experts: expert MLPs in each MoE block (0: every block keeps "
                              "its dense MLP)", "model")
    moe_top_k: int = key(1, "experts each token is sent to (1: Switch, 2: GShard)", "model")
    moe_every: int = key(2, "every moe_every-th block has a mixture of experts", "model")
    moe_capacity_factor: float = key(0.0, "tokens an expert takes from a sample, as a multiple of an "
                                          "even share (0: no limit, nothing dropped)", "model")
    moe_aux_weight: float = key(0.01, "weight of the load-balancing loss added to the training loss",
                                "model")
    n_in_channels: int = key(20, "input variables (ERA5 channels)", "model")
    n_out_channels: int = key(20, "predicted variables (the first n of the input)", "model")
    # data
    data_dir: str = key("/data", "ERA5 folder with train/, valid/, stats/", "data")
    dt: int = key(1, "predict fields[t + dt]; dt in 6-hour steps", "data")
    limit_nsamples: int | None = key(None, "use only the first N training samples", "data")
    limit_nsamples_val: int | None = key(None, "use only the first N validation samples", "data")
    num_data_workers: int = key(0, "DataLoader workers (0 = load in the main process)", "data")
    data_loader_config: str = key("pytorch", "data loader", "data", choices=DATA_LOADERS)
    dali_start_method: str = key("auto", "how DALI starts its worker processes: auto (spawn on a GPU, "
                                 "where forking after CUDA starts is unsafe; fork on a CPU), fork or "
                                 "spawn", "data", choices=("auto", "fork", "spawn"))
    # optimisation
    num_iters: int = key(30000, "optimizer steps to train", "optimisation")
    global_batch_size: int = key(16, "samples per optimizer step over all data-parallel ranks",
                                 "optimisation")
    local_batch_size: int | None = key(None, "per-rank batch (default: global_batch_size / "
                                             "data-parallel ranks)", "optimisation")
    lr: float = key(5e-4, "peak learning rate", "optimisation")
    lr_schedule: str = key("cosine", "learning-rate schedule after warm-up (onecycle: its own warm-up, "
                                     "from lr / onecycle_div_factor up to lr, then down)", "optimisation",
                           choices=LR_SCHEDULES)
    warmup: int = key(0, "steps of linear learning-rate warm-up", "optimisation")
    onecycle_pct_start: float = key(0.3, "onecycle: fraction of the steps spent rising to lr", "optimisation")
    onecycle_div_factor: float = key(25.0, "onecycle: the first learning rate is lr / this", "optimisation")
    onecycle_final_div_factor: float = key(1e4, "onecycle: the last learning rate is the first / this",
                                           "optimisation")
    optimizer_type: str = key("Adam", "optimizer: Adam, AdamW (decoupled weight decay), LAMB (Adam with "
                                      "a trust ratio per tensor, for large batches) or SGD (with momentum)",
                              "optimisation", choices=OPTIMIZERS, aliases=("--optimizer",))
    adam_betas: tuple[float, float] = key(ADAM_BETAS, "Adam's beta1 and beta2 (AdamW and LAMB too)",
                                          "optimisation")
    weight_decay: float = key(0.0, "AdamW and LAMB: decoupled weight decay; SGD: L2 penalty", "optimisation")
    momentum: float = key(0.9, "SGD: momentum", "optimisation")
    grad_clip_norm: float = key(0.0, "clip the global norm of the whole model's gradient to this "
                                     "(0 = off); the norm before clipping is logged every step",
                                "optimisation")
    amp_mode: str = key("none", "mixed precision", "optimisation", choices=AMP_MODES)
    attention_kernel: str = key("auto", "scaled-dot-product-attention kernel: auto (torch's pick, but "
                                "math on a CPU in fp16, and in bf16 below 160 tokens), default "
                                "(torch's pick), flash, efficient, cudnn or math", "optimisation",
                                choices=ATTENTION_KERNELS)
    enable_fused: bool = key(False, "fused Adam (--no-enable_fused to switch off)", "optimisation")
    enable_jit: bool = key(False, "torch.compile the model and loss (--no-enable_jit to switch off)",
                           "optimisation")
    # parallelism: model-parallel sizes; the data-parallel size is what the ranks leave
    tensor_parallel: int = key(1, "ranks that split each layer (heads, MLP features); "
                                  "--row_parallel_size is the SC23 name", "parallelism",
                               aliases=("--row_parallel_size",))
    context_parallel: int = key(1, "ranks that split the sequence of tokens", "parallelism")
    expert_parallel: int = key(1, "data-parallel ranks that split the experts of each mixture of "
                                  "experts (tokens reach their experts by all-to-all)", "parallelism")
    sequence_parallel: bool = key(False, "with tensor_parallel: the activations between the tensor-"
                                         "parallel layers (norms, residuals, dropout) split along the "
                                         "tokens over the tp ranks; all-gather and reduce-scatter "
                                         "replace the all-reduce", "parallelism")
    pipeline_parallel: int = key(1, "pipeline stages: each rank holds a contiguous part of the "
                                    "transformer blocks and passes activations on", "parallelism")
    pipeline_schedule: str = key("1f1b", "order of the micro-batches' forward and backward passes on "
                                 "each stage", "parallelism", choices=PIPELINE_SCHEDULES)
    num_microbatches: int = key(4, "pipeline micro-batches the local batch is split into", "parallelism")
    stages_per_rank: int = key(2, "interleaved_1f1b and zero_bubble: pipeline stages (model chunks) "
                                  "on each rank", "parallelism")
    parallel_order: str = key("tp-cp-dp", "rank layout, fastest-varying dimension first (pp, when "
                                          "not named, varies slowest)", "parallelism")
    # memory
    activation_checkpointing: str = key("none", "recompute activations in backward instead of storing "
                                        "them: none, full (every block), selective (every other one)",
                                        "memory", choices=("none", "full", "selective"))
    grad_accum_steps: int = key(1, "micro-batches per optimizer step: the local batch is split into N, "
                                   "gradients add up, one gradient reduction per step", "memory")
    # data parallel
    data_parallel: str = key("ddp", "how the data-parallel ranks hold the training state: ddp "
                             "(replicated), zero1 (optimizer state sharded), fsdp (parameters, "
                             "gradients and optimizer state sharded), hsdp (fsdp within groups of "
                             "dp_shard ranks, replicated across the groups)", "data parallel",
                             choices=DATA_PARALLEL)
    dp_shard: int = key(0, "hsdp: ranks in each sharding group; the data-parallel ranks form "
                           "dp / dp_shard groups that each hold one sharded copy and average "
                           "gradients between them (0: the ranks of one node)", "data parallel")
    cpu_offload: bool = key(False, "fsdp / hsdp: keep the parameters, gradients and Adam's state in "
                                   "host memory (FSDP2's CPUOffloadPolicy); the optimizer steps on "
                                   "the CPU. --engine deepspeed: ZeRO-Offload (Adam's state and step "
                                   "on the CPU; the parameters too at --zero_stage 3)", "data parallel")
    engine: str = key("native", "who runs the step: native (this project's loop and layouts) or "
                                "deepspeed (DeepSpeed's engine: wrapping, backward, step, accumulation, "
                                "clipping; install with `make deepspeed`)", "data parallel",
                      choices=ENGINES)
    zero_stage: int = key(0, "--engine deepspeed: what its ZeRO partitions over the data-parallel "
                             "ranks: 0 nothing (DDP), 1 optimizer state, 2 and gradients, 3 and "
                             "parameters", "data parallel")
    reshard_after_forward: bool = key(True, "fsdp: free the gathered parameters after forward and "
                                            "gather them again in backward (ZeRO-3; "
                                            "--no-reshard_after_forward keeps them: ZeRO-2)",
                                      "data parallel")
    bucket_cap_mb: float = key(25.0, "DDP gradient bucket size in MB", "data parallel")
    grad_compression: str = key("none", "DDP: send the gradients compressed (a communication hook, "
                                "distributed/compression.py): none, bf16 or fp16 (half the bytes), "
                                "powersgd (a low-rank approximation)", "data parallel",
                                choices=GRAD_COMPRESSIONS)
    powersgd_rank: int = key(4, "powersgd: rank of each gradient matrix's approximation", "data parallel")
    powersgd_error_feedback: bool = key(True, "powersgd: add each step's compression error to the "
                                              "next step's gradient", "data parallel")
    dist_backend: str = key("auto", "process-group backend: auto (NCCL on GPUs, gloo on CPUs), nccl, or "
                                    "gloo, on GPUs too (tensors go through host memory; ranks may then "
                                    "share a GPU, as make gpu-check does on a machine with one)",
                            "data parallel", choices=("auto", "nccl", "gloo"))
    rendezvous_timeout_s: float = key(60.0, "seconds to wait for every rank to start and meet "
                                            "(srun or plain environment; torchrun meets on its own)",
                                      "data parallel")
    collective_timeout_s: float = key(300.0, "seconds a collective may wait for a rank that stopped "
                                             "responding before every rank fails (on NCCL the heartbeat "
                                             "names it then, NCCL's own timeout is 30 s later)",
                                      "data parallel")
    disable_broadcast_buffers: bool = key(False, "do not broadcast module buffers from rank 0 "
                                                 "every forward", "data parallel")
    noddp: bool = key(False, "no gradient synchronisation: each rank trains alone (profiling "
                             "compute only)", "data parallel")
    # freezing layers as training goes (training/freezing.py; PipeTransformer)
    freeze_schedule: str = key("none", "freeze the embedding and the first blocks as training goes: none, "
                               "formula (after e epochs ceil(depth (1 - (1 - freeze_alpha)^e)) blocks), "
                               "steps (--freeze_steps) or gradnorm (per block, the change of its "
                               "gradients' L1 norm between intervals)", "freezing", choices=FREEZE_SCHEDULES)
    freeze_alpha: float = key(1 / 3, "formula: the share of the still active blocks frozen after each "
                                     "epoch (1/3 conservative, 1/2 PipeTransformer's CIFAR-100 runs)",
                              "freezing")
    freeze_every: int = key(0, "formula: steps per epoch of the formula; gradnorm: steps per interval "
                               "(0: the data's epoch)", "freezing")
    freeze_steps: tuple[int, ...] = key((), "steps: the step (0-based) at which each further block "
                                            "freezes: the i-th entry freezes block i (the first also "
                                            "the embedding)", "freezing")
    freeze_order: str = key("first", "which blocks freeze: first (the earliest, in order) or random "
                                     "(a control: as many blocks drawn from the seed)", "freezing",
                            choices=("first", "random"))
    freeze_cache_mib: float = key(0.0, "memory for the frozen blocks' output per sample, kept for the "
                                       "next epochs (0: no cache; samples beyond it are recomputed)",
                                  "freezing")
    freeze_repipeline: bool = key(True, "with pipeline stages: re-cut them as blocks freeze, and once "
                                        "the active blocks fit on half the stages, continue on half "
                                        "the stages with twice the data-parallel ranks", "freezing")
    # run
    expdir: str = key("/logs", "root of the run directories", "run")
    seed: int = key(0, "random seed (weights, data order, dropout)", "run")
    checkpoint_every: int = key(0, "steps between checkpoints (0 = only at the end)", "run")
    stop_check_every: int = key(10, "steps between the ranks' checks for a stop signal (TERM, USR1, "
                                    "USR2); on one, training checkpoints and exits with status 75",
                                "run")
    # profiling window (utils/profiling.py): steps profile_start_step.. of epoch profile_epoch
    profile_epoch: int | None = key(None, "epoch (0-based) whose steps rank 0 brackets with "
                                          "cudaProfilerStart/Stop", "profiling")
    profile_start_step: int = key(0, "first profiled step of that epoch (0-based)", "profiling")
    profile_num_steps: int | None = key(None, "steps in the window (default: to epoch end)",
                                        "profiling")
    memory_snapshot: bool = key(False, "record one step's memory by kind (parameters, gradients, "
                                       "optimizer state, activations) into RUN_DIR/memory "
                                       "(scripts/plot_memory.py draws it); on CUDA also the "
                                       "allocator's history for pytorch.org/memory_viz", "profiling")
    profile: bool = key(False, "write a torch.profiler trace of the window to RUN_DIR/profile "
                               "(CPU or GPU)", "profiling")

    def __post_init__(self) -> None:
        from utils.config_checks import check_config  # the checks import nothing from here

        check_config(self)

    @property
    def data_path(self) -> Path:
        return resolve_path(self.data_dir)

    @property
    def exp_path(self) -> Path:
        return resolve_path(self.expdir)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["img_size"] = list(self.img_size)
        return d


# Keys a resumed run may change (training/run_dir.py): how data is loaded, profiled, checkpointed,
# recomputed and laid out, and num_iters to extend a run. The others change the mathematics.
MAY_CHANGE_ON_RESUME = frozenset({
    "num_iters", "data_dir", "num_data_workers", "data_loader_config", "dali_start_method", "expdir",
    "checkpoint_every",
    "stop_check_every", "memory_snapshot", "profile_epoch", "profile_start_step", "profile_num_steps",
    "profile",
    "enable_fused", "enable_jit", "attention_kernel", "tensor_parallel", "context_parallel", "parallel_order",
    "sequence_parallel", "expert_parallel", "bucket_cap_mb", "disable_broadcast_buffers",
    "rendezvous_timeout_s", "collective_timeout_s", "dist_backend",
    "activation_checkpointing", "grad_accum_steps", "data_parallel", "reshard_after_forward",
    "dp_shard", "cpu_offload", "engine", "zero_stage",
    "pipeline_parallel", "pipeline_schedule", "num_microbatches", "stages_per_rank",
    "freeze_cache_mib", "freeze_repipeline",
})

FIELDS = tuple(typing.get_type_hints(Config))


def resolve_path(path: str) -> Path:
    """Absolute paths stay; relative ones are taken from the repository root."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else REPO_ROOT / p


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist; pass --yaml_config config/ViT.yaml")
    try:
        data = YAML(typ="safe", pure=True).load(path.read_text())
    except YAMLError as err:
        raise ValueError(f"config file {path} is not valid YAML: {err}".replace("\n", " ")) from err
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must map config names to settings")
    return data


def _normalise(raw: dict[str, Any], source: str) -> dict[str, Any]:
    values = {}
    for key, value in raw.items():
        if key not in FIELDS:
            close = difflib.get_close_matches(str(key), FIELDS, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ValueError(f"unknown config key '{key}' in {source}{hint}")
        if value == "None":
            value = None
        if isinstance(value, list):
            value = tuple(value)
        values[key] = value
    return values


def available_configs(path: Path | str = DEFAULT_YAML) -> list[str]:
    return sorted(k for k, v in _read_yaml(Path(path)).items() if isinstance(v, dict))


def load_config(path: Path | str, name: str) -> Config:
    """Load configuration ``name`` from the YAML file at ``path`` and validate it."""
    path = Path(path)
    data = _read_yaml(path)
    if name not in data or not isinstance(data[name], dict):
        names = ", ".join(available_configs(path))
        raise ValueError(f"unknown config '{name}' in {path}; available: {names}")
    return Config(**_normalise(dict(data[name]), f"config '{name}' of {path}"))


def with_overrides(cfg: Config, **overrides: Any) -> Config:
    """Return a new Config with the given values; ``None`` means 'flag not given'."""
    given = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(cfg, **_normalise(given, "command-line overrides"))
