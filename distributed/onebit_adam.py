"""1-bit Adam (Tang et al., ICML 2021; DeepSpeed's ``OneBitAdam``): Adam whose momentum crosses the
network as signs, one bit an element, after a warm-up of plain Adam.

Adam divides its momentum m by the square root of its second moment v, and v settles early in
training. So: T = ``--onebit_warmup_steps`` steps of plain Adam (DDP all-reduces the gradients as
usual), then v is frozen and only the momentum is averaged over the data-parallel ranks, in one
bit an element. Each rank updates its momentum from its own gradient, m_r = b1 m + (1 - b1) g_r,
and the ranks average the m_r in two stages, each compressed with error feedback:

1. each rank compresses x_r = m_r + e_r (e_r: what its compression left out the step before) to
   c_r = s_r sign(x_r), one scale s_r = |x_r| / sqrt(n) for the whole flat momentum, and keeps
   e_r = x_r - c_r. The signs, packed 8 to a byte, go by all-to-all: rank j receives chunk j
   of every rank's signs, and every rank's scale;
2. rank j averages its chunk, y_j = mean_r c_r[j] + E_j (its own error), compresses it again,
   C_j = S_j sign(y_j), E_j = y_j - C_j, and the C_j are all-gathered: every rank now holds the
   same m = [C_0, ..., C_(N-1)];
3. the step is Adam's with that m and the frozen v: p -= lr u, u = (m / bc1) / (sqrt(v) / sqrt(bc2)
   + eps), bc1 = 1 - b1^t, bc2 = 1 - b2^T (the bias corrections; v's stays at the warm-up's last
   step), with two guards of this course's, not in DeepSpeed's: u is clamped to [-1, 1], about
   the bound Adam's own steps keep, and is 0 where sqrt(v / bc2) <= eps, an element the warm-up
   saw no gradient in. A compressed momentum gives every element the magnitude of the scale, so
   where v is tiny u would be huge: the attention's key bias, whose gradient softmax makes zero
   (rounding noise of 1e-15 here), would jump by lr scale / eps at every step.

What a compression leaves out is added back the next step, so nothing is lost, only delayed
(error feedback, as PowerSGD's in distributed/compression.py). A rank hands the collectives
n/8 + n/(8N) bytes of signs and 2 scales a step, against Adam's 4n of fp32 gradients: about 21x
fewer bytes at N = 2. The error buffers are per rank: the checkpoint holds every rank's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack(signs: torch.Tensor) -> torch.Tensor:
    """Booleans (a multiple of 8) to bytes, 8 to a byte: what 1 bit an element means."""
    return (signs.view(-1, 8).to(torch.uint8) * BITS.to(signs.device)).sum(1, dtype=torch.uint8)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    return (packed.unsqueeze(1) & BITS.to(packed.device)).ne(0).view(-1)


def world(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def compress(x: torch.Tensor, valid: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x's first ``valid`` elements as a scale times their signs (the rest, padding, as 0): the
    signs, the scale, and what the compression left out (x - scale sign(x))."""
    scale = x[:valid].norm() / math.sqrt(valid) if valid else x.new_zeros(())
    signs = x >= 0
    kept = torch.where(signs, scale, -scale)
    kept[valid:] = 0
    return signs, scale, x - kept


def compressed_average(m: torch.Tensor, errors: dict[str, torch.Tensor],
                       group: dist.ProcessGroup | None) -> tuple[torch.Tensor, int]:
    """The ranks' flat momenta ``m`` averaged in one bit an element (the two stages above), and
    the bytes this rank handed the collectives. ``errors`` holds this rank's two error buffers."""
    ranks, n = world(group), m.numel()
    chunk = math.ceil(n / (8 * ranks)) * 8  # whole bytes in every rank's chunk
    me = dist.get_rank(group) if ranks > 1 else 0
    if not errors:
        errors.update(worker=m.new_zeros(chunk * ranks), server=m.new_zeros(chunk))
    x = torch.nn.functional.pad(m, (0, chunk * ranks - n)) + errors["worker"]
    signs, scale, errors["worker"] = compress(x, n)
    packed, scales = pack(signs), [scale.new_zeros(1) for _ in range(ranks)]
    mine = torch.empty_like(packed)  # rank r's signs of my chunk, r = 0 .. N - 1
    if ranks > 1:
        dist.all_to_all_single(mine, packed, group=group)
        dist.all_gather(scales, scale.reshape(1), group=group)
    else:
        mine, scales = packed, [scale.reshape(1)]
    valid = max(0, min(chunk, n - me * chunk))  # the last chunks end in padding
    received = torch.where(unpack(mine).view(ranks, chunk), 1.0, -1.0) * torch.cat(scales).unsqueeze(1)
    y = received.mean(0) + errors["server"]
    y[valid:] = 0
    server_signs, server_scale, errors["server"] = compress(y, valid)
    packed2, scales2 = pack(server_signs), [server_scale.new_zeros(1) for _ in range(ranks)]
    gathered = [torch.empty_like(packed2) for _ in range(ranks)]
    if ranks > 1:
        dist.all_gather(gathered, packed2, group=group)
        dist.all_gather(scales2, server_scale.reshape(1), group=group)
    else:
        gathered, scales2 = [packed2], [server_scale.reshape(1)]
    signs_all = unpack(torch.cat(gathered)).view(ranks, chunk)
    average = (torch.where(signs_all, 1.0, -1.0) * torch.cat(scales2).unsqueeze(1)).view(-1)[:n]
    sent = packed.numel() + packed2.numel() + 2 * scale.element_size()
    return average, sent


def bounded_step(m: torch.Tensor, v: torch.Tensor, bc1: float, bc2: float, eps: float) -> torch.Tensor:
    """u of step 3: Adam's step direction, clamped to [-1, 1], 0 where the warm-up saw no gradient."""
    root = v.sqrt() / math.sqrt(bc2)
    return ((m / bc1) / (root + eps)).clamp_(-1.0, 1.0).mul_(root > eps)


@dataclass
class OneBitHookState:
    """What the DDP hook reads (the optimizer: warm-up or not) and the bytes counted for the run's
    ``grad_comm_bytes_per_step`` (the hook's all-reduces, the optimizer's compressed average)."""

    optimizer: OneBitAdam
    group: dist.ProcessGroup | None
    bytes_sent: int = 0


# no annotations: DDP checks a hook's annotations (see distributed/compression.py)
def onebit_hook(state, bucket):
    """DDP's all-reduce during the warm-up; afterwards the bucket's local gradients, unsent (the
    optimizer averages the momentum instead)."""
    if state.optimizer.compressing():
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done
    state.bytes_sent += bucket.buffer().numel() * bucket.buffer().element_size()
    return default_hooks.allreduce_hook(state.group, bucket)


class OneBitAdam(torch.optim.Adam):
    """torch's Adam for ``warmup_steps`` steps, then 1-bit Adam over ``group`` (one parameter
    group; its ``lr`` follows the schedule as Adam's does)."""

    averages_momentum = True  # distributed/sharding.py: built over the dp group, with DDP's hook

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float, betas: tuple[float, float],
                 warmup_steps: int, group: dist.ProcessGroup | None = None, **kernel: Any) -> None:
        super().__init__(params, lr=lr, betas=betas, **kernel)
        if len(self.param_groups) != 1:
            raise ValueError("OneBitAdam steps one parameter group")
        self.warmup_steps, self.group = warmup_steps, group
        self.errors: dict[str, torch.Tensor] = {}  # this rank's "worker" and "server" error buffers
        self.counter: OneBitHookState | None = None  # where the compressed bytes are counted

    @property
    def steps_done(self) -> int:
        state = self.state.get(self.param_groups[0]["params"][0])
        return int(state["step"]) if state else 0

    def compressing(self) -> bool:
        return self.steps_done >= self.warmup_steps

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if not self.compressing():
            return super().step(closure)
        group = self.param_groups[0]
        params, (b1, b2) = group["params"], group["betas"]
        for p in params:  # this rank's momentum, from its own gradient
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            self.state[p]["exp_avg"].mul_(b1).add_(grad, alpha=1 - b1)
        flat = torch.cat([self.state[p]["exp_avg"].reshape(-1) for p in params])
        average, sent = compressed_average(flat, self.errors, self.group)
        if self.counter is not None:
            self.counter.bytes_sent += sent
        offset = 0
        for p in params:
            state = self.state[p]
            state["exp_avg"].copy_(average[offset: offset + p.numel()].view_as(p))
            offset += p.numel()
            state["step"] += 1
            bc1, bc2 = 1 - b1 ** int(state["step"]), 1 - b2 ** self.warmup_steps
            step = bounded_step(state["exp_avg"], state["exp_avg_sq"], bc1, bc2, group["eps"])
            p.add_(step, alpha=-group["lr"])
        return None

    def state_dict(self) -> dict[str, Any]:
        """Adam's state, and every rank's error buffers (collective over ``group``: each rank's
        own are not the others')."""
        state = super().state_dict()
        ranks = world(self.group)
        errors = {}
        for name, mine in sorted(self.errors.items()):
            every = [torch.empty_like(mine) for _ in range(ranks)]
            if ranks > 1:
                dist.all_gather(every, mine.contiguous(), group=self.group)
            else:
                every = [mine.clone()]
            errors[name] = every
        state["onebit_errors"] = errors
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        errors = state_dict.pop("onebit_errors", {})
        ranks = world(self.group)
        me = dist.get_rank(self.group) if ranks > 1 else 0
        if errors and len(next(iter(errors.values()))) != ranks:
            raise ValueError(f"this checkpoint's 1-bit Adam errors are of {len(next(iter(errors.values())))} "
                             f"ranks; resume it on as many")
        self.errors = {name: every[me].clone() for name, every in errors.items()}
        super().load_state_dict(state_dict)


def register(model: torch.nn.Module, optimizer: OneBitAdam, group: dist.ProcessGroup | None) -> None:
    """The hook on DDP ``model`` (kept as ``model.comm_state``, read by distributed/tags.py)."""
    state = OneBitHookState(optimizer, group)
    model.register_comm_hook(state, onebit_hook)
    model.comm_state = optimizer.counter = state
