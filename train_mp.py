#!/usr/bin/env python
"""Train the ERA5 ViT with tensor and context parallelism inside a model group, data parallel across.

    torchrun --standalone --nproc_per_node 4 train_mp.py --config tiny --tensor_parallel 2   # tp 2 x dp 2
    sbatch --nodes 4 submit_pm_mp.sh --config=mp --tensor_parallel=4

What differs from train.py, and nothing else: the ranks are arranged in tensor (tp),
context (cp) and data (dp) parallel groups (utils/comm.py); the model is built with
distributed layers for its tp x cp group; data is sharded over dp only, so every rank of
a model group sees the same batch; gradients are synchronised as each parameter's tag
says (distributed/helpers.py); checkpoints hold the consolidated weights and optimizer
state, so a run can continue with another layout (or in train.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distributed.helpers import full_state, gather_full, load_full_state, spec, take_shard, wrap_for_training
from networks.vit import build_vit
from utils import device as dev
from utils.comm import check_model, init_comm
from utils.config import Config
from utils.launch import arg_parser, main
from utils.trainer import RunContext, Trainer

log = logging.getLogger("train_mp")

MP_FLAGS = ("tensor_parallel", "context_parallel", "parallel_order")
MIB = 2**20


def build_parser() -> argparse.ArgumentParser:
    p = arg_parser(__doc__.split("\n\n")[0])
    g = p.add_argument_group("model parallel")
    g.add_argument("--tensor_parallel", "--row_parallel_size", dest="tensor_parallel", type=int,
                   help="ranks that split each layer (heads, MLP features); --row_parallel_size is "
                        "the SC23 name")
    g.add_argument("--context_parallel", type=int, help="ranks that split the sequence of tokens")
    g.add_argument("--parallel_order", help="rank layout, fastest-varying first (default tp-cp-dp)")
    return p


def mp_run_dir(cfg: Config, config_name: str, run_num: str, tp: int, cp: int, dp: int) -> Path:
    """Every parallel size is in the path, so runs at different layouts never share a directory."""
    return cfg.exp_path / config_name / f"{tp * cp * dp}GPU_tp{tp}_cp{cp}_dp{dp}" / str(run_num)


def setup(args: argparse.Namespace, cfg: Config, ctx: RunContext) -> RunContext:
    """Create the communicator groups; data parallelism is whatever tp x cp leaves."""
    tp, cp = cfg.tensor_parallel, cfg.context_parallel
    if cfg.amp_mode == "fp16" and tp > 1:  # each rank's GradScaler decides alone to skip a step
        raise ValueError("amp_mode fp16 does not work with tensor_parallel > 1 (the ranks' loss "
                         "scalers would skip different steps); use --amp_mode bf16")
    gh, gw = cfg.img_size[0] // cfg.patch_size, cfg.img_size[1] // cfg.patch_size
    check_model(tp, cp, cfg.embed_dim, cfg.num_heads, int(cfg.embed_dim * cfg.mlp_ratio), gh * gw)
    comm = init_comm(tp, cp, cfg.parallel_order)
    run_dir = mp_run_dir(cfg, args.config, args.run_num, tp, cp, comm.dp_size)
    return dataclasses.replace(ctx, run_dir=run_dir, dp_size=comm.dp_size, dp_rank=comm.dp_rank,
                               dp_group=comm.dp_group, comm=comm)


class ModelParallelTrainer(Trainer):
    @property
    def comm(self):
        return self.ctx.comm

    @property
    def raw_model(self) -> nn.Module:
        return self.model.module if isinstance(self.model, DistributedDataParallel) else self.model

    def build_model(self) -> nn.Module:
        model = build_vit(self.cfg, self.comm)
        mine = sum(p.numel() for p in model.parameters())
        whole = sum(p.numel() * (self.comm.tp_size if spec(p).shard_dim is not None else 1)
                    for p in model.parameters())
        log.info("%s; this rank holds %d of the model's %d parameters", self.comm.describe(), mine, whole)
        return model

    def wrap_model(self, model: nn.Module) -> nn.Module:
        if not self.comm.model_parallel:
            return super().wrap_model(model)
        return wrap_for_training(model, self.comm, self.device, self.ctx.use_ddp, self.ctx.ddp_options)

    # checkpoints: consolidated tensors, keyed and shaped as in the serial model
    def model_state(self) -> dict[str, torch.Tensor]:
        return full_state(self.raw_model, self.comm)

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        load_full_state(self.raw_model, state, self.comm)

    def _optimizer_params(self) -> list[nn.Parameter]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def optimizer_state(self) -> dict[str, Any]:
        state = self.optimizer.state_dict()
        params = self._optimizer_params()
        state["state"] = {i: {k: gather_full(v, spec(params[i]), self.comm) if _per_element(v) else v
                              for k, v in s.items()} for i, s in state["state"].items()}
        return state

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        params = self._optimizer_params()
        state = dict(state)
        state["state"] = {i: {k: take_shard(v, spec(params[i]), self.comm) if _per_element(v) else v
                              for k, v in s.items()} for i, s in state["state"].items()}
        self.optimizer.load_state_dict(state)

    # memory: what a rank holds, on every device; the allocator's peak on CUDA
    def memory_report(self) -> dict[str, float]:
        params = list(self.raw_model.parameters())
        report = {
            "parameters_MiB": sum(p.numel() * p.element_size() for p in params) / MIB,
            "gradients_MiB": sum(p.numel() * p.element_size() for p in params if p.requires_grad) / MIB,
            "optimizer_MiB": sum(v.numel() * v.element_size() for s in self.optimizer.state.values()
                                 for v in s.values() if torch.is_tensor(v)) / MIB,
        }
        peak = dev.peak_memory_bytes(self.device)
        if peak is not None:
            report["allocator_peak_MiB"] = peak / MIB
        return report

    def log_epoch(self, epoch: int, seconds: float, steps: int, train_loss: float,
                  val: dict[str, Any], val_seconds: float) -> None:
        super().log_epoch(epoch, seconds, steps, train_loss, val, val_seconds)
        mem = self.memory_report()
        log.info("  Memory per rank (MiB): %s", ", ".join(f"{k[:-4]} {v:.1f}" for k, v in mem.items()))
        if self.writer is not None:
            for k, v in mem.items():
                self.writer.add_scalar(f"Memory/{k}", v, self.step)
            self.writer.flush()
        dev.reset_peak_memory(self.device)


def _per_element(v: Any) -> bool:
    """Optimizer state shaped like its parameter (Adam's moments), not a scalar step count."""
    return torch.is_tensor(v) and v.dim() > 0


if __name__ == "__main__":
    sys.exit(main(ModelParallelTrainer, parser=build_parser(), extra_flags=MP_FLAGS, setup=setup))
