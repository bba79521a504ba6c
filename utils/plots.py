"""Figures for TensorBoard and the README."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from utils.era5 import CHANNELS  # noqa: E402


def target_vs_prediction(pred: torch.Tensor, target: torch.Tensor, channel: str = "t2m"):
    """Side-by-side maps of one channel, (C, H, W) normalised fields -> a Figure."""
    c = CHANNELS.index(channel)
    p, t = pred[c].float().numpy(), target[c].float().numpy()
    lo, hi = min(p.min(), t.min()), max(p.max(), t.max())
    fig, axes = plt.subplots(1, 3, figsize=(12, 3), constrained_layout=True)
    for ax, data, title in zip(axes, (t, p, p - t), ("target", "prediction", "error")):
        kwargs = {"vmin": lo, "vmax": hi} if title != "error" else {"cmap": "RdBu_r"}
        im = ax.imshow(data, **kwargs)
        ax.set_title(f"{channel} {title} (normalised)")
        ax.set_xticks([])
        ax.set_yticks([])
        fig.colorbar(im, ax=ax, shrink=0.8)
    return fig
