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
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from utils.config_groups import (  # noqa: F401 (the choices are read from here too)
    ADAM_BETAS,
    AMP_MODES,
    ATTENTION_KERNELS,
    DATA_LOADERS,
    DATA_PARALLEL,
    ENGINES,
    FREEZE_SCHEDULES,
    GRAD_COMPRESSIONS,
    GROUPS,
    INTERLEAVED,
    KEY_GROUP,
    LR_SCHEDULES,
    OPTIMIZERS,
    PIPELINE_SCHEDULES,
    WEIGHT_STASHING,
    DataConfig,
    FreezingConfig,
    MemoryConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    ProfilingConfig,
    RunConfig,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_YAML = REPO_ROOT / "config" / "ViT.yaml"

class Config:
    """One training configuration: its groups (utils/config_groups.py: ``cfg.model``, ``cfg.data``,
    ``cfg.optim``, ``cfg.layout``, ``cfg.memory``, ``cfg.run``, ``cfg.profiling``, ``cfg.freeze``),
    each validated as it is built, then the checks that span groups (``check_across``). Flags and
    YAML keys are flat, and so is ``replace``; the project's code reads a key through its group
    (``cfg.optim.lr``: tests/test_layout.py), a test or a notebook may read it flat (``cfg.lr``).
    Frozen: ``replace`` returns a new, validated Config."""

    __slots__ = tuple(GROUPS)

    def __init__(self, **keys: Any) -> None:
        unknown = sorted(set(keys) - set(KEY_GROUP))
        if unknown:
            raise TypeError(f"Config got unknown keys {unknown}")
        for attr, group in GROUPS.items():
            own = {k: v for k, v in keys.items() if KEY_GROUP[k] == attr}
            object.__setattr__(self, attr, group(**own))
        check_across(self)

    def __getattr__(self, name: str) -> Any:  # a flat key: its group's value
        attr = KEY_GROUP.get(name)
        if attr is None:
            raise AttributeError(f"Config has no key {name!r}")
        return getattr(object.__getattribute__(self, attr), name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"Config is frozen; use cfg.replace({name}=...)")

    def __reduce__(self) -> tuple:  # pickled as its keys (loader workers, spawned processes)
        return (_rebuild, (self.keys(),))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and self.keys() == other.keys()

    def __hash__(self) -> int:
        return hash(tuple(self.keys().items()))

    def __repr__(self) -> str:
        return "Config(" + ", ".join(f"{k}={v!r}" for k, v in self.keys().items()) + ")"

    def keys(self) -> dict[str, Any]:
        """Every key and its value, flat, in declaration order."""
        return {k: getattr(getattr(self, attr), k) for k, attr in KEY_GROUP.items()}

    def replace(self, **keys: Any) -> Config:
        return Config(**{**self.keys(), **keys})

    @property
    def data_path(self) -> Path:
        return resolve_path(self.data_dir)

    @property
    def exp_path(self) -> Path:
        return resolve_path(self.expdir)

    def to_dict(self) -> dict[str, Any]:
        d = self.keys()
        d["img_size"] = list(self.img_size)
        return d


def _rebuild(keys: dict[str, Any]) -> Config:
    return Config(**keys)


def check_across(cfg: Config) -> None:
    """The checks that need keys of several groups (one-line ValueErrors that say what to do)."""
    model, optim, layout, memory = cfg.model, cfg.optim, cfg.layout, cfg.memory
    fp16_refused = [  # each rank's loss scaler would decide alone: the ranks skip different steps
        (layout.tensor_parallel > 1, "amp_mode fp16 does not work with tensor_parallel > 1 (the ranks' loss "
                                     "scalers would skip different steps); use --amp_mode bf16"),
        (layout.sharded,
         f"amp_mode fp16 is not supported with data_parallel {layout.data_parallel} (its loss scaler would "
         f"need the sharded gradients' inf checks combined); use --amp_mode bf16"),
        (layout.pipeline_parallel > 1,
         "amp_mode fp16 is not supported with pipeline_parallel > 1 (the stages' loss scalers would skip "
         "different steps); use --amp_mode bf16"),
        (layout.expert_parallel > 1 and model.num_experts > 0,
         "amp_mode fp16 does not work with expert_parallel > 1 (each rank's loss scaler sees only its own "
         "experts' gradients: the ranks would skip different steps and the replicated weights drift apart); "
         "use --amp_mode bf16"),
    ]
    if layout.engine == "deepspeed":
        refused = [
            (optim.optimizer_type == "LAMB", "--optimizer LAMB (DeepSpeed's LAMB has no CPU build; use "
                                             "Adam or AdamW)"),
            (optim.amp_mode == "fp16", "--amp_mode fp16 (use bf16, which needs no loss scaling)"),
            (memory.cpu_offload and layout.zero_stage == 0, "--cpu_offload at --zero_stage 0 (ZeRO-Offload "
                                                            "needs stage 1, 2 or 3)"),
        ]
        for bad, what in refused:
            if bad:
                raise ValueError(f"--engine deepspeed does not run {what}")
    elif memory.cpu_offload and not layout.sharded:
        raise ValueError(f"--cpu_offload moves FSDP's shards to host memory; use it with "
                         f"--data_parallel fsdp or hsdp, not {layout.data_parallel}")
    if optim.amp_mode == "fp16":
        for bad, message in fp16_refused:
            if bad:
                raise ValueError(message)
    check_experts(model, layout)
    if layout.tp_impl == "torch" and (layout.tensor_parallel < 2 or layout.context_parallel > 1
                                      or layout.pipeline_parallel > 1):
        raise ValueError("--tp_impl torch is tensor parallelism alone here: use it with --tensor_parallel 2 "
                         "or more and no --context_parallel or --pipeline_parallel (--tp_impl course "
                         "takes those)")
    if optim.optimizer_type == "OneBitAdam":
        check_onebit(cfg)
    elif optim.onebit_warmup_steps != 100:
        raise ValueError(f"--onebit_warmup_steps {optim.onebit_warmup_steps} is 1-bit Adam's; this run would "
                         f"ignore it: use it with --optimizer OneBitAdam, or leave it out")
    if layout.pipeline_parallel > 1:
        check_pipeline_fits(model, optim, layout, memory)
    if layout.pipeline_parallel > 1 and layout.pipeline_schedule == "async_1f1b":
        check_async_pipeline(model, optim, layout, memory, cfg.run.checkpoint_every)
    if cfg.freeze.freeze_schedule != "none":
        check_freezing(cfg)


def check_freezing(cfg: Config) -> None:
    """Freezing (training/freezing.py) changes which parameters train while the run goes: the
    layouts whose gradients are reduced or split other than by DDP and pipeline stages keep
    every parameter in their own bookkeeping, and are refused."""
    freeze, model, layout = cfg.freeze, cfg.model, cfg.layout
    if len(freeze.freeze_steps) > model.depth:
        raise ValueError(f"--freeze_steps gives {len(freeze.freeze_steps)} steps for {model.depth} blocks: "
                         f"give at most depth steps (the i-th freezes the i-th block)")
    refused = [
        (layout.tensor_parallel > 1 or layout.context_parallel > 1, "tensor or context parallelism"),
        (not layout.replicated, f"--data_parallel {layout.data_parallel} (its shards and sharded "
                                        f"optimizer keep every parameter: use ddp)"),
        (layout.engine != "native", "--engine deepspeed"),
        (model.num_experts > 0, "a mixture of experts"),
        (layout.pipeline_parallel > 1 and layout.pipeline_schedule in INTERLEAVED,
         f"the {layout.pipeline_schedule} schedule (several stages per rank: use gpipe or 1f1b)"),
        (layout.pipeline_parallel > 1 and layout.pipeline_schedule == "async_1f1b",
         "the async_1f1b schedule (its stages keep weight versions of every block: use gpipe or 1f1b)"),
        (layout.pipeline_parallel > 1 and freeze.freeze_order == "random",
         "--freeze_order random in a pipeline (its frozen blocks are not a prefix the first stage runs)"),
        (freeze.freeze_schedule == "gradnorm" and cfg.optim.amp_mode == "fp16",
         "--amp_mode fp16 (the gradnorm schedule's norms would be of the scaled gradients: use bf16)"),
    ]
    for bad, what in refused:
        if bad:
            raise ValueError(f"--freeze_schedule {freeze.freeze_schedule} does not combine with {what} here")
    pp = layout.pipeline_parallel
    if pp > 1 and freeze.freeze_repipeline and (pp & (pp - 1) or cfg.optim.local_batch_size is not None):
        raise ValueError("--freeze_repipeline halves the pipeline stages and doubles the data-parallel "
                         "ranks as blocks freeze: --pipeline_parallel must be a power of two and the "
                         "local batch follow the global one (no --local_batch_size)")
    if not freeze.freeze_cache_mib:
        return
    if model.dropout > 0 or freeze.freeze_order == "random" or cfg.data.data_loader_config != "pytorch":
        raise ValueError("--freeze_cache_mib keeps each sample's output of the frozen first blocks, which "
                         "is exact only without dropout, with --freeze_order first and the pytorch loader "
                         "(it names each batch's samples); set --freeze_cache_mib 0 or change those")


def check_experts(model: ModelConfig, layout: ParallelConfig) -> None:
    """A mixture of experts computes its capacity and balancing statistics per sample: a sample's
    tokens must be on one rank (no context or sequence parallelism), and its auxiliary loss
    must reach the loss (no pipeline stages, which see only their own blocks)."""
    if layout.expert_parallel > 1 and not model.num_experts:
        raise ValueError("--expert_parallel splits the experts of a mixture of experts; give --num_experts "
                         "too")
    if not model.num_experts:
        return
    if model.num_experts % layout.expert_parallel:
        raise ValueError(f"num_experts {model.num_experts} is not divisible by expert_parallel "
                         f"{layout.expert_parallel}; each rank holds as many experts")
    if layout.expert_parallel > 1 and (not layout.replicated or layout.noddp):
        what = "--noddp" if layout.noddp else f"--data_parallel {layout.data_parallel}"
        raise ValueError(f"--expert_parallel runs with DDP here (its hook averages the experts over the "
                         f"ranks that hold them), not with {what}; use --data_parallel ddp")
    other = [f"--{name}" for name in ("context_parallel", "pipeline_parallel") if getattr(layout, name) > 1]
    if layout.sequence_parallel:
        other.append("--sequence_parallel")
    if other:
        raise ValueError(f"--num_experts does not combine with {', '.join(other)} here (its capacity and "
                         f"balancing are computed over each sample's tokens on one rank); use data or "
                         f"tensor parallelism")


def check_pipeline_fits(model: ModelConfig, optim: OptimizerConfig, layout: ParallelConfig,
                        memory: MemoryConfig) -> None:
    if memory.grad_accum_steps > 1:
        raise ValueError("with pipeline_parallel > 1 the micro-batches are the gradient accumulation: "
                         "use --num_microbatches instead of --grad_accum_steps")
    pp, stages = layout.pipeline_parallel, layout.stages
    if stages > model.depth:
        what = (f"pipeline_parallel {pp} x stages_per_rank {layout.stages_per_rank} = {stages} stages"
                if stages > pp else f"pipeline_parallel {pp} stages")
        raise ValueError(f"{what} for {model.depth} transformer blocks: every stage needs at least one "
                         f"block; use fewer stages (or a deeper model)")
    if layout.pipeline_schedule == "zero_bubble" and optim.enable_jit:
        raise ValueError("the zero_bubble schedule splits each backward into its input and weight "
                         "parts, which torch.compile'd blocks do not allow; use --no-enable_jit or "
                         "another schedule")


def check_onebit(cfg: Config) -> None:
    """1-bit Adam averages whole momenta over replicated data-parallel ranks (DDP)."""
    optim, layout = cfg.optim, cfg.layout
    refused = [
        (not layout.replicated, f"--data_parallel {layout.data_parallel} (its optimizer state is "
                                        f"sharded; 1-bit Adam averages whole momenta: use ddp)"),
        (layout.tensor_parallel > 1 or layout.context_parallel > 1 or layout.pipeline_parallel > 1
         or layout.expert_parallel > 1, "model parallelism (tensor-parallel slices, sequence shards, "
                                        "stages and experts need their own gradient sums; use data "
                                        "parallelism alone)"),
        (optim.amp_mode == "fp16", "--amp_mode fp16 (its loss scaler skips steps by the gradients, which "
                                   "the ranks no longer share; use bf16)"),
        (layout.grad_compression != "none", f"--grad_compression {layout.grad_compression} (1-bit Adam "
                                            f"compresses the momentum itself)"),
        (optim.grad_clip_norm > 0, "--grad_clip_norm (after the warm-up each rank has its own gradient)"),
        (layout.engine != "native" or layout.noddp, "--engine deepspeed or --noddp (it is DDP's hook)"),
        (cfg.freeze.freeze_schedule != "none", "--freeze_schedule (the frozen parameters leave its "
                                               "flat momentum)"),
    ]
    for bad, what in refused:
        if bad:
            raise ValueError(f"--optimizer OneBitAdam does not run with {what}")


def check_async_pipeline(model: ModelConfig, optim: OptimizerConfig, layout: ParallelConfig,
                         memory: MemoryConfig, checkpoint_every: int = 0) -> None:
    """What the asynchronous schedule (distributed/async_pipeline.py) does not run: each stage
    recomputes its forward in backward (so no dropout, whose masks would differ, and no compile
    or checkpointing of its own), updates at its own time (so no norm over the whole model) and
    is whole layers (no tensor parallelism); 2BW's two versions need p - 1 micro-batches a step;
    a checkpoint is written where the pipeline drains."""
    pp, m, drain = layout.pipeline_parallel, layout.num_microbatches, layout.async_drain_every
    if checkpoint_every % drain:
        raise ValueError(f"--checkpoint_every {checkpoint_every}: the asynchronous pipeline writes a "
                         f"checkpoint only where it drains, every --async_drain_every {drain} steps; pass a "
                         f"multiple of {drain} (or 0: at the end)")
    if layout.weight_stashing == "2bw" and m < pp - 1:
        raise ValueError(f"--weight_stashing 2bw keeps two weight versions only with at least "
                         f"pipeline_parallel - 1 micro-batches per step (num_microbatches {m} < {pp - 1}); "
                         f"use --num_microbatches {pp - 1} or more")
    refused = [(layout.tensor_parallel > 1, "--tensor_parallel (its stages are whole layers here); use "
                                            "--tensor_parallel 1"),
               (model.dropout > 0, f"--dropout {model.dropout} (each stage recomputes its forward in "
                                   f"backward, with other dropout masks); use --dropout 0"),
               (optim.grad_clip_norm > 0, "--grad_clip_norm (the stages update at different times: there "
                                          "is no whole-model gradient to clip); use --grad_clip_norm 0"),
               (optim.enable_jit, "--enable_jit (the stages run with swapped weight versions); use "
                                  "--no-enable_jit"),
               (memory.activation_checkpointing != "none", "--activation_checkpointing (each stage already "
                                                           "recomputes its forward); use "
                                                           "--activation_checkpointing none")]
    for bad, what in refused:
        if bad:
            raise ValueError(f"the async_1f1b schedule does not run {what}")


# Keys a resumed run may change (training/run_dir.py), each declared so with its key
MAY_CHANGE_ON_RESUME = frozenset(f.name for group in GROUPS.values() for f in dataclasses.fields(group)
                                 if f.metadata["may_change"])

FIELDS = tuple(KEY_GROUP)


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
    return cfg.replace(**_normalise(given, "command-line overrides"))
