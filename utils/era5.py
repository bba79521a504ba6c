"""The course's data format, ERA5 its first data set: the channels and the layout shared by the
loaders, metrics and the generator; the year files of a data set, found, checked against the
configuration, their channels named and their global statistics loaded, each problem a one-line
``DataError`` saying what to do; and :func:`write_data_set`, which writes a learner's own fields
(any grid, any number of channels) in this format.

A data set is a folder: ``train/``, ``valid/`` and ``test/`` hold year files (HDF5, a dataset
"fields" of float32 (T, C, H, W) at a fixed time step, its attribute "channels" naming the C
channels), ``stats/`` the training years' global means and standard deviations (1, C, 1, 1) and
time means (1, C, H, W). The grid is taken as latitude-longitude, top row at 90N: validation
weights each row by its area (cos latitude)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from utils.config import Config

log = logging.getLogger(__name__)

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


def channel_names(data_dir: Path, n_channels: int) -> tuple[str, ...]:
    """The channels' names: the training year files' "channels" attribute, else ERA5's for 20
    channels (NERSC's copy has no attribute), else c0, c1, ..."""
    paths = sorted(split_dir(data_dir, "train").glob("*.h5"))
    names: tuple[str, ...] = ()
    if paths:
        with h5py.File(paths[0], "r") as f:
            raw = f["fields"].attrs.get("channels", ()) if "fields" in f else ()
            names = tuple(n.decode() if isinstance(n, bytes) else str(n) for n in raw)
    if len(names) == n_channels:
        return names
    return CHANNELS if n_channels == len(CHANNELS) else tuple(f"c{i}" for i in range(n_channels))


class StatsAccumulator:
    """Running per-channel sums over the training years, in float64."""

    def __init__(self, n_channels: int, n_lat: int, n_lon: int) -> None:
        self.sum = np.zeros((n_channels, n_lat, n_lon))
        self.sumsq = np.zeros(n_channels)
        self.count = 0

    def add(self, block: np.ndarray) -> None:
        b = block.astype(np.float64)
        self.sum += b.sum(axis=0)
        self.sumsq += (b**2).sum(axis=(0, 2, 3))
        self.count += b.shape[0]

    def finish(self) -> dict[str, np.ndarray]:
        n_pix = self.sum.shape[1] * self.sum.shape[2]
        time_means = self.sum / self.count
        means = time_means.mean(axis=(1, 2))
        var = self.sumsq / (self.count * n_pix) - means**2
        return {
            "global_means": means.reshape(1, -1, 1, 1).astype(np.float32),
            "global_stds": np.sqrt(np.maximum(var, 0.0)).reshape(1, -1, 1, 1).astype(np.float32),
            "time_means": time_means[None].astype(np.float32),
        }


def write_stats(output_dir: Path, stats: StatsAccumulator) -> None:
    (Path(output_dir) / "stats").mkdir(parents=True, exist_ok=True)
    for name, array in stats.finish().items():
        np.save(Path(output_dir) / "stats" / STATS_FILES[name], array)


def write_data_set(output_dir: Path, splits: dict[str, dict[str, np.ndarray]],
                   channels: tuple[str, ...]) -> None:
    """A data set in the course's format from arrays: ``splits`` maps "train", "valid" and "test"
    to their years, each year's fields (T, C, H, W) at one time step apart; the statistics are the
    training years'. Each file is written under a temporary name and renamed when whole."""
    if not splits.get("train"):
        raise DataError("write_data_set needs at least one training year (splits['train']): the "
                        "statistics are the training years'")
    first = next(iter(splits["train"].values()))
    stats = StatsAccumulator(len(channels), *first.shape[2:])
    for split in SPLITS:
        for year, fields in splits.get(split, {}).items():
            if fields.ndim != 4 or fields.shape[1] != len(channels):
                raise DataError(f"{split} {year}: fields of shape {fields.shape}, expected (T, "
                                f"{len(channels)}, H, W) for the channels {', '.join(channels)}")
            path = split_dir(output_dir, split) / f"{year}.h5"
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".h5.tmp")
            with h5py.File(tmp, "w") as f:  # one sample per chunk, as the loaders read them
                f.create_dataset("fields", data=fields.astype(np.float32), chunks=(1, *fields.shape[1:]))
                f["fields"].attrs["channels"] = list(channels)
            tmp.replace(path)
            if split == "train":
                stats.add(fields)
    write_stats(output_dir, stats)


# ------------------------------------------------------------------ year files ---
log = logging.getLogger(__name__)

GENERATE_HINT = (
    "generate synthetic data with `make data` (or `python scripts/make_synthetic_era5.py "
    "--output_dir DIR --img_size H W`), or point --data_dir at the NERSC ERA5 copy "
    "(/pscratch/sd/s/shas1693/data/sc23_tutorial_data/downsampled on Perlmutter)"
)


class DataError(ValueError):
    """The data on disk does not match what the configuration asks for."""


@dataclass(frozen=True)
class YearFile:
    path: Path
    n_steps: int
    grid: tuple[int, int]


def split_dir(data_dir: Path, split: str) -> Path:
    return Path(data_dir) / split


def _check_year_file(path: Path, n_channels: int, img_size: tuple[int, int], dt: int) -> YearFile:
    try:
        f = h5py.File(path, "r")
    except OSError as err:
        raise DataError(f"{path} is not a readable HDF5 file ({err}); regenerate or re-copy it") from err
    with f:
        if "fields" not in f:
            raise DataError(f"{path} has no dataset 'fields' (found: {', '.join(f) or 'nothing'}); "
                            f"expected fields of shape (T, C, H, W)")
        shape, dtype = f["fields"].shape, f["fields"].dtype
    if dtype != np.float32:
        raise DataError(f"{path}: 'fields' holds {dtype}, not float32; convert the year files to float32 "
                        f"(for example with h5py: f2.create_dataset('fields', data=f['fields'][...]"
                        f".astype('float32')))")
    if len(shape) != 4:
        raise DataError(f"{path}: 'fields' has shape {shape}, expected (T, C, H, W)")
    t, c, h, w = shape
    if c != n_channels:
        raise DataError(f"{path} has {c} channels but n_in_channels is {n_channels}; "
                        f"use matching data or set n_in_channels")
    if h < img_size[0] or w < img_size[1]:
        raise DataError(f"{path} holds {h} x {w} fields, smaller than img_size "
                        f"{img_size[0]} x {img_size[1]}; lower img_size or regenerate the data")
    if t < dt + 1:
        raise DataError(f"{path} has {t} time steps, too few for dt={dt} (needs at least {dt + 1})")
    return YearFile(path, t, (h, w))


def find_year_files(data_dir: Path, split: str, cfg: Config) -> list[YearFile]:
    """The split's year files, checked against the configuration."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"data directory {data_dir} does not exist; {GENERATE_HINT}")
    folder = split_dir(data_dir, split)
    paths = sorted(folder.glob("*.h5")) if folder.is_dir() else []
    if not paths:
        raise DataError(f"no .h5 files in {folder}; {GENERATE_HINT}")
    files = [_check_year_file(p, cfg.model.n_in_channels, cfg.model.img_size, cfg.data.dt) for p in paths]
    grids = {f.grid for f in files}
    if len(grids) > 1:
        listed = ", ".join(f"{f.path.name} {f.grid[0]} x {f.grid[1]}" for f in files)
        raise DataError(f"the year files of {folder} hold different grids ({listed}); every year of a "
                        f"data set must be on the same grid")
    grid = grids.pop()
    if grid != tuple(cfg.model.img_size):
        log.info("%s holds %d x %d fields; training on their top-left %d x %d (img_size), cropped as the "
                 "original tutorial does", folder, *grid, *cfg.model.img_size)
    return files


def load_stats(data_dir: Path, n_channels: int) -> dict[str, np.ndarray]:
    """Global means and stds as float32 arrays of shape (1, C, 1, 1)."""
    stats = {}
    for name in ("global_means", "global_stds"):
        path = Path(data_dir) / "stats" / STATS_FILES[name]
        if not path.is_file():
            raise DataError(f"missing statistics file {path}; {GENERATE_HINT}")
        array = np.load(path).astype(np.float32)
        if array.shape != (1, n_channels, 1, 1):
            raise DataError(f"{path} has shape {array.shape}, expected (1, {n_channels}, 1, 1)")
        stats[name] = array
    for name, array in stats.items():
        if not np.isfinite(array).all():
            raise DataError(f"{data_dir}/stats/{STATS_FILES[name]} holds NaN or inf; recompute the "
                            f"statistics (make data does for the synthetic set)")
    if np.any(stats["global_stds"] <= 0):
        raise DataError(f"{data_dir}/stats/global_stds.npy has non-positive entries; recompute the "
                        f"statistics (make data does for the synthetic set)")
    return stats
