"""Vision Transformer that maps the atmosphere at time t to time t + dt.

Shapes: input (B, C_in, H, W) -> patches (B, N, D) with N = (H / p) * (W / p) tokens of
width D = embed_dim -> transformer blocks -> (B, N, C_out * p * p) -> (B, C_out, H, W).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from utils.config import Config


class PatchEmbed(nn.Module):
    """Non-overlapping p x p patches, each projected to embed_dim by one convolution."""

    def __init__(self, in_channels: int, embed_dim: int, patch_size: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_channels, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (B, C, H, W) -> (B, D, H/p, W/p) -> (B, N, D)
        return self.proj(x).flatten(2).transpose(1, 2)


class Attention(nn.Module):
    """Multi-head self-attention with separate q, k, v projections.

    Output features of q, k and v are laid out head-major (head 0's head_dim features,
    then head 1's, ...), so a contiguous slice of them is a whole set of heads: this is
    what lets tensor parallelism give each rank its own heads.
    """

    def __init__(self, dim: int, num_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.dropout = dropout

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape  # (B, N, heads * head_dim) -> (B, heads, N, head_dim)
        return x.view(b, n, -1, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (self._split_heads(f(x)) for f in (self.q, self.k, self.v))
        p = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
        b, _, n, _ = out.shape
        return self.proj(out.transpose(1, 2).reshape(b, n, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.drop(F.gelu(self.fc1(x)))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads, dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, int(dim * mlp_ratio), dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """The serial model. Its parts are named so that they can be replaced, removed or wrapped
    from outside (distributed/parallelize.py): ``blocks`` is a ModuleDict keyed "0", "1", ...
    (a pipeline stage keeps only its own blocks, under their serial names), and the two
    identity slots ``seq_split`` / ``seq_gather`` are where context parallelism splits the
    tokens over ranks and gathers them back.
    """

    def __init__(
        self,
        img_size: tuple[int, int],
        patch_size: int,
        in_channels: int,
        out_channels: int,
        embed_dim: int,
        depth: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        h, w = img_size
        if h % patch_size or w % patch_size:
            raise ValueError(f"img_size {h} x {w} is not divisible by patch_size {patch_size}")
        self.img_size = (h, w)
        self.patch_size = patch_size
        self.out_channels = out_channels
        self.grid = (h // patch_size, w // patch_size)
        self.num_tokens = self.grid[0] * self.grid[1]
        self.patch_embed = PatchEmbed(in_channels, embed_dim, patch_size)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_tokens, embed_dim))
        self.pos_drop = nn.Dropout(dropout)
        self.seq_split = nn.Identity()
        self.blocks = nn.ModuleDict(
            {str(i): Block(embed_dim, num_heads, mlp_ratio, dropout) for i in range(depth)})
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, out_channels * patch_size * patch_size)
        self.seq_gather = nn.Identity()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Conv2d):
                fan_in = m.in_channels * math.prod(m.kernel_size)
                nn.init.trunc_normal_(m.weight, std=1.0 / math.sqrt(fan_in))
                nn.init.zeros_(m.bias)

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        # (B, N, C * p * p) -> (B, C, H, W), token order row-major over the patch grid
        b = x.shape[0]
        gh, gw = self.grid
        p, c = self.patch_size, self.out_channels
        x = x.reshape(b, gh, gw, c, p, p).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(b, c, gh * p, gw * p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pos_drop(self.patch_embed(x) + self.pos_embed)  # (B, N, D), every token
        x = self.seq_split(x)  # context parallel: (B, n, D), this rank's tokens
        for block in self.blocks.values():
            x = block(x)
        x = self.seq_gather(self.head(self.norm(x)))  # every token again: (B, N, C * p * p)
        return self.unpatchify(x)


def build_vit(cfg: Config) -> ViT:
    """The configured serial ViT (distributed/parallelize.py makes this rank's part of it)."""
    return ViT(
        img_size=cfg.img_size,
        patch_size=cfg.patch_size,
        in_channels=cfg.n_in_channels,
        out_channels=cfg.n_out_channels,
        embed_dim=cfg.embed_dim,
        depth=cfg.depth,
        num_heads=cfg.num_heads,
        mlp_ratio=cfg.mlp_ratio,
        dropout=cfg.dropout,
    )


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
