"""Validation: the loss and the latitude-weighted RMSE per channel, next to persistence.

Averages are over every validation sample of every data-parallel rank, weighted by
sample count (not by step count), so the numbers do not depend on the number of ranks.
Persistence (predicting that nothing changes in 6 hours) is the baseline a forecast
must beat.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from distributed.env import all_reduce_sum
from training.context import TrainingError
from utils.metrics import relative_l2_per_sample, weighted_rmse_per_sample


@torch.no_grad()
def evaluate(predict: Callable[[torch.Tensor], torch.Tensor | None],
             batches: Iterable[tuple[torch.Tensor, torch.Tensor]], channels: Sequence[str],
             lat_weights: torch.Tensor, groups: Sequence[Any] = (), pad_to: int = 0) -> dict[str, Any]:
    """Run ``predict`` over ``batches`` (input, target on the device); ``channels``: the predicted
    channels' names (utils/era5.py: ``channel_names``), the report's keys. The sums are then added
    up over each of ``groups`` (the data-parallel ranks; and the pipeline's, whose stages
    before the last predict nothing: ``predict`` returns None there and they add zeros).

    ``pad_to``: the most batches any rank has (the samples need not split evenly); a rank with
    fewer repeats its last forward, unused, until it has run as many. Needed when the forward
    itself communicates over the data-parallel ranks (FSDP's weight gathers)."""
    n_out = len(channels)  # sums: [loss, count, rmse(C), persistence rmse(C)]
    sums = torch.zeros(2 + 2 * n_out, device=lat_weights.device, dtype=torch.float64)
    example, inp, done = None, None, 0
    for inp, tar in batches:
        done += 1
        pred = predict(inp)
        if pred is None:
            continue
        pred = pred.float()
        sums[0] += relative_l2_per_sample(pred, tar).sum()
        sums[1] += inp.shape[0]
        sums[2 : 2 + n_out] += weighted_rmse_per_sample(pred, tar, lat_weights).sum(0)
        persistence = inp[:, :n_out]
        sums[2 + n_out :] += weighted_rmse_per_sample(persistence, tar, lat_weights).sum(0)
        if example is None:
            example = (pred[0].cpu(), tar[0].cpu())
    for _ in range(pad_to - done):
        predict(inp)
    for group in groups:
        all_reduce_sum(sums, group)
    count = sums[1].item()
    if count == 0:
        raise TrainingError("the validation set is empty on every rank")
    rmse = (sums[2 : 2 + n_out] / count).tolist()
    pers = (sums[2 + n_out :] / count).tolist()
    return {
        "loss": sums[0].item() / count,
        "samples": int(count),
        "rmse": dict(zip(channels, rmse)),
        "persistence": dict(zip(channels, pers)),
        "example": example,
    }
