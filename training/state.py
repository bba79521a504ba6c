"""The Trainer's parts of a checkpoint (the contract of training/checkpointing.py: each part owns
some keys of the checkpoint and saves and restores them with ``state_dict`` / ``load_state_dict``).

:class:`LoopState`, the loop's own progress: "step", "epoch_loss_sum", "epoch_loss_ranks",
"epoch_steps", "attention_kernel". It refuses to save a NaN or infinite loss or weight.

:class:`ModelState`, the model and the optimizer: "model" and "optimizer". Whole tensors with
the serial model's names, whatever the layout: on one device the model's and optimizer's own
state, copied to host memory; on several ranks consolidated (collectives over tp, and over dp
for FSDP's shards; expert parallel: every rank's experts too, distributed/experts.py). FSDP
alone writes sharded checkpoints instead (with tp its tensors are tp slices: consolidated).
Step variants that hold the model otherwise bring their own subclass (training/pipelined.py,
training/deepspeed_engine.py, training/graphs.py).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch

from distributed.env import all_reduce_sum
from training import checkpointing
from training.context import StepParts, StepVariant, TrainingError
from utils import attention
from utils import checkpoint as ckpt

log = logging.getLogger(__name__)


class LoopState:
    """The loop's own state: the step, the epoch's running loss, the attention kernel chosen."""

    def __init__(self, parts: StepParts) -> None:
        self.parts = parts  # the loop's progress is written here, into what the Trainer and step share

    def state_dict(self) -> dict[str, Any]:
        """Collective: the loss is summed over the data-parallel ranks. A NaN or infinite loss or
        weight is refused on every rank alike: it would replace the last good checkpoint with one
        no rerun can recover from."""
        parts = self.parts
        epoch_loss = all_reduce_sum(parts.epoch_loss.clone(), parts.ctx.dp_group).item()
        refuse_unsound(epoch_loss, parts.raw_model.parameters(), parts.device, parts.step, parts.ctx.run_dir)
        return {
            "step": parts.step,
            "attention_kernel": parts.attention_kernel,
            "epoch_loss_sum": epoch_loss,  # summed over data-parallel ranks...
            "epoch_loss_ranks": parts.ctx.dp_size,  # ...of which there were this many
            "epoch_steps": parts.epoch_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        parts = self.parts
        kernel = kept_attention_kernel(parts.cfg.optim.attention_kernel, parts.attention_kernel,
                                       state.get("attention_kernel"), parts.device)
        parts.step, parts.attention_kernel, parts.epoch_steps = state["step"], kernel, state["epoch_steps"]
        # the epoch's loss sum so far goes to one rank, so the epoch-end reduction counts it once;
        # rescaled from the data-parallel ranks that summed it to those that will average it
        ranks = state.get("epoch_loss_ranks", parts.ctx.dp_size)
        loss_sum = state["epoch_loss_sum"] * parts.ctx.dp_size / ranks
        parts.epoch_loss.fill_(loss_sum if parts.ctx.dp_rank == 0 else 0.0)


def refuse_unsound(epoch_loss_sum: float, params: Any, device: torch.device, step: int,
                   run_dir: Path) -> None:
    """Raise TrainingError, on every rank alike, if the loss or any weight is not finite."""
    bad = unsound_flags(epoch_loss_sum, params, device)
    all_reduce_sum(bad)  # over every rank: shards differ, the decision must not
    if bad.any():  # one host sync
        what = "training loss" if bad[0] else "model weights"
        last = checkpointing.find(run_dir)
        kept = f"the last good checkpoint ({last}) is kept" if last else "no checkpoint was written"
        raise TrainingError(f"the {what} at step {step} is not finite (NaN or inf): not writing "
                            f"a checkpoint, {kept}; lower the learning rate or check the data")


def unsound_flags(epoch_loss_sum: float, params: Any, device: torch.device) -> torch.Tensor:
    """[loss not finite, some weight not finite] as floats on ``device``. Each parameter is
    checked where it lives (FSDP's offloaded shards in host memory, the rest on the device) and
    only its one-element answer moves to ``device``."""
    from distributed.shards import local

    finite = torch.stack([torch.isfinite(local(p)).all().to(device) for p in params])
    return torch.stack([torch.tensor(not math.isfinite(epoch_loss_sum), device=device),
                        (~finite).any()]).float()


def kept_attention_kernel(setting: str, current: str, saved: str | None, device: torch.device) -> str:
    """With ``attention_kernel: auto``, a resumed run continues on the kernel it chose when it
    started (timed again, it could come out otherwise and the resumed run would not be exact)."""
    if setting != "auto" or saved in (None, current):
        return current
    if saved in attention.CUDA_ONLY and device.type != "cuda":
        return current  # a GPU run continued on a CPU: keep this device's own choice
    log.info("attention kernel %s, as the run chose at its start", saved)
    return saved


class ModelState:
    """The model's and optimizer's state (``state_dict`` / ``load_state_dict``), and FSDP's shards."""

    def __init__(self, variant: StepVariant) -> None:
        self.variant = variant  # the step variant (training/trainer.py's EagerStep or one extending it)
        self.parts = variant.parts  # its model, optimizer, mesh

    @property
    def sharded(self) -> bool:
        """FSDP alone writes sharded checkpoints (with tp its tensors are tp slices: consolidated)."""
        parts = self.parts
        return parts.fsdp_active and not parts.ctx.mesh.model_parallel

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model_state(), "optimizer": self.optimizer_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from training.upgrade import upgrade_checkpoint  # an older checkpoint's layout: the current one

        state = upgrade_checkpoint(state, self.parts.cfg.model)
        self.load_model_state(state["model"])
        checkpointing.keep_kernel_flags(self.parts.optimizer,
                                        lambda: self.load_optimizer_state(state["optimizer"]))

    def model_state(self) -> dict[str, torch.Tensor]:
        parts = self.parts
        if parts.ctx.mesh.world_size == 1:  # one device: the weights as they are, copied to host memory
            return {name: p.detach().to("cpu", copy=True) for name, p in parts.raw_model.named_parameters()}
        from distributed import consolidate

        state = consolidate.full_state(parts.raw_model, parts.ctx.mesh)
        if parts.ctx.mesh.expert_parallel > 1:
            state = experts().full_model_state(parts.raw_model, parts.ctx.mesh, state)
        return state

    @torch.no_grad()
    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        parts = self.parts
        if parts.ctx.mesh.world_size > 1:
            from distributed import consolidate

            if parts.ctx.mesh.expert_parallel > 1:
                state = experts().local_model_state(parts.raw_model, state)
            consolidate.load_full_state(parts.raw_model, state, parts.ctx.mesh)
            return
        own = dict(parts.raw_model.named_parameters())
        ckpt.check_names(own, state)
        for name, p in own.items():
            if state[name].shape != p.shape:
                raise ValueError(f"checkpoint tensor {name} has shape {tuple(state[name].shape)}, which "
                                 f"does not fit this model; was it written for another model size?")
            p.copy_(state[name])

    def optimizer_state(self) -> dict[str, Any]:
        parts = self.parts
        if parts.ctx.mesh.world_size == 1:  # Adam's moments copied to host memory, its step counts kept
            state = parts.optimizer.state_dict()
            state["state"] = {i: {k: v.detach().to("cpu", copy=True) if torch.is_tensor(v) and v.dim() else v
                                  for k, v in s.items()} for i, s in state["state"].items()}
            return by_model_position(state, self.positions())
        from distributed import consolidate

        state = consolidate.full_optimizer_state(parts.optimizer, parts.ctx.mesh)
        if parts.ctx.mesh.expert_parallel > 1:
            state = experts().full_optimizer_state(parts.raw_model, parts.ctx.mesh, state)
        return by_model_position(state, self.positions()) if state else state

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        parts = self.parts
        state = by_optimizer_position(state, self.positions())
        if parts.ctx.mesh.world_size == 1:
            parts.optimizer.load_state_dict(state)
            return
        from distributed import consolidate

        if parts.ctx.mesh.expert_parallel > 1:
            state = experts().local_optimizer_state(parts.raw_model, state)
        consolidate.load_full_optimizer_state(parts.optimizer, state, parts.ctx.mesh)

    def positions(self) -> list[int] | None:
        """Where each of the optimizer's parameters is among the model's, when it holds fewer than
        all of them (frozen ones left it: training/freezing.py); None when it holds them all."""
        parts = self.parts
        model = list(parts.raw_model.parameters())
        optimizer = [p for group in parts.optimizer.param_groups for p in group["params"]]
        if len(optimizer) == len(model):
            return None
        where = {id(p): i for i, p in enumerate(model)}
        return [where[id(p)] for p in optimizer]

    def shards(self) -> dict[str, Any]:
        """FSDP: this rank's shards of the model and optimizer, for a sharded checkpoint."""
        from training import sharded_checkpoint as sharded

        return sharded.model_and_optimizer(self.parts.raw_model, self.parts.optimizer)

    def load_shards(self, path: Path) -> None:
        from training import sharded_checkpoint as sharded

        parts = self.parts
        checkpointing.keep_kernel_flags(parts.optimizer,
                                        lambda: sharded.load_into(path, parts.raw_model, parts.optimizer))


def by_model_position(state: dict[str, Any], positions: list[int] | None) -> dict[str, Any]:
    """An optimizer's state dict keyed, as checkpoints key it, by each parameter's position in the
    model (the same as its position in the optimizer while that holds every parameter)."""
    if positions is None:
        return state
    (group,) = state["param_groups"]  # the project's optimizers have one group
    return {"state": {positions[i]: s for i, s in state["state"].items()},
            "param_groups": [{**group, "params": [positions[i] for i in group["params"]]}]}


def by_optimizer_position(state: dict[str, Any], positions: list[int] | None) -> dict[str, Any]:
    """The reverse: a checkpoint's optimizer state for an optimizer that holds the parameters at
    ``positions`` of the model (the state of the others, frozen since, is left out)."""
    if positions is None:
        return state
    index = {model: i for i, model in enumerate(positions)}
    (group,) = state["param_groups"]
    return {"state": {index[j]: s for j, s in state["state"].items() if j in index},
            "param_groups": [{**group, "params": list(range(len(positions)))}]}


def experts() -> Any:
    from distributed import experts  # loaded by expert-parallel runs only

    return experts
