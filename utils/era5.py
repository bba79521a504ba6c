"""Facts about the ERA5 data layout shared by the loaders, metrics and the generator."""

from __future__ import annotations

import numpy as np

# The 20 channels of the NERSC tutorial data, in file order.
CHANNELS = (
    "u10m", "v10m", "t2m", "sp", "msl", "t850", "u1000", "v1000", "z1000", "u850",
    "v850", "z850", "u500", "v500", "z500", "t500", "z50", "r500", "r850", "tcwv",
)

SPLITS = ("train", "valid", "test")
STATS_FILES = {
    "global_means": "global_means.npy",  # (1, C, 1, 1)
    "global_stds": "global_stds.npy",  # (1, C, 1, 1)
    "time_means": "time_means.npy",  # (1, C, H, W)
}
HOURS_PER_STEP = 6


def latitudes(n_lat: int) -> np.ndarray:
    """Row latitudes in degrees, top row at 90N, spacing 180 / n_lat (0.5 deg for 360)."""
    return 90.0 - np.arange(n_lat) * (180.0 / n_lat)


def longitudes(n_lon: int) -> np.ndarray:
    return np.arange(n_lon) * (360.0 / n_lon)


def channel_index(name: str) -> int:
    return CHANNELS.index(name)
