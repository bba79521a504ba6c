"""Checkpoints of earlier versions of the model, brought to the current layout at load.

Earlier versions had three q, k, v projections per attention layer; the model now has one
head-major ``qkv`` projection (networks/vit.py). The weights and Adam's moments are merged
the same way, so such a checkpoint resumes exactly.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from networks.vit import upgrade_state_dict

log = logging.getLogger(__name__)


def has_separate_qkv(model_state: dict[str, torch.Tensor]) -> bool:
    return any(name.endswith(".attn.q.weight") for name in model_state)


def upgrade_checkpoint(state: dict[str, Any], num_heads: int) -> dict[str, Any]:
    """The checkpoint with q/k/v merged in the model and the optimizer state (one param group,
    its parameters in the model's order, as Trainer saves them)."""
    if not has_separate_qkv(state["model"]):
        return state
    old_names = list(state["model"])
    model = upgrade_state_dict(state["model"], num_heads)
    optimizer = dict(state["optimizer"])
    per_param = {old_names[i]: s for i, s in optimizer["state"].items()}
    merged: dict[str, dict[str, Any]] = {}
    for key in {k for s in per_param.values() for k in s}:
        moments = {n: s[key] for n, s in per_param.items() if torch.is_tensor(s[key]) and s[key].dim() > 0}
        merged_moments = upgrade_state_dict(moments, num_heads)
        for name in model:
            entry = merged.setdefault(name, {})
            if name in merged_moments:
                entry[key] = merged_moments[name]
            else:  # a scalar (Adam's step), equal for q, k and v
                source = name.replace(".qkv.", ".q.")
                if source in per_param:
                    entry[key] = per_param[source][key]
    optimizer["state"] = {i: merged[name] for i, name in enumerate(model) if merged.get(name)}
    optimizer["param_groups"] = [dict(optimizer["param_groups"][0], params=list(range(len(model))))]
    log.info("converted a checkpoint with separate q, k, v projections to the fused qkv layout")
    return dict(state, model=model, optimizer=optimizer)
