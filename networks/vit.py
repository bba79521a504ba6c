"""Vision Transformer that maps the atmosphere at time t to time t + dt.

Shapes: input (B, C_in, H, W) -> patches (B, N, D) with N = (H / p) * (W / p) tokens of
width D = embed_dim -> transformer blocks -> (B, N, C_out * p * p) -> (B, C_out, H, W).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from networks.backbone import AttentionCore, Backbone, layer_values
from utils.config_groups import ModelConfig


class PatchEmbed(nn.Module):
    """Non-overlapping p x p patches, each projected to embed_dim by one convolution."""

    def __init__(self, in_channels: int, embed_dim: int, patch_size: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_channels, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (B, C, H, W) -> (B, D, H/p, W/p) -> (B, N, D)
        return self.proj(x).flatten(2).transpose(1, 2)


def blocks_to_head_major(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows [q; k; v] (each num_heads x head_dim) -> head-major rows [h0: q k v, h1: q k v, ...].

    Works for the weight (3D, D), the bias (3D,) and anything shaped like them (Adam's moments).
    """
    rest = t.shape[1:]
    return t.reshape(3, num_heads, -1, *rest).transpose(0, 1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, N, heads * 3 * head_dim), head-major -> q, k, v, each (B, N, heads, head_dim) (views)."""
    b, n, _ = qkv.shape
    return qkv.view(b, n, -1, 3, head_dim).unbind(3)


class Attention(nn.Module):
    """Multi-head self-attention with one q/k/v projection (a single matmul).

    The projection's 3 x dim output features are laid out head-major: head 0's q, k and v
    (head_dim each), then head 1's, and so on. A contiguous slice of them is therefore a
    whole set of heads with their queries, keys and values, which is what lets tensor
    parallelism give each rank its own heads by splitting the rows. (A [q; k; v] layout
    split the same way would give a rank the queries of some heads and the keys of others,
    a known bug of fused-projection ViTs.)
    """

    def __init__(self, dim: int, num_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.core = AttentionCore(dropout)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (B, N, D) -> q, k, v (B, N, heads, head_dim) -> attention (B, N, D) -> (B, N, D). The
        # heads are counted from the shape: with tensor parallelism qkv gives this rank's heads.
        return self.proj(self.core(*split_qkv(self.qkv(x), self.head_dim)))


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

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, dropout: float,
                 experts: dict | None = None) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads, dropout)
        self.norm2 = nn.LayerNorm(dim)
        if experts:  # a mixture of experts in place of the MLP (networks/moe.py)
            from networks.moe import MoEMLP

            self.mlp = MoEMLP(dim, int(dim * mlp_ratio), dropout=dropout, expert=MLP, **experts)
        else:
            self.mlp = MLP(dim, int(dim * mlp_ratio), dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(Backbone):
    """The serial model, a :class:`~networks.backbone.Backbone`: the stem is the patch and position
    embedding, the units are the transformer blocks (``blocks``, a ModuleDict keyed "0", "1", ...:
    a pipeline stage keeps only its own, under their serial names), the tail the final norm and
    head, ``assemble`` puts the patches back on the grid.
    """

    STEM = ("patch_embed", "pos_embed")
    UNITS = "blocks"
    TAIL = ("norm", "head")
    LABELS = ("embedding", "head")

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
        num_experts: int = 0,
        moe_top_k: int = 1,
        moe_every: int = 2,
        moe_capacity_factor: float = 0.0,
    ) -> None:
        h, w = img_size
        if h % patch_size or w % patch_size:
            raise ValueError(f"img_size {h} x {w} is not divisible by patch_size {patch_size}")
        grid = (h // patch_size, w // patch_size)
        super().__init__(unit_shape=(grid[0] * grid[1], embed_dim), num_tokens=grid[0] * grid[1])
        self.img_size = (h, w)
        self.patch_size = patch_size
        self.out_channels = out_channels
        self.grid = grid
        self.patch_embed = PatchEmbed(in_channels, embed_dim, patch_size)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_tokens, embed_dim))
        self.pos_drop = nn.Dropout(dropout)
        # with num_experts > 0, every moe_every-th block (the last of each group of moe_every)
        # has a mixture of experts instead of its MLP
        experts = {"num_experts": num_experts, "top_k": moe_top_k, "capacity_factor": moe_capacity_factor}
        self.blocks = nn.ModuleDict(
            {str(i): Block(embed_dim, num_heads, mlp_ratio, dropout,
                           experts if num_experts and (i + 1) % moe_every == 0 else None)
             for i in range(depth)})
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, out_channels * patch_size * patch_size)
        self.reset_parameters()

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> ViT:
        return cls(img_size=cfg.img_size, patch_size=cfg.patch_size, in_channels=cfg.n_in_channels,
                   out_channels=cfg.n_out_channels, embed_dim=cfg.embed_dim, depth=cfg.depth,
                   num_heads=cfg.num_heads, mlp_ratio=cfg.mlp_ratio, dropout=cfg.dropout,
                   num_experts=cfg.num_experts, moe_top_k=cfg.moe_top_k, moe_every=cfg.moe_every,
                   moe_capacity_factor=cfg.moe_capacity_factor)

    def tp_plan(self) -> dict[str, str]:
        """Megatron-LM's split of a block: q/k/v and fc1 by output features, proj and fc2 by input
        features; a mixture of experts stays whole on every tp rank (replicated)."""
        plan = {}
        for name, block in self.blocks.items():
            b = f"blocks.{name}."
            plan.update({b + "attn.qkv": "colwise", b + "attn.core": "context", b + "attn.proj": "rowwise"})
            if isinstance(block.mlp, MLP):
                plan.update({b + "mlp.fc1": "colwise", b + "mlp.fc2": "rowwise"})
        return plan

    @classmethod
    def upgrade_state_dict(cls, state: dict[str, torch.Tensor],
                           cfg: ModelConfig) -> dict[str, torch.Tensor] | None:
        """Older checkpoints had separate q, k and v projections: fused, head-major."""
        if not any(name.endswith(".attn.q.weight") for name in state):
            return None
        return upgrade_state_dict(state, cfg.num_heads)

    def initial_values(self, generator: torch.Generator | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Each parameter's initial value, one at a time, as a new CPU tensor, always drawn in the
        same order from ``generator`` (default: torch's global one).

        Only the shapes are read, so this also works for a model built on the meta device
        (no memory): distributed/parallelize.py builds the serial model there, shards it, and
        fills each rank's shards from these values, one whole parameter at a time."""
        yield "pos_embed", nn.init.trunc_normal_(torch.empty(self.pos_embed.shape), std=0.02,
                                                  generator=generator)
        for mod_name, m in self.named_modules():
            for name, value in layer_values(mod_name, m, generator):
                if mod_name.endswith("attn.qkv") and name.endswith("weight"):
                    # q/k/v weights are drawn as [q; k; v] blocks, as the three separate projections
                    # of the tutorial's original model were (so the same seed gives the same
                    # model), and stored head-major
                    heads = self.get_submodule(mod_name.removesuffix(".qkv")).num_heads
                    value = blocks_to_head_major(value, heads)
                yield name, value

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        return unpatchify(x, self.grid, self.patch_size, self.out_channels)

    def stem(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, N, D)."""
        # The patch embedding's transpose leaves the tokens strided as (B, D, N); they are copied
        # into (B, N, D) order here because torch.compile'd blocks under bf16 autocast gave NaN for
        # that strided input on some Intel AMX CPUs (torch 2.13 and 2.15;
        # scripts/compile_bf16_check.py shows it on a CPU)
        return self.pos_drop((self.patch_embed(x) + self.pos_embed).contiguous())

    def tail(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(h))  # (B, n, D) -> (B, n, C * p * p)

    def assemble(self, y: torch.Tensor) -> torch.Tensor:
        return self.unpatchify(y)  # every token again: (B, N, C * p * p) -> (B, C, H, W)


def unpatchify(x: torch.Tensor, grid: tuple[int, int], patch: int, channels: int) -> torch.Tensor:
    """(B, N, C * p * p) -> (B, C, H, W), token order row-major over the patch grid."""
    b, (gh, gw) = x.shape[0], grid
    x = x.reshape(b, gh, gw, channels, patch, patch).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, channels, gh * patch, gw * patch)


def build_vit(cfg: ModelConfig) -> ViT:
    """The configured serial ViT (``cfg``: the configuration's model group, ``Config.model``)."""
    return ViT.from_config(cfg)


def upgrade_state_dict(state: dict[str, torch.Tensor], num_heads: int) -> dict[str, torch.Tensor]:
    """A state dict (or any per-parameter tensors) of the older layout with separate q, k and v
    projections -> the fused head-major ``qkv``; other entries keep their order."""
    out = {}
    for name, t in state.items():
        prefix, _, leaf = name.rpartition(".")  # "blocks.0.attn.q", "weight"
        owner, _, proj = prefix.rpartition(".")
        if proj not in ("q", "k", "v") or not owner.endswith("attn"):
            out[name] = t
        elif proj == "q":
            parts = [state[f"{owner}.{p}.{leaf}"] for p in ("q", "k", "v")]
            out[f"{owner}.qkv.{leaf}"] = blocks_to_head_major(torch.cat(parts), num_heads)
    return out
