"""The step with pipeline stages (``--pipeline_parallel`` > 1 in train_mp.py).

The loop is the Trainer's; what this part changes is what a step and a prediction are:

- a training step is one run of the pipeline schedule (distributed/pipeline.py): the first
  stage reads the input, the last computes each micro-batch's loss, and the loss of the
  batch is shared with every stage (so every rank logs and checkpoints the same number);
- validation sends each batch through the stages; the last stage scores it and the sums
  are added up over the pipeline as well as over the data-parallel ranks;
- checkpoints stay consolidated: each stage gathers its own tensors (over tp and FSDP's dp
  shards, as in every layout), then the first stage collects the other stages' and rank 0
  writes the serial model's state, so a pipelined run resumes in any layout (and back).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from distributed import consolidate, pipeline
from distributed.parallelize import parallelize, serial_values
from networks.backbone import build_on_meta
from training.state import ModelState
from training.trainer import EagerStep
from utils import device as dev

log = logging.getLogger(__name__)


class PipelineState(ModelState):
    """Consolidated checkpoints of a pipeline: each stage gathers its own tensors (keyed by the
    serial names; the optimizer's state by the parameter's index in the serial model, its order
    in Adam's single parameter group), then the first stage collects the other stages'."""

    @property
    def serial_names(self) -> list[str]:
        return self.variant.serial_names

    def _own_names(self) -> list[str]:
        return [name for name, _ in self.parts.raw_model.named_parameters()]

    def model_state(self) -> dict[str, torch.Tensor]:
        own = {k: v.cpu() for k, v in super().model_state().items()}
        stages = self.parts.model.gather_to_first(own)
        if stages is None:
            return {}
        merged = {k: v for stage in stages for k, v in stage.items()}
        return {name: merged[name] for name in self.serial_names}

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        consolidate.check_names(self.serial_names, state)  # the whole model, not only this stage
        super().load_model_state({name: state[name] for name in self._own_names()})

    def optimizer_state(self) -> dict[str, Any]:
        state = super().optimizer_state()  # empty on ZeRO-1's dp ranks other than 0
        serial = {name: i for i, name in enumerate(self.serial_names)}
        index = {i: serial[name] for i, name in enumerate(self._own_names())}
        part = {"state": {index[i]: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()}
                          for i, s in state.get("state", {}).items()},
                "param_groups": state.get("param_groups", [])}
        stages = self.parts.model.gather_to_first(part)
        if stages is None or not state:
            return {}
        group = dict(stages[0]["param_groups"][0])
        group["params"] = list(range(len(self.serial_names)))
        return {"state": {i: s for p in stages for i, s in p["state"].items()}, "param_groups": [group]}

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        serial = {name: i for i, name in enumerate(self.serial_names)}
        own = [serial[name] for name in self._own_names()]
        group = dict(state["param_groups"][0])
        group["params"] = list(range(len(own)))
        super().load_optimizer_state({
            "state": {i: state["state"][j] for i, j in enumerate(own) if j in state["state"]},
            "param_groups": [group]})


class PipelineStep(EagerStep):
    state_class = PipelineState
    def build_model(self) -> pipeline.Pipeline:
        # as EagerStep.build_parallel_model: each stage allocates only itself
        cfg, mesh, device = self.parts.cfg, self.parts.ctx.mesh, self.parts.device
        serial, self.n_params = build_on_meta(cfg.model)
        self.serial_names = [name for name, _ in serial.named_parameters()]
        values = serial_values(serial, cfg.run.seed)

        def parallel_stage(stage: torch.nn.Module) -> torch.nn.Module:
            return parallelize(stage, mesh, device, cfg.layout, cfg.memory, cfg.optim, cfg.run.seed, values)

        model = pipeline.build(serial, mesh, cfg.layout, device, parallel_stage, self.micro_batch_loss,
                               **self.stage_layout())
        log.info("%s; this rank holds stages %s: %d of the model's %d parameters",
                 mesh.describe(), model.stage_ids, sum(p.numel() for p in model.parameters()),
                 self.n_params)
        return model

    def stage_layout(self) -> dict[str, Any]:
        """pipeline.build's ``ranges`` (each stage's blocks) and ``prefix`` (frozen first blocks),
        when a variant chooses them (training/freezing.py); the even split otherwise."""
        return {}

    def micro_batch_loss(self, pred: torch.Tensor, tar: torch.Tensor) -> torch.Tensor:
        return self.parts.loss_fn(pred.float(), tar)

    def train_step(self, inp: torch.Tensor, tar: torch.Tensor) -> torch.Tensor:
        # the schedule runs forward and backward: autocast covers both, which is harmless (the
        # backward of each operation runs in the dtype its forward chose)
        with dev.nvtx_range("pipeline schedule"), self.compute():
            loss = self.parts.model.step(inp, tar)
        self.optimizer_step()
        return loss

    def predict(self, inp: torch.Tensor) -> torch.Tensor | None:
        with self.compute():
            return self.parts.model.forward(inp)

    def metric_groups(self) -> list[Any]:
        return [self.parts.ctx.dp_group, self.parts.model.group]

    def to_device(self, inp: torch.Tensor, tar: torch.Tensor,
                  validating: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Only the tensors this rank's stages read go to its device: the input for the first
        stage, the target for the last (in validation the last stage also reads the input, for
        persistence). A middle stage on a GPU would otherwise copy a whole batch it never reads
        every step; it keeps the host tensors, whose shapes are all it needs."""
        parts = self.parts
        nb = parts.device.type == "cuda"
        if parts.model.is_first or (parts.model.is_last and validating):
            inp = inp.to(parts.device, non_blocking=nb)
        if parts.model.is_last:
            tar = tar.to(parts.device, non_blocking=nb)
        return inp, tar

    def validated(self, result: dict[str, Any]) -> dict[str, Any]:
        result["example"] = self.parts.model.from_last_stage(result["example"])  # for rank 0's images
        return result
