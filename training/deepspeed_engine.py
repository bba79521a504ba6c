"""The same training on DeepSpeed's engine (``train.py --engine deepspeed``).

What changes against the eager step (training/trainer.py), all in this part; the model, data,
loss, validation, logging, checkpoints and run directories are the Trainer's:

* **Wrapping.** The serial model (the same weights from the seed) and torch's Adam go to
  ``deepspeed.initialize`` with a config generated from the run's keys (:func:`ds_config`,
  written to RUN_DIR/ds_config.json). The engine it returns is the model from then on:
  ZeRO stage 1 splits Adam's state over the data-parallel ranks, 2 the gradients too, 3 the
  parameters too (gathered layer by layer in forward and backward); 0 is plain data parallel.
* **The step.** ``engine.backward(loss)`` replaces ``loss.backward()`` (it divides by the
  accumulation steps and reduces gradients at the last micro-batch) and ``engine.step()``
  replaces clipping, ``optimizer.step()`` and ``zero_grad``; it is called after every
  micro-batch and steps the optimizer only at the last one.
* **Precision.** ``--amp_mode bf16`` is DeepSpeed's bf16 mode: the model's weights in bf16, an
  fp32 master copy in the optimizer (not torch's autocast, which keeps fp32 weights).
* **Checkpoints** are the project's consolidated ones (whole fp32 tensors with the serial
  names, Adam's moments as torch writes them): DeepSpeed's tensor-fragment functions
  (``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state`` and their ``set``
  partners) assemble each tensor from the ranks' partitions and scatter it back, so a
  DeepSpeed run continues in ``--engine native`` (any layout) and the reverse, exactly.

The learning-rate schedule stays the project's (a LambdaLR on the optimizer DeepSpeed steps):
DeepSpeed's own schedulers (WarmupCosineLR, OneCycle, LRRangeTest) ramp differently, see
docs/10-deepspeed.md. DeepSpeed is an optional install (``make deepspeed``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distributed import consolidate
from distributed.parallelize import apply_activation_checkpointing, materialize, serial_values
from networks.backbone import build_on_meta
from training.context import RunContext, StepParts
from training.state import ModelState
from training.trainer import EagerStep
from utils import checkpoint as ckpt
from utils import compat
from utils import device as dev
from utils.config import Config

log = logging.getLogger(__name__)

CONFIG_NAME = "ds_config.json"

# DeepSpeed 0.19 still calls the collectives torch 2.13 renamed; one warning per call otherwise
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
INSTALL_HINT = "run `make deepspeed` (it pip-installs requirements-deepspeed.txt into .venv)"


def import_deepspeed() -> Any:
    """The deepspeed module, or a one-line error saying how to install it."""
    # DeepSpeed compiles its CPU all-reduce with torch's extension builder, which runs the first
    # `ninja` on PATH; the one installed with DeepSpeed, beside this interpreter, is used whatever
    # the PATH (two ninja versions would each rebuild what the other built: 25 s a run)
    bin_dir = str(Path(sys.executable).parent)
    if (Path(bin_dir) / "ninja").exists() and os.environ.get("PATH", "").split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    try:
        import deepspeed
    except ImportError as err:
        missing = getattr(err, "name", None) == "deepspeed"
        raise ValueError(f"--engine deepspeed needs DeepSpeed, which is not installed here: {INSTALL_HINT}"
                         if missing else f"--engine deepspeed: importing DeepSpeed failed ({err}); "
                                         f"reinstall it: {INSTALL_HINT}") from None
    return deepspeed


def build_ops() -> None:
    """Compile DeepSpeed's shared-memory all-reduce for CPU ranks now (make deepspeed), not in the
    first run; where no compiler exists DeepSpeed reduces through gloo alone and this says so."""
    import time

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    deepspeed = import_deepspeed()
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:  # a GPU accelerator: NCCL reduces, nothing to build
        log.info("DeepSpeed %s: nothing to build on %s", deepspeed.__version__,
                 get_accelerator().device_name())
        return
    if not builder.is_compatible():
        log.info("DeepSpeed %s: no C++ compiler for its CPU all-reduce; runs reduce through gloo",
                 deepspeed.__version__)
        return
    start = time.time()
    builder.load()
    cache = os.environ.get("TORCH_EXTENSIONS_DIR", "~/.cache/torch_extensions")
    log.info("DeepSpeed %s: its CPU all-reduce (%s) is built (%.0f s), cached under %s",
             deepspeed.__version__, builder.NAME, time.time() - start, cache)


def ds_config(cfg: Config, local_batch: int, dp_size: int, device: torch.device) -> dict[str, Any]:
    """DeepSpeed's configuration for this run, key by key from the project's (docs/10-deepspeed.md)."""
    micro = local_batch // cfg.memory.grad_accum_steps
    zero: dict[str, Any] = {"stage": cfg.layout.zero_stage}
    if cfg.memory.cpu_offload:  # ZeRO-Offload: Adam's state (and its step) in host memory
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
        if cfg.layout.zero_stage == 3:  # ZeRO-Infinity's parameter offload: the partitions too
            zero["offload_param"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
    return {
        # DeepSpeed checks that batch = micro-batch x accumulation steps x data-parallel ranks
        "train_batch_size": micro * cfg.memory.grad_accum_steps * dp_size,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": cfg.memory.grad_accum_steps,
        "gradient_clipping": cfg.optim.grad_clip_norm,  # 0: no clipping (the global norm over all ranks)
        "bf16": {"enabled": cfg.optim.amp_mode == "bf16"},
        "zero_optimization": zero,
        # the optimizer is torch's (sharding.build_optimizer), which ZeRO calls "untested", and
        # stays torch's when offloaded (DeepSpeedCPUAdam would be compiled on first use)
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,  # the Trainer logs; DeepSpeed's own step lines off
    }


def launcher_env(ctx: RunContext, device: torch.device) -> dict[str, str]:
    """The variables DeepSpeed reads as torchrun and its own launcher set them; srun sets SLURM_*
    ones instead, so they come from the ranks the launcher found. LOCAL_RANK is the GPU this rank
    uses (DeepSpeed calls torch.cuda.set_device with it): under srun --gpus-per-task=1 every task
    sees one GPU, cuda:0, whatever its local rank."""
    local_rank = device.index if device.type == "cuda" and device.index is not None else ctx.local_rank
    return {"RANK": str(ctx.rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(ctx.world_size)}


class DeepSpeedState(ModelState):
    """The project's consolidated checkpoint, assembled from ZeRO's partitions (never sharded)."""

    sharded = False
    variant: DeepSpeedStep

    def model_state(self) -> dict[str, torch.Tensor]:
        """Whole fp32 tensors with the serial names (collective: each is assembled from the ranks'
        partitions); without a master copy (stage 0 in fp32) the weights themselves."""
        frag = self.variant.deepspeed.utils
        state = {}
        for name, p in self.parts.raw_model.named_parameters():
            full = frag.safe_get_full_fp32_param(p)
            state[name] = (p if full is None else full).detach().clone()
        return state

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        """Each tensor into the master copy (this rank's partition of it) and into the weights
        (ZeRO-3: gathered, written, partitioned again)."""
        frag = self.variant.deepspeed.utils
        parts = self.parts
        params = dict(parts.raw_model.named_parameters())
        consolidate.check_names(params, state)
        for name, p in params.items():
            frag.safe_set_full_fp32_param(p, state[name].to(parts.device, torch.float32))
            gathered = self.variant.deepspeed.zero.GatheredParameters([p], modifier_rank=0,
                                                              enabled=parts.cfg.layout.zero_stage == 3)
            with gathered, torch.no_grad():
                p.copy_(state[name].to(p.device, p.dtype))

    def optimizer_state(self) -> dict[str, Any]:
        """torch's optimizer state dict for the serial model's parameters (indices in their order)."""
        optimizer = self.parts.optimizer
        groups = [{**g, "lr": optimizer.param_groups[0]["lr"],
                   "initial_lr": optimizer.param_groups[0].get("initial_lr", g["lr"])}
                  for g in self.variant.client_groups]
        if optimizer is self.variant.ds_optimizer:  # stage 0 in fp32: torch's optimizer on the weights
            return optimizer.state_dict()
        inner = optimizer.state
        if not inner:  # no step yet: nothing learned
            return {"state": {}, "param_groups": groups}
        first = next(iter(inner.values()))
        keys = [k for k, v in first.items() if torch.is_tensor(v) and v.dim() > 0]  # per element
        frag = self.variant.deepspeed.utils
        state = {}
        for i, p in enumerate(self.parts.raw_model.parameters()):
            # the step count is one per partition here, one per parameter in torch's format: each
            # its own tensor (Adam adds 1 to each in place; shared, one would count every parameter)
            state[i] = {k: v.clone() if torch.is_tensor(v) else v for k, v in first.items() if k not in keys}
            state[i].update({k: frag.safe_get_full_optimizer_state(p, k).detach().clone() for k in keys})
        return {"state": state, "param_groups": groups}

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        optimizer = self.parts.optimizer
        if optimizer is self.variant.ds_optimizer:
            optimizer.load_state_dict(state)
            return
        saved = state["param_groups"][0]
        for group in optimizer.param_groups:
            group["lr"] = saved["lr"]
            group["initial_lr"] = saved.get("initial_lr", saved["lr"])
        if not state["state"]:
            return
        first = state["state"][0]
        keys = [k for k, v in first.items() if torch.is_tensor(v) and v.dim() > 0]
        # DeepSpeed's optimizer creates its state in its first step; the set functions write
        # into it, so it is created here as that step would (zeros, then overwritten)
        for flat in self.variant.master_partitions():
            entry = optimizer.state[flat]
            entry.update({k: v.clone() if torch.is_tensor(v) else v for k, v in first.items()
                          if k not in keys})
            for k in keys:
                entry[k] = torch.zeros_like(flat)
        # stages 1-2, bf16: the fragments linked to the state just made
        compat.deepspeed_link_optimizer_state(self.variant.ds_optimizer)
        frag = self.variant.deepspeed.utils
        for i, p in enumerate(self.parts.raw_model.parameters()):
            for k in keys:
                value = state["state"][i][k].to(self.parts.device, torch.float32)
                frag.safe_set_full_optimizer_state(p, value, k)


class DeepSpeedStep(EagerStep):
    """The step on DeepSpeed's engine: wrapping, backward, step, accumulation and clipping."""

    state_class = DeepSpeedState

    def __init__(self, parts: StepParts) -> None:
        super().__init__(parts)
        cfg, ctx = parts.cfg, parts.ctx
        self.deepspeed = import_deepspeed()
        self.ds_config = ds_config(cfg, parts.local_batch, ctx.dp_size, ctx.device)
        self.input_dtype = torch.bfloat16 if cfg.optim.amp_mode == "bf16" else None
        log.info("DeepSpeed %s engine, ZeRO stage %d%s; its config: %s", self.deepspeed.__version__,
                 cfg.layout.zero_stage, " with CPU offload" if cfg.memory.cpu_offload else "",
                 ctx.run_dir / CONFIG_NAME)

    def run_started(self) -> None:
        ctx = self.parts.ctx
        if ctx.is_main:  # the run directory is locked now: what ran, beside config.yaml
            text = json.dumps(self.ds_config, indent=2) + "\n"
            ctx.run_dir.mkdir(parents=True, exist_ok=True)
            ckpt.write_text_atomic(ctx.run_dir / CONFIG_NAME, text)

    # ------------------------------------------------------------------ building ---
    def build_model(self) -> nn.Module:
        """The serial model with the seed's weights, whole on every rank: DeepSpeed partitions it."""
        parts = self.parts
        serial, self.n_params = build_on_meta(parts.cfg.model)
        values = serial_values(serial, parts.cfg.run.seed)
        model = apply_activation_checkpointing(serial, parts.cfg.memory.activation_checkpointing)
        if parts.cfg.optim.enable_jit:
            for unit in model.units().values():
                unit.compile()
        return materialize(model, parts.ctx.mesh, parts.device, values)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """Torch's optimizer, handed to ``deepspeed.initialize`` with the model; the engine it
        returns (``engine``) is what the Trainer steps from here on. Returns the optimizer that
        steps (under ZeRO: over the flat fp32 partitions this rank owns), on which the project's
        schedule sets the learning rate."""
        parts = self.parts
        if not dist.is_initialized():  # one process: DeepSpeed still wants a process group (NCCL on a GPU)
            dist.init_process_group(dev.backend_for(parts.device, parts.cfg.layout.dist_backend),
                                    store=dist.HashStore(), rank=0, world_size=1)
        os.environ.update(launcher_env(parts.ctx, parts.device))
        client = super().build_optimizer(model)
        # the param groups' format of a checkpoint this engine writes (indices, hyperparameters)
        self.client_groups = client.state_dict()["param_groups"]
        engine, optimizer, _, _ = self.deepspeed.initialize(model=model, optimizer=client,
                                                            config=self.ds_config, dist_init_required=False)
        self.engine = engine  # the Trainer's model from here on
        self.ds_optimizer = optimizer  # ZeRO's (or bf16's) wrapper, or torch's Adam itself
        return getattr(optimizer, "optimizer", optimizer)

    # --------------------------------------------------------------------- steps ---
    def forward_loss(self, inp: torch.Tensor, tar: torch.Tensor) -> torch.Tensor:
        return super().forward_loss(self.cast(inp), tar)

    def predict(self, inp: torch.Tensor) -> torch.Tensor | None:
        return super().predict(self.cast(inp))

    def cast(self, inp: torch.Tensor) -> torch.Tensor:
        return inp if self.input_dtype is None else inp.to(self.input_dtype)

    def train_step(self, inp: torch.Tensor, tar: torch.Tensor) -> torch.Tensor:
        parts = self.parts
        n = parts.cfg.memory.grad_accum_steps
        total = torch.zeros((), device=parts.device)
        for x, y in zip(inp.chunk(n), tar.chunk(n)):
            parts.mark("forward")
            with dev.nvtx_range("forward"):
                loss = self.forward_loss(x, y)
                objective = loss + self.balancing_loss()
            parts.mark("backward")
            with dev.nvtx_range("backward"):
                parts.model.backward(objective)  # / n; the gradients reduced at the last micro-batch
            parts.mark("optimizer step")
            with dev.nvtx_range("optimizer"):
                parts.model.step()  # clip, step, zero the gradients: at the last micro-batch only
            total += loss.detach() / n
        parts.scheduler.step()
        norm = parts.model.get_global_grad_norm()  # before clipping; None where DeepSpeed keeps none
        if parts.cfg.optim.grad_clip_norm and norm is not None:  # (stage 0 in fp32 clips with torch's)
            parts.grad_norms.append(torch.as_tensor(float(norm)))
        self.record_experts()
        return total

    def gathers_in_forward(self) -> bool:
        return self.parts.cfg.layout.zero_stage == 3  # every forward gathers parameters: ranks in lockstep

    # ------------------------------------------------------------------- memory ---
    def held_bytes(self) -> dict[str, int]:
        """What this rank holds: the working parameters (ZeRO-3: its partition), and as optimizer
        state the fp32 master partitions with Adam's moments (as the ZeRO paper counts them)."""
        def size(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        raw = self.parts.raw_model
        working = [getattr(p, "ds_tensor", p) for p in raw.parameters()]
        own = {id(p) for p in raw.parameters()}
        masters = [p for p in self.master_partitions() if id(p) not in own]
        state = [v for s in self.parts.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        return {"parameters": sum(size(p) for p in working), "step_gradients": self.gradient_bytes(),
                "gradients": sum(size(p.grad) for p in raw.parameters() if p.grad is not None),
                "optimizer_state": sum(size(p) for p in masters) + sum(size(v) for v in state)}

    def master_partitions(self) -> list[torch.Tensor]:
        """The flat fp32 tensors the optimizer steps (this rank's partitions under ZeRO). ZeRO-3
        puts them in the optimizer's param groups only during its step, so they come from it."""
        flat = getattr(self.ds_optimizer, "fp32_partitioned_groups_flat", None)
        if flat is not None:
            return list(flat)
        return [p for g in self.parts.optimizer.param_groups for p in g["params"]]

    def gradient_bytes(self) -> int:
        """The gradients a step holds: whole at stages 0 and 1, this rank's partition at 2 and 3,
        in the weights' precision (DeepSpeed's default ``grad_accum_dtype``)."""
        numel = sum(getattr(p, "ds_numel", p.numel()) for p in self.parts.raw_model.parameters())
        if self.parts.cfg.layout.zero_stage >= 2:
            numel = -(-numel // self.parts.ctx.dp_size)
        return numel * (2 if self.input_dtype == torch.bfloat16 else 4)
