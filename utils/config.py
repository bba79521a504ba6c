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
import types
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
LR_SCHEDULES = ("cosine", "constant")
OPTIMIZERS = ("Adam",)


@dataclass(frozen=True)
class Config:
    """One training configuration. Field names are the YAML keys."""

    # model
    img_size: tuple[int, int] = (360, 720)
    patch_size: int = 8
    embed_dim: int = 384
    depth: int = 12
    num_heads: int = 8
    mlp_ratio: float = 4.0
    dropout: float = 0.0
    n_in_channels: int = 20
    n_out_channels: int = 20
    # data
    data_dir: str = "/data"
    dt: int = 1
    limit_nsamples: int | None = None
    limit_nsamples_val: int | None = None
    num_data_workers: int = 0
    data_loader_config: str = "pytorch"
    # optimisation
    num_iters: int = 30000
    global_batch_size: int = 16
    lr: float = 5e-4
    lr_schedule: str = "cosine"
    warmup: int = 0
    optimizer_type: str = "Adam"
    amp_mode: str = "none"
    enable_fused: bool = False
    enable_jit: bool = False
    # parallelism (model parallel sizes; data parallel size is what is left)
    tensor_parallel: int = 1
    context_parallel: int = 1
    parallel_order: str = "tp-cp-dp"
    # run
    expdir: str = "/logs"
    seed: int = 0
    checkpoint_every: int = 0
    # profiling window (utils/profiling.py): steps profile_start_step.. of epoch profile_epoch
    profile_epoch: int | None = None  # None: no window
    profile_start_step: int = 0
    profile_num_steps: int | None = None  # None: to the end of the epoch
    profile: bool = False  # also write a torch.profiler trace of the window

    def __post_init__(self) -> None:
        _check_types(self)
        _check_values(self)

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


HINTS = typing.get_type_hints(Config)
FIELDS = tuple(HINTS)


def resolve_path(path: str) -> Path:
    """Absolute paths stay; relative ones are taken from the repository root."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else REPO_ROOT / p


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is tuple:
        args = typing.get_args(hint)
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


def _type_name(name: str) -> str:
    return str(HINTS[name]).replace("typing.", "").replace("<class '", "").replace("'>", "")


def _check_types(cfg: Config) -> None:
    for name in FIELDS:
        value = getattr(cfg, name)
        if not _type_ok(value, HINTS[name]):
            raise ValueError(
                f"config key '{name}' must be {_type_name(name)}, got {value!r}; "
                f"fix it in the YAML file or on the command line"
            )


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"config key '{name}' is {value!r}; choose one of {', '.join(choices)}")


def _check_values(cfg: Config) -> None:
    _check_choice("amp_mode", cfg.amp_mode, AMP_MODES)
    _check_choice("data_loader_config", cfg.data_loader_config, DATA_LOADERS)
    _check_choice("lr_schedule", cfg.lr_schedule, LR_SCHEDULES)
    _check_choice("optimizer_type", cfg.optimizer_type, OPTIMIZERS)
    if sorted(cfg.parallel_order.split("-")) != ["cp", "dp", "tp"]:
        raise ValueError(f"config key 'parallel_order' is {cfg.parallel_order!r}; name tp, cp and dp "
                         f"once each, fastest-varying first, for example 'tp-cp-dp'")
    positive = ("patch_size", "embed_dim", "depth", "num_heads", "n_in_channels",
                "n_out_channels", "dt", "num_iters", "global_batch_size",
                "tensor_parallel", "context_parallel")
    for name in positive:
        if getattr(cfg, name) < 1:
            raise ValueError(f"config key '{name}' must be at least 1, got {getattr(cfg, name)}")
    for name in ("warmup", "num_data_workers", "checkpoint_every", "seed"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"config key '{name}' must be 0 or more, got {getattr(cfg, name)}")
    for name in ("limit_nsamples", "limit_nsamples_val"):
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
