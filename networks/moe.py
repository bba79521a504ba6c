"""A mixture-of-experts MLP: a router sends each token to its top-k of E expert MLPs.

Shapes: x (B, N, D) -> router logits (B, N, E) -> softmax probabilities -> each token's k
largest, its experts and gates (B, N, k) -> every expert runs on the tokens sent to it
(T_e, D) -> (T_e, D) -> the outputs, weighted by their gates, added back at their tokens.

- **top-k**: k = 1 is the Switch Transformer's choice (the gate is the chosen expert's
  probability); k = 2 is GShard's (the two probabilities, normalised to sum to 1).
- **capacity**: with ``capacity_factor`` C > 0 an expert takes at most
  ceil(C x N x k / E) tokens of each sample; the rest of its tokens are dropped (that
  expert adds nothing to them; the residual connection still carries them). First choices
  are served before second choices, then in token order (GShard). C = 0 drops nothing.
- **load balancing**: an auxiliary loss E x sum_e f_e x P_e, where f_e is the fraction of
  the tokens whose first choice is expert e and P_e the mean router probability of e. It is
  smallest (1) when both are uniform, and its gradient (through P) pushes the router to
  spread the tokens.

Both the capacity and the balancing statistics are computed **per sample** (over each
image's N tokens), then the auxiliary loss is averaged over the samples as the main loss
is. Switch and GShard compute them over all the tokens of a device's batch, which depends on
how the batch is split; per sample, every layout that splits the batch (data parallelism,
gradient accumulation) computes exactly what the serial model computes.

This is the serial model: it holds every expert. It stays free of parallelism.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class MoEMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int = 1, capacity_factor: float = 0.0,
                 dropout: float = 0.0, expert: type[nn.Module] | None = None) -> None:
        """``expert``: each expert's class, called as ``expert(dim, hidden, dropout)`` (the ViT's
        dense MLP, networks/vit.py, which hands it over)."""
        super().__init__()
        if expert is None:
            raise TypeError("MoEMLP needs the experts' class (expert=MLP of networks/vit.py)")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"moe_top_k must be between 1 and num_experts ({num_experts}), got {top_k}")
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): expert(dim, hidden, dropout) for e in range(num_experts)})
        # what the last forward measured (set by forward): the auxiliary loss (a graph tensor),
        # and for the logs, detached: each expert's fraction of the token assignments it
        # processed, and the fraction of assignments dropped by the capacity
        self.aux_loss = torch.zeros(())
        self.stats = torch.zeros(num_experts + 1)

    def capacity(self, tokens: int) -> int:
        """Assignments each expert takes from one sample of ``tokens`` tokens."""
        if self.capacity_factor <= 0:
            return tokens * self.top_k  # dropless: everything fits
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(experts (B, N, k), gates (B, N, k), kept (B, N, k)) of every token; sets aux_loss."""
        b, n, _ = x.shape
        probs = self.router(x).float().softmax(dim=-1)  # (B, N, E), in fp32 under autocast too
        gates, experts = probs.topk(self.top_k, dim=-1)  # (B, N, k)
        if self.top_k > 1:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        # balancing, per sample: f from the first choices, P from the probabilities
        first = F.one_hot(experts[..., 0], self.num_experts).float()  # (B, N, E)
        f, p = first.mean(dim=1), probs.mean(dim=1)  # (B, E) each
        self.aux_loss = (self.num_experts * (f * p).sum(dim=-1)).mean()
        # capacity: each assignment's place in its expert's queue within its sample, first
        # choices before second ones, then in token order
        chosen = F.one_hot(experts.transpose(1, 2), self.num_experts)  # (B, k, N, E)
        place = (chosen.flatten(1, 2).cumsum(dim=1) - 1).view(b, self.top_k, n, -1)
        place = (place * chosen).sum(dim=-1).transpose(1, 2)  # (B, N, k)
        kept = place < self.capacity(n)
        return experts, gates, kept

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, gates, kept = self.route(x)
        flat = x.reshape(-1, x.shape[-1])  # (B * N, D)
        out = torch.zeros_like(flat)
        counts = []
        for e, expert in self.experts.items():
            # the (token, choice) pairs sent to expert e and kept; every expert runs, on no
            # tokens if need be, so that every parameter has a gradient (DDP expects them all)
            token, choice = ((experts == int(e)) & kept).reshape(-1, self.top_k).nonzero(as_tuple=True)
            y = expert(flat[token])  # (T_e, D)
            weight = gates.reshape(-1, self.top_k)[token, choice].unsqueeze(-1).to(y.dtype)
            out = out.index_add(0, token, (y * weight).to(out.dtype))
            counts.append(token.numel())
        self.stats = assignment_shares(counts, experts.numel())
        return out.view_as(x)


def assignment_shares(counts: list[int], assignments: int) -> torch.Tensor:
    """For the logs (on the host): each expert's share of the ``assignments`` token choices it
    processed (``counts`` per expert, already on the host), then the share dropped by the capacity."""
    share = torch.tensor(counts, dtype=torch.float32) / assignments
    return torch.cat([share, (1 - share.sum()).reshape(1)])
