"""Figures for TensorBoard and the course pages."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from utils.era5 import CHANNELS  # noqa: E402


def target_vs_prediction(pred: torch.Tensor, target: torch.Tensor, channel: str = "t2m",
                         persistence: torch.Tensor | None = None):
    """Maps of one channel from (C, H, W) normalised fields: target, prediction, error, and
    with ``persistence`` (the input) the error of predicting no change, on the same scale."""
    c = CHANNELS.index(channel)
    t, p = target[c].float().numpy(), pred[c].float().numpy()
    panels = [(t, "target"), (p, "prediction"), (p - t, "prediction - target")]
    if persistence is not None:
        panels.append((persistence[c].float().numpy() - t, "persistence - target"))
    lo, hi = min(p.min(), t.min()), max(p.max(), t.max())
    err = max(abs(d).max() for d, title in panels if "-" in title)
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 2.6), constrained_layout=True)
    for ax, (data, title) in zip(axes, panels):
        if "-" in title:
            im = ax.imshow(data, cmap="RdBu_r", vmin=-err, vmax=err)
        else:
            im = ax.imshow(data, vmin=lo, vmax=hi)
        ax.set_title(f"{channel}: {title}")
        ax.set_xticks([])
        ax.set_yticks([])
        fig.colorbar(im, ax=ax, shrink=0.8)
    return fig
