"""Checkpoints of earlier versions of a model, brought to the current layout at load.

The model converts its own weights (``Backbone.upgrade_state_dict``: the ViT merges the three
q, k, v projections of its earlier versions into one head-major ``qkv``, networks/vit.py); here
Adam's moments are converted the same way, and its per-parameter scalars (the step count) too,
so such a checkpoint resumes exactly.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from networks.backbone import backbone_class
from utils.config_groups import ModelConfig

log = logging.getLogger(__name__)


def upgrade_checkpoint(state: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """The checkpoint in the current layout of the model group ``cfg``'s backbone (its model and
    optimizer state: one param group, its parameters in the model's order, as Trainer saves them);
    ``state`` itself when it is current."""
    cls = backbone_class(cfg)
    model = cls.upgrade_state_dict(state["model"], cfg)
    if model is None:
        return state
    old_names = list(state["model"])
    optimizer = dict(state["optimizer"])
    per_param = {old_names[i]: s for i, s in optimizer["state"].items()}
    merged: dict[str, dict[str, Any]] = {}
    for key in {k for s in per_param.values() for k in s}:
        values = {n: s[key] for n, s in per_param.items() if key in s}
        # a scalar (Adam's step) is spread to its parameter's shape, so that the model's own
        # upgrade merges it as it merges the weights; it is read back from the merged tensor
        scalar = not any(torch.is_tensor(v) and v.dim() > 0 for v in values.values())
        if scalar:
            values = {n: torch.as_tensor(v).expand(state["model"][n].shape) for n, v in values.items()}
        for name, t in (cls.upgrade_state_dict(values, cfg) or values).items():
            merged.setdefault(name, {})[key] = t.reshape(-1)[0].clone() if scalar else t
    optimizer["state"] = {i: merged[name] for i, name in enumerate(model) if merged.get(name)}
    optimizer["param_groups"] = [dict(optimizer["param_groups"][0], params=list(range(len(model))))]
    log.info("converted a checkpoint of an earlier %s layout to the current one", cls.__name__)
    return dict(state, model=model, optimizer=optimizer)
