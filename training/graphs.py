"""The training step replayed from a CUDA graph (the lesson of train_graph.py).

Launching hundreds of small kernels one by one costs CPU time per step; a CUDA graph
records the launches of one whole step (forward, loss, backward, Adam) once and then
replays them with a single call. What changes against the eager step (training/trainer.py),
all here:

* Adam keeps its step count and learning rate on the GPU (``capturable=True``, the
  learning rate a tensor the scheduler writes into between replays), because a graph
  replays fixed kernels with fixed arguments: no Python value may change inside it.
* The first steps run eagerly on a side stream (warm-up: lazy initialisation, cuDNN/cuBLAS
  autotuning, DDP's buffers), then one step is captured and every step, that one
  included, is a replay with the batch copied into static input buffers.
* fp16 is refused: its GradScaler checks the gradients for inf on the host, which
  cannot be captured. bf16 needs no scaler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from training.context import RunContext, StepParts
from training.schedule import optimizer_choice
from training.state import ModelState
from training.trainer import EagerStep
from utils import compat
from utils import device as dev
from utils.config import Config
from utils.config_groups import OptimizerConfig

EAGER_WARMUP_STEPS = 3
DDP_WARMUP_STEPS = 11  # PyTorch's CUDA graph notes: at least 11 eager DDP iterations before capture
CAPTURABLE = ("Adam", "AdamW")  # torch's optimizers with a capturable kernel


class GraphState(ModelState):
    """As every run's, but the learning-rate tensors the captured graph reads stay in place."""

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        keep_lr_tensors(self.parts.optimizer, lambda: super(GraphState, self).load_optimizer_state(state))


class GraphStep(EagerStep):
    """The eager step captured once and replayed.

    One side stream serves the whole run: DDP is constructed on it (PyTorch's CUDA graph
    notes require DDP to be built in a side-stream context before capturing a full
    backward), the eager warm-up steps run on it, and the capture records on it.
    """

    autocast_cache = False  # cached casts would be freed with the capture's memory pool
    state_class = GraphState

    @classmethod
    def check(cls, cfg: Config, ctx: RunContext, local_batch: int) -> None:
        super().check(cfg, ctx, local_batch)
        if cfg.layout.engine != "native":  # DeepSpeed's step is its own, not one captured graph
            raise ValueError("train_graph.py captures the native step; run --engine deepspeed with train.py")
        if cfg.optim.amp_mode == "fp16":
            raise ValueError("train_graph.py supports amp_mode none or bf16: fp16's GradScaler "
                             "checks for inf on the host, which a CUDA graph cannot capture")
        if cfg.optim.optimizer_type not in CAPTURABLE:
            raise ValueError(f"train_graph.py captures {' and '.join(CAPTURABLE)} (their capturable "
                             f"kernels keep the step count and learning rate on the GPU); run "
                             f"--optimizer {cfg.optim.optimizer_type} with train.py")
        problem = compat.graphs_with_checkpointing_problem()
        if cfg.memory.activation_checkpointing != "none" and problem:
            raise ValueError(problem)
        if cfg.optim.grad_clip_norm:
            raise ValueError("train_graph.py does not clip gradients (its captured step calls the "
                             "optimizer directly); run --grad_clip_norm with train.py")
        if cfg.layout.grad_compression != "none":  # a hook's Python callbacks cannot be captured
            raise ValueError("train_graph.py does not compress gradients (DDP's communication hook "
                             "runs Python callbacks, which a CUDA graph cannot capture); run "
                             "--grad_compression with train.py")
        if cfg.model.num_experts:  # tokens per expert decide tensor shapes: not capturable
            raise ValueError("train_graph.py does not train a mixture of experts (how many tokens each "
                             "expert gets changes every step, and a CUDA graph replays fixed shapes); run "
                             "--num_experts with train.py")
        if not cfg.layout.replicated or cfg.memory.grad_accum_steps > 1:
            raise ValueError("train_graph.py captures one plain DDP step: use --data_parallel ddp and "
                             "--grad_accum_steps 1 (train.py runs zero1, fsdp and accumulation)")

    def __init__(self, parts: StepParts) -> None:
        super().__init__(parts)
        self.stream = dev.new_stream(parts.device)
        self.eager_steps = 0
        self.graph = None
        self.static_inp = self.static_tar = self.static_loss = None

    @property
    def warmup_steps(self) -> int:
        ddp = isinstance(self.parts.model, DistributedDataParallel)
        return DDP_WARMUP_STEPS if ddp else EAGER_WARMUP_STEPS

    def build_model(self) -> nn.Module:
        with dev.on_stream(self.stream, self.parts.device):
            return super().build_model()

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return capturable_optimizer(model.parameters(), self.parts.cfg.optim, self.parts.device)

    def capture(self, inp: torch.Tensor, tar: torch.Tensor) -> None:
        """Record one step on static buffers; gradients are allocated inside the graph."""
        parts = self.parts
        self.static_inp, self.static_tar = inp.clone(), tar.clone()
        parts.optimizer.zero_grad(set_to_none=True)
        self.graph = dev.new_cuda_graph()
        with dev.graph_capture(self.graph, self.stream):
            loss = self.forward_loss(self.static_inp, self.static_tar)
            loss.backward()
            parts.optimizer.step()
        self.static_loss = loss.detach()

    def train_step(self, inp: torch.Tensor, tar: torch.Tensor) -> torch.Tensor:
        if self.graph is None and self.eager_steps < self.warmup_steps:
            with dev.on_stream(self.stream, self.parts.device):
                loss = super().train_step(inp, tar)
            self.eager_steps += 1
            return loss
        if self.graph is None:
            self.capture(inp, tar)  # records only: the replay below runs this step
        with dev.nvtx_range("graph replay"):
            self.static_inp.copy_(inp)
            self.static_tar.copy_(tar)
            self.graph.replay()
        self.parts.scheduler.step()
        return self.static_loss.clone()  # the next replay overwrites static_loss


def capturable_optimizer(params: Any, cfg: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    """Adam or AdamW as the run asks for (betas, weight decay, fused), with ``capturable=True`` and
    the learning rate a tensor on the device that the scheduler fills in place between replays."""
    optimizer_class, options = optimizer_choice(cfg, dev.adam_kernel(cfg.enable_fused))
    options["lr"] = torch.tensor(cfg.lr, device=device)
    return optimizer_class(params, **options, capturable=True)


def keep_lr_tensors(optimizer: torch.optim.Optimizer, load: Callable[[], None]) -> None:
    """Run ``load`` (an optimizer.load_state_dict) without replacing the learning-rate tensors.

    A captured graph reads each param group's ``lr`` tensor at a fixed address; loading a
    state dict would put the checkpoint's tensor (or float) in its place, so the graph would
    keep reading the old one and the schedule would silently freeze. The loaded value is
    copied into the original tensor instead.
    """
    originals = [group["lr"] for group in optimizer.param_groups]
    load()
    for group, lr in zip(optimizer.param_groups, originals):
        loaded = group["lr"]
        with torch.no_grad():
            lr.fill_(loaded.item() if torch.is_tensor(loaded) else loaded)
        group["lr"] = lr
