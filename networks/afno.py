"""AFNO, FourCastNet's backbone: tokens mixed by a filter in Fourier space instead of attention.

FourCastNet (Pathak et al., 2022, arXiv:2202.11214) trained this on ERA5, the data this course
uses; the Adaptive Fourier Neural Operator is Guibas et al.'s (2021, arXiv:2111.13587). The
same patches as the ViT (networks/vit.py), then in each block:

    x (B, N, D) on the patch grid (gh, gw) -> 2-D FFT over the grid: (B, gh, gw // 2 + 1, D),
    complex -> per frequency, a two-layer MLP on the channels, block-diagonal: the D channels in
    k groups (``num_heads``, as heads split attention) of D / k, each with its own complex
    weights -> soft-shrink (small modes to 0: a sparse filter) -> inverse FFT -> (B, N, D)

Mixing every token costs O(N log N), not attention's O(N^2), and a token's output depends on
the whole grid at once: there are no tokens to split over ranks, so context and sequence
parallelism are refused. Tensor parallelism splits each block's channel MLP, as the ViT's.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from networks.backbone import Backbone, layer_values
from networks.vit import MLP, PatchEmbed, unpatchify
from utils.config_groups import ModelConfig

SPARSITY = 0.01  # soft-shrink threshold of the filter's output modes (FourCastNet's)


def _mix(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # (..., k, d) x (k, d, e) -> (..., k, e): each channel group by its own matrix
    return torch.einsum("...kd,kde->...ke", t, w)


class SpectralFilter(nn.Module):
    """The token mixer: (B, N, D) -> (B, N, D) through Fourier space (module docstring)."""

    def __init__(self, dim: int, groups: int, grid: tuple[int, int]) -> None:
        super().__init__()
        if dim % groups:
            raise ValueError(f"embed_dim {dim} is not divisible by num_heads {groups} (AFNO's channel "
                             f"groups)")
        self.grid, self.groups = grid, groups
        d = dim // groups
        # complex weights and biases as (real, imaginary) pairs: dimension 0
        self.w1 = nn.Parameter(torch.empty(2, groups, d, d))
        self.bias1 = nn.Parameter(torch.empty(2, groups, d))
        self.w2 = nn.Parameter(torch.empty(2, groups, d, d))
        self.bias2 = nn.Parameter(torch.empty(2, groups, d))

    # Eager inside a compiled block: inductor generates no code for complex tensors (it falls back
    # and warns), and torch 2.8's compiled backward of the FFT failed on a layout it chose itself
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, dim = x.shape
        gh, gw = self.grid
        # FFTs in fp32 (CPU FFTs take no bf16), whatever autocast or FSDP's bf16 policy chose
        with torch.autocast(x.device.type, enabled=False):
            w1, w2, b1, b2 = (p.float() for p in (self.w1, self.w2, self.bias1, self.bias2))
            f = torch.fft.rfft2(x.float().reshape(b, gh, gw, dim), dim=(1, 2), norm="ortho")
            f = f.reshape(b, gh, gw // 2 + 1, self.groups, -1)
            re, im = f.real, f.imag  # (a + ib)(c + id) = (ac - bd) + i(ad + bc)
            r1 = F.relu(_mix(re, w1[0]) - _mix(im, w1[1]) + b1[0])
            i1 = F.relu(_mix(im, w1[0]) + _mix(re, w1[1]) + b1[1])
            r2 = _mix(r1, w2[0]) - _mix(i1, w2[1]) + b2[0]
            i2 = _mix(i1, w2[0]) + _mix(r1, w2[1]) + b2[1]
            f = torch.complex(F.softshrink(r2, SPARSITY), F.softshrink(i2, SPARSITY))
            y = torch.fft.irfft2(f.reshape(b, gh, gw // 2 + 1, dim), s=(gh, gw), dim=(1, 2), norm="ortho")
        return y.reshape(b, n, dim).to(x.dtype)


class AFNOBlock(nn.Module):
    """Pre-norm, as the ViT's block: x + filter(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim: int, groups: int, grid: tuple[int, int], mlp_ratio: float,
                 dropout: float) -> None:
        super().__init__()
        self.norm1, self.filter = nn.LayerNorm(dim), SpectralFilter(dim, groups, grid)
        self.norm2, self.mlp = nn.LayerNorm(dim), MLP(dim, int(dim * mlp_ratio), dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.filter(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class AFNO(Backbone):
    """Stem: patches and their position embedding; units: the AFNO blocks (``layers``); tail:
    the final norm and the linear map of every token back to its pixels."""

    STEM = ("patches", "position")
    UNITS = "layers"
    TAIL = ("norm", "out")
    LABELS = ("embedding", "head")

    def __init__(self, cfg: ModelConfig) -> None:
        (h, w), p, dim = cfg.img_size, cfg.patch_size, cfg.embed_dim
        if cfg.num_experts:
            raise ValueError("the afno backbone has no mixture of experts: set num_experts to 0")
        self.grid = (h // p, w // p)
        super().__init__(unit_shape=(self.grid[0] * self.grid[1], dim))  # no num_tokens: no cp, no sp
        self.patch_size, self.out_channels = p, cfg.n_out_channels
        self.patches = PatchEmbed(cfg.n_in_channels, dim, p)
        self.position = nn.Parameter(torch.zeros(1, self.grid[0] * self.grid[1], dim))
        block = lambda: AFNOBlock(dim, cfg.num_heads, self.grid, cfg.mlp_ratio, cfg.dropout)
        self.layers = nn.ModuleDict({str(i): block() for i in range(cfg.depth)})
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, cfg.n_out_channels * p * p)
        self.reset_parameters()

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> AFNO:
        return cls(cfg)

    def initial_values(self, generator: torch.Generator | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in self.named_parameters(recurse=True):
            if name == "position" or name.endswith((".w1", ".w2")):  # spectral weights: std 0.02
                yield name, nn.init.trunc_normal_(torch.empty(p.shape), std=0.02, generator=generator)
            elif name.endswith((".bias1", ".bias2")):
                yield name, torch.zeros(p.shape)
        for name, m in self.named_modules():
            yield from layer_values(name, m, generator)

    def tp_plan(self) -> dict[str, str]:
        """Each block's channel MLP as the ViT's (fc1 by output features, fc2 by input features);
        the filter is replicated on every tp rank."""
        return {f"layers.{i}.mlp.{fc}": style for i in self.layers for fc, style in
                (("fc1", "colwise"), ("fc2", "rowwise"))}

    def stem(self, x: torch.Tensor) -> torch.Tensor:
        return (self.patches(x) + self.position).contiguous()  # (B, N, D), as the ViT's (see there)

    def tail(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(h))

    def assemble(self, y: torch.Tensor) -> torch.Tensor:
        return unpatchify(y, self.grid, self.patch_size, self.out_channels)
