"""What every layout needs of a model: the interface a backbone implements.

A backbone maps the atmosphere (B, C_in, H, W) to its forecast (B, C_out, H, W) in three parts,
and the parallel code outside networks/ knows only these parts, never a layer's name:

    stem     (B, C_in, H, W) -> h (B, *unit_shape)   the ViT: patch and position embedding
    units    h -> h, "0", "1", ..., "L-1" in order    the ViT: its transformer blocks
    tail     h -> (B, *, F)                           the ViT: the final norm and head
    assemble (B, *, F) -> (B, C_out, H, W)            the ViT: patches back to the grid

What each layout does with them:

- FSDP, activation checkpointing and torch.compile: one unit at a time (``units()``).
- the pipeline: a stage keeps a contiguous run of units, the first stage the stem and the
  last the tail (``cut``); stages send each other h, of ``unit_shape`` per sample.
- freezing: the stem and the first units freeze together (``part_of`` names a parameter's
  part from its serial name) and run without autograd (``embed`` then the units).
- tensor parallelism: ``tp_plan()`` names the linear layers to split, in torch's vocabulary:
  "colwise" (by output features, torch's ColwiseParallel) and "rowwise" (by input features,
  RowwiseParallel); "context" marks an attention (an :class:`AttentionCore`) whose keys and
  values context parallelism gathers. An empty plan refuses tensor parallelism in one line.
- context and sequence parallelism: h's dimension 1 holds ``num_tokens`` tokens; the two slots
  ``seq_split`` (after the stem) and ``seq_gather`` (before ``assemble``) are where a rank keeps
  its tokens and gathers everyone's back. ``num_tokens`` = 0: no tokens, no context parallelism.
- experts: every :class:`networks.moe.MoEMLP` is found where it is (expert parallelism swaps it).
- every layout starts from the same weights: ``initial_values`` gives each parameter's value
  from a seed, one parameter at a time, even for a model built on the meta device.

A learner's own model subclasses :class:`Backbone`, sets the class attributes below, writes
``stem``, ``tail``, ``initial_values`` (and ``tp_plan``, ``assemble`` where it has them), and
adds one line to ``BACKBONES``.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from utils.config_groups import ModelConfig

BACKBONES = {"vit": "networks.vit:ViT", "afno": "networks.afno:AFNO"}  # config key ``backbone`` -> class


class AttentionCore(nn.Module):
    """Scaled dot-product attention of q, k, v, each (B, N, heads, head_dim) -> (B, N, heads *
    head_dim). A slot of its own so that context parallelism can gather the keys and values of
    every rank's tokens first (distributed/layers.py); it has no parameters."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, N, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        b, _, n, _ = out.shape
        return out.transpose(1, 2).reshape(b, n, -1)


class Backbone(nn.Module):
    """Base class of the course's models (see the module docstring). A subclass sets:"""

    STEM: tuple[str, ...] = ()  # its attributes the stem uses (None on the later pipeline stages)
    UNITS: str = ""  # the attribute holding the units, an nn.ModuleDict keyed "0", "1", ...
    TAIL: tuple[str, ...] = ()  # its attributes the tail uses (None on the earlier stages)
    LABELS: tuple[str, str] = ("stem", "tail")  # what the logs call them

    def __init__(self, unit_shape: tuple[int, ...], num_tokens: int = 0) -> None:
        super().__init__()
        self.unit_shape = unit_shape  # one sample's h between units (what pipeline stages send)
        self.num_tokens = num_tokens  # h's size along dimension 1 when it is a sequence, else 0
        self.seq_split = nn.Identity()
        self.seq_gather = nn.Identity()

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> Backbone:
        """The model of the configuration's model group (``Config.model``)."""
        raise NotImplementedError

    # ------------------------------------------------------------ a subclass writes ---
    def stem(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def tail(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def assemble(self, y: torch.Tensor) -> torch.Tensor:
        return y

    def initial_values(self, generator: torch.Generator | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Each parameter's initial value, as a new CPU tensor, always in the same order from
        ``generator``; only shapes are read (a model on the meta device works too)."""
        raise NotImplementedError

    def tp_plan(self) -> dict[str, str]:
        """Module path -> "colwise" | "rowwise" | "context", for the units this model holds."""
        return {}

    @classmethod
    def upgrade_state_dict(cls, state: dict[str, torch.Tensor],
                           cfg: ModelConfig) -> dict[str, torch.Tensor] | None:
        """A checkpoint's model state of an older layout of this model in the current one, or None
        when it is current (training/upgrade.py then converts the optimizer state alike)."""
        return None

    # ------------------------------------------------------------- the base class gives ---
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Every parameter to its initial value (``initial_values``, drawn from ``generator``)."""
        with torch.no_grad():
            for name, value in self.initial_values(generator):
                self.get_parameter(name).copy_(value)

    def units(self) -> nn.ModuleDict:
        return getattr(self, self.UNITS)

    @property
    def holds_stem(self) -> bool:
        return getattr(self, self.STEM[0]) is not None

    @property
    def holds_tail(self) -> bool:
        return getattr(self, self.TAIL[0]) is not None

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """The stem, then this rank's tokens (context parallel)."""
        return self.seq_split(self.stem(x))

    def forward(self, x: torch.Tensor, first_unit: int = 0) -> torch.Tensor:
        # A pipeline stage without the stem receives h, one without the tail returns it.
        # ``first_unit`` > 0: the stem and the units before it ran already (a frozen prefix,
        # training/freezing.py), and x is their output.
        if self.holds_stem and first_unit == 0:
            x = self.embed(x)
        for name, unit in self.units().items():
            if int(name) >= first_unit:
                x = unit(x)
        if not self.holds_tail:  # point-to-point sends need one contiguous buffer
            return x.contiguous()
        return self.assemble(self.seq_gather(self.tail(x)))

    def cut(self, keep: range, stem: bool, tail: bool) -> Backbone:
        """Keep only a pipeline stage's parts (in place); parameter names stay the serial ones."""
        units = self.units()
        for name in list(units):
            if int(name) not in keep:
                del units[name]
        for names, kept in ((self.STEM, stem), (self.TAIL, tail)):
            for name in names if not kept else ():
                setattr(self, name, None)
        return self

    @classmethod
    def part_of(cls, name: str) -> str | int:
        """The part a parameter belongs to, from its serial name: "stem", a unit's index, "tail"."""
        first, _, rest = name.partition(".")
        if first == cls.UNITS:
            return int(rest.split(".")[0])
        if first in cls.STEM:
            return "stem"
        if first in cls.TAIL:
            return "tail"
        raise ValueError(f"parameter {name} is in no part of {cls.__name__} (STEM, UNITS, TAIL)")

    def part_sizes(self) -> dict[str | int, int]:
        """Parameters per part ("stem", 0, 1, ..., "tail") of the parts this model holds."""
        sizes: dict[str | int, int] = {}
        for name, p in self.named_parameters():
            part = self.part_of(name)
            sizes[part] = sizes.get(part, 0) + p.numel()
        return sizes


def layer_values(name: str, m: nn.Module, generator: torch.Generator | None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """The initial values of one module's own parameters, the course's choice for every backbone:
    linear weights truncated normal with std 0.02, convolutions with 1 / sqrt(fan in), biases 0,
    layer norms 1 and 0. ``name``: the module's path (its parameters are yielded under it)."""
    prefix = f"{name}." if name else ""
    normal = lambda shape, std: nn.init.trunc_normal_(torch.empty(shape), std=std, generator=generator)
    if isinstance(m, nn.Linear):
        yield f"{prefix}weight", normal(m.weight.shape, 0.02)
    elif isinstance(m, nn.LayerNorm):
        yield f"{prefix}weight", torch.ones(m.weight.shape)
    elif isinstance(m, nn.Conv2d):
        std = 1.0 / math.sqrt(m.in_channels * math.prod(m.kernel_size))  # 1 / sqrt(fan_in)
        yield f"{prefix}weight", normal(m.weight.shape, std)
    if isinstance(m, (nn.Linear, nn.LayerNorm, nn.Conv2d)) and m.bias is not None:
        yield f"{prefix}bias", torch.zeros(m.bias.shape)  # (a mixture of experts' router has none)


def backbone_class(cfg: ModelConfig) -> type[Backbone]:
    """The class the model group's ``backbone`` key names."""
    name = getattr(cfg, "backbone", "vit")
    if name not in BACKBONES:
        raise ValueError(f"backbone {name!r} is not one of {', '.join(BACKBONES)} (networks/backbone.py)")
    module, _, cls = BACKBONES[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def build(cfg: ModelConfig) -> Backbone:
    """The configured serial model (``cfg``: the configuration's model group, ``Config.model``);
    distributed/parallelize.py makes this rank's part of it."""
    return backbone_class(cfg).from_config(cfg)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def build_on_meta(cfg: ModelConfig) -> tuple[Backbone, int]:
    """The serial model on the meta device (shapes only: no memory, no random numbers drawn) and
    its number of parameters: what every layout builds first, before taking its part of it."""
    cls = backbone_class(cfg)  # imported first: torch 2.8 fails to import its compiler under the mode below
    with torch.device("meta"):
        model = cls.from_config(cfg)
    return model, count_parameters(model)


def replace(model: nn.Module, path: str, new: nn.Module) -> None:
    """Put ``new`` at the module path ``path`` of ``model`` (in place)."""
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)
