"""Loss and validation metrics, always computed in fp32."""

from __future__ import annotations

import torch

from utils.era5 import latitudes


def relative_l2_per_sample(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over channels of ||pred - target||^2 / ||target||^2: (B, C, H, W) -> (B,).

    Norms are over the (H, W) grid of each channel, so every variable counts the same
    whatever its spread.
    """
    pred, target = pred.float(), target.float()
    num = (pred - target).pow(2).sum(dim=(-2, -1))
    den = target.pow(2).sum(dim=(-2, -1)).clamp_min(1e-12)
    return (num / den).mean(dim=-1)


def relative_l2_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The training loss: :func:`relative_l2_per_sample` averaged over the batch."""
    return relative_l2_per_sample(pred, target).mean()


def latitude_weights(n_lat: int, device: torch.device | None = None) -> torch.Tensor:
    """cos(latitude) per row, normalised to mean 1: shape (n_lat, 1)."""
    w = torch.cos(torch.deg2rad(torch.as_tensor(latitudes(n_lat), dtype=torch.float32)))
    return (w / w.mean()).reshape(n_lat, 1).to(device)


def weighted_rmse_per_sample(pred: torch.Tensor, target: torch.Tensor,
                             weights: torch.Tensor) -> torch.Tensor:
    """Latitude-weighted RMSE of each sample and channel: (B, C, H, W) -> (B, C).

    Each grid cell counts by its area (cos latitude), so the crowded polar rows of a
    lat-lon grid do not dominate.
    """
    err = (pred.float() - target.float()).pow(2) * weights
    return err.mean(dim=(-2, -1)).sqrt()
