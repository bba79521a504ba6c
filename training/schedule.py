"""The optimizer a configuration names (`optimizer_choice`) and the learning-rate schedules: each
step's rate as a multiple of ``lr``, a pure function of the step (so a resumed run continues its
schedule exactly). The Trainer hands it to torch's LambdaLR."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from utils.config_groups import OptimizerConfig


def make_lr_lambda(cfg: OptimizerConfig) -> Callable[[int], float]:
    """The learning rate of each step as a multiple of ``lr``: linear warmup over ``warmup`` steps,
    then cosine decay to 0 at ``num_iters`` (or constant); or one cycle (Smith's one-cycle policy,
    with cosine ramps as torch's OneCycleLR): up from lr / div over the first pct_start of the
    steps, then down to lr / div / final_div at ``num_iters``. A pure function of the step, so a
    resumed run continues the schedule exactly. ``cfg``: the configuration's optimizer group."""
    if cfg.lr_schedule == "onecycle":
        return onecycle_factor(cfg.num_iters, cfg.onecycle_pct_start, cfg.onecycle_div_factor,
                               cfg.onecycle_final_div_factor)

    def factor(step: int) -> float:
        if cfg.warmup and step < cfg.warmup:
            return (step + 1) / cfg.warmup
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = (step - cfg.warmup) / max(1, cfg.num_iters - cfg.warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def onecycle_factor(total: int, pct_start: float, div: float, final_div: float) -> Callable[[int], float]:
    first = 1.0 / div
    last = first / final_div
    rise = max(1, round(pct_start * total))

    def ramp(start: float, end: float, progress: float) -> float:  # cosine from start to end
        return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    def factor(step: int) -> float:
        if step < rise:
            return ramp(first, 1.0, step / rise)
        return ramp(1.0, last, (step - rise) / max(1, total - rise))

    return factor


def optimizer_choice(cfg: OptimizerConfig,
                     kernel: dict[str, bool]) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The optimizer class ``optimizer_type`` names and its settings. ``kernel``: Adam's, AdamW's
    and SGD's implementation (fused or foreach, utils/device.py:adam_kernel). ``cfg``: the
    configuration's optimizer group."""
    name, adam = cfg.optimizer_type, {"lr": cfg.lr, "betas": cfg.adam_betas}
    if name == "LAMB":  # the project's own (distributed/lamb.py): its norms may span the ranks' parts
        from distributed.lamb import Lamb

        return Lamb, {**adam, "weight_decay": cfg.weight_decay}
    if name == "OneBitAdam":  # the project's own (distributed/onebit_adam.py), over the dp ranks
        from distributed.onebit_adam import OneBitAdam

        return OneBitAdam, {**adam, "warmup_steps": cfg.onebit_warmup_steps, **kernel}
    if name == "SGD":
        return torch.optim.SGD, {"lr": cfg.lr, "momentum": cfg.momentum,
                                 "weight_decay": cfg.weight_decay, **kernel}
    weight_decay = {"weight_decay": cfg.weight_decay} if name == "AdamW" else {}
    return (torch.optim.AdamW if name == "AdamW" else torch.optim.Adam), {**adam, **weight_decay, **kernel}
