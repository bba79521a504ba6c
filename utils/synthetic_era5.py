"""A synthetic ERA5-like data set in the exact layout of the NERSC tutorial data (`generate`;
scripts/make_synthetic_era5.py is its command line, tests/conftest.py makes the tests' data).

DATA_DIR/{train,valid,test}/<year>.h5 hold the dataset "fields" (T, 20, H, W) float32,
6-hourly, one sample per HDF5 chunk, with the channel names in the attribute
"channels"; DATA_DIR/stats/ holds global means and stds (1, C, 1, 1) and time means
(1, C, H, W) over the training years.

The weather is made of a few large-scale waves, each at its own latitude, travelling
eastward at the speed of the jet at that latitude; winds follow the wave's stream
function (geostrophic-like), temperatures follow the meridional wind, humidity and water
vapour follow temperature; a seasonal cycle moves the temperature and geopotential
gradients with the sun's declination, and the sun moves 90 degrees west every 6-hour step
so 2 m temperature has a diurnal bump. The 6-hour step is therefore predictable from
the current state, and better than by persistence. Everything is a function of the
global step index and the seed, so files are continuous across years and identical
whatever the block size.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from utils.era5 import CHANNELS, HOURS_PER_STEP, StatsAccumulator, latitudes, longitudes, write_stats

log = logging.getLogger(__name__)

N_WAVES = 8
BLOCK_BYTES = 256 * 2**20  # samples written per block: about this many bytes


@dataclass(frozen=True)
class Waves:
    """Random, seed-determined parameters of the travelling waves and the terrain."""

    wavenumber: np.ndarray  # (K,) zonal wavenumber m
    lat0: np.ndarray  # (K,) centre latitude, degrees
    width: np.ndarray  # (K,) latitudinal half width, degrees
    amplitude: np.ndarray  # (K,) stream function amplitude
    phase: np.ndarray  # (K,)
    period: np.ndarray  # (K,) amplitude modulation period, steps
    mod_phase: np.ndarray  # (K,)
    terrain: np.ndarray  # (H, W) metres


def jet_speed_deg_per_step(lat: np.ndarray) -> np.ndarray:
    """Eastward drift in degrees of longitude per 6 h: fast near 40 degrees, slow in the tropics."""
    return 2.0 + 10.0 * np.exp(-(((np.abs(lat) - 40.0) / 15.0) ** 2))


def make_waves(seed: int, n_lat: int, n_lon: int) -> Waves:
    rng = np.random.default_rng(seed)
    k = N_WAVES
    lat, lon = np.radians(latitudes(n_lat))[:, None], np.radians(longitudes(n_lon))[None, :]
    terrain = np.zeros((n_lat, n_lon))
    for _ in range(4):  # a few smooth "continents"
        m, n = rng.integers(1, 4), rng.integers(1, 4)
        terrain += np.cos(m * lon + rng.uniform(0, 2 * np.pi)) * np.cos(n * lat + rng.uniform(0, 2 * np.pi))
    terrain = 1500.0 * np.clip(terrain, 0.0, None)
    return Waves(
        wavenumber=rng.integers(2, 7, size=k).astype(float),
        lat0=rng.uniform(-60.0, 60.0, size=k),
        width=rng.uniform(12.0, 25.0, size=k),
        amplitude=rng.uniform(0.6, 1.2, size=k),
        phase=rng.uniform(0, 2 * np.pi, size=k),
        period=rng.uniform(60.0, 240.0, size=k),
        mod_phase=rng.uniform(0, 2 * np.pi, size=k),
        terrain=terrain,
    )


def stream_function(w: Waves, steps: np.ndarray, lat: np.ndarray, lon: np.ndarray) -> np.ndarray:
    """psi(t, lat, lon): each wave travels rigidly at the jet speed of its own latitude."""
    t = steps[:, None, None].astype(float)
    lat_g, lon_g = lat[None, :, None], np.radians(lon)[None, None, :]
    psi = np.zeros((len(steps), len(lat), len(lon)))
    for k in range(len(w.wavenumber)):
        speed = np.radians(jet_speed_deg_per_step(w.lat0[k]))
        amp = w.amplitude[k] * (0.7 + 0.3 * np.sin(2 * np.pi * t / w.period[k] + w.mod_phase[k]))
        envelope = np.exp(-(((lat_g - w.lat0[k]) / w.width[k]) ** 2))
        psi += amp * envelope * np.cos(w.wavenumber[k] * (lon_g - speed * t) + w.phase[k])
    return psi


def gradients(psi: np.ndarray, lat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Geostrophic-like winds (u, v) = (-dpsi/dy, dpsi/dx) per radian of arc."""
    n_lon = psi.shape[-1]
    dlon = 2 * np.pi / n_lon
    dpsi_dlon = (np.roll(psi, -1, axis=-1) - np.roll(psi, 1, axis=-1)) / (2 * dlon)
    dpsi_dlat = np.gradient(psi, np.radians(lat), axis=-2)
    coslat = np.maximum(np.cos(np.radians(lat)), 0.2)[None, :, None]
    return -dpsi_dlat, dpsi_dlon / coslat


def solar_geometry(steps: np.ndarray, lat: np.ndarray, lon: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Declination (t,) in degrees and cosine of the solar zenith angle (t, lat, lon)."""
    hours = steps.astype(float) * HOURS_PER_STEP
    day_of_year = hours / 24.0
    decl = 23.44 * np.sin(2 * np.pi * (day_of_year - 80.0) / 365.25)
    sun_lon = np.radians(180.0 - 15.0 * (hours % 24.0))  # 90 degrees west per 6 h
    d = np.radians(decl)[:, None, None]
    phi, lam = np.radians(lat)[None, :, None], np.radians(lon)[None, None, :]
    cosz = np.sin(phi) * np.sin(d) + np.cos(phi) * np.cos(d) * np.cos(lam - sun_lon[:, None, None])
    return decl, cosz


def fields_at(w: Waves, steps: np.ndarray, n_lat: int, n_lon: int, seed: int) -> np.ndarray:
    """All 20 channels for the global step indices ``steps``: (T, 20, H, W) float32."""
    lat, lon = latitudes(n_lat), longitudes(n_lon)
    psi = stream_function(w, steps, lat, lon)
    u_wave, v_wave = gradients(psi, lat)
    decl, cosz = solar_geometry(steps, lat, lon)
    # seasonal background: gradients follow the sun's declination
    shifted = np.cos(np.radians(lat[None, :, None] - 0.4 * decl[:, None, None]))
    lat_g = lat[None, :, None]
    jet = np.exp(-(((np.abs(lat_g) - 40.0) / 12.0) ** 2))
    highs = 800.0 * np.exp(-(((np.abs(lat_g) - 30.0) / 10.0) ** 2))
    lows = -1200.0 * np.exp(-(((np.abs(lat_g) - 60.0) / 10.0) ** 2))
    terrain = w.terrain[None]

    out = {}
    out["u500"] = 25.0 * jet + 3.0 * u_wave
    out["v500"] = 3.0 * v_wave
    out["u850"] = 12.0 * jet + 2.2 * u_wave
    out["v850"] = 2.2 * v_wave
    out["u1000"] = 6.0 * jet + 1.6 * u_wave
    out["v1000"] = 1.6 * v_wave
    out["u10m"] = 5.0 * jet + 1.2 * u_wave
    out["v10m"] = 1.2 * v_wave
    out["msl"] = 101325.0 + highs + lows + 900.0 * psi
    out["z1000"] = 0.81 * (out["msl"] - 100400.0)
    out["z850"] = 12500.0 + 2000.0 * shifted + 800.0 * psi
    out["z500"] = 49500.0 + 8000.0 * shifted + 1500.0 * psi
    out["z50"] = 195000.0 + 8000.0 * shifted + 400.0 * psi
    out["sp"] = out["msl"] * np.exp(-terrain / 8400.0)
    t_background = 230.0 + 70.0 * shifted
    # poleward flow brings warm air: v times the poleward temperature drop, ~sin(latitude)
    warm_advection = 0.6 * out["v850"] * np.sin(np.radians(lat_g))
    diurnal = 6.0 * (np.maximum(cosz, 0.0) - 0.3)
    out["t2m"] = t_background - 0.0065 * terrain + warm_advection + diurnal
    out["t850"] = t_background - 12.0 + warm_advection + 0.2 * diurnal
    out["t500"] = t_background - 33.0 + 0.5 * warm_advection
    moist = np.tanh(warm_advection / 4.0)
    out["r850"] = np.clip(70.0 + 20.0 * moist, 0.0, 100.0)
    out["r500"] = np.clip(50.0 + 25.0 * moist, 0.0, 100.0)
    out["tcwv"] = 22.0 * np.exp(0.06 * (out["t2m"] - 288.0)) * out["r850"] / 70.0

    data = np.stack([out[c] for c in CHANNELS], axis=1)
    scale = np.array([NOISE[c] for c in CHANNELS])[None, :, None, None]
    for i, step in enumerate(steps):  # noise from (seed, step): same whatever the block size
        rng = np.random.default_rng([seed, int(step)])
        data[i] += scale[0] * rng.standard_normal(data.shape[1:])
    return data.astype(np.float32)


# small, spatially white noise per channel (units of the channel)
NOISE = {
    "u10m": 0.3, "v10m": 0.3, "t2m": 0.3, "sp": 30.0, "msl": 30.0, "t850": 0.2,
    "u1000": 0.3, "v1000": 0.3, "z1000": 25.0, "u850": 0.3, "v850": 0.3, "z850": 25.0,
    "u500": 0.4, "v500": 0.4, "z500": 30.0, "t500": 0.2, "z50": 50.0, "r500": 1.0,
    "r850": 1.0, "tcwv": 0.3,
}


class Progress:
    """A log line at most every 10 s, and at the end: 'train/2016.h5  512/1460 samples'."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.start = label, total, time.time()
        self.last = self.start

    def update(self, done: int) -> None:
        now = time.time()
        if done == self.total or now - self.last >= 10:
            self.last = now
            rate = done / max(now - self.start, 1e-9)
            log.info("%16s %6d/%d samples (%.1f/s)", self.label, done, self.total, rate)


def write_year(path: Path, waves: Waves, first_step: int, n_samples: int, n_lat: int,
               n_lon: int, seed: int, stats: StatsAccumulator | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    block = max(1, BLOCK_BYTES // (4 * len(CHANNELS) * n_lat * n_lon))
    progress = Progress(f"{path.parent.name}/{path.name}", n_samples)
    tmp = path.with_suffix(".h5.tmp")
    with h5py.File(tmp, "w") as f:
        dset = f.create_dataset(
            "fields", shape=(n_samples, len(CHANNELS), n_lat, n_lon), dtype="float32",
            chunks=(1, len(CHANNELS), n_lat, n_lon),
        )
        dset.attrs["channels"] = list(CHANNELS)
        dset.attrs["hours_per_step"] = HOURS_PER_STEP
        dset.attrs["first_global_step"] = first_step
        for start in range(0, n_samples, block):
            steps = np.arange(first_step + start, first_step + min(start + block, n_samples))
            data = fields_at(waves, steps, n_lat, n_lon, seed)
            dset[start : start + len(steps)] = data
            if stats is not None:
                stats.add(data)
            progress.update(start + len(steps))
    tmp.replace(path)


def generate(output_dir: Path, img_size: tuple[int, int], samples_per_year: int,
             years: dict[str, list[int]], seed: int) -> None:
    """Write every split's year files and the stats of the training years."""
    n_lat, n_lon = img_size
    waves = make_waves(seed, n_lat, n_lon)
    first_year = min(y for ys in years.values() for y in ys)
    stats = StatsAccumulator(len(CHANNELS), n_lat, n_lon)
    for split in ("train", "valid", "test"):
        for year in years[split]:
            first_step = (year - first_year) * samples_per_year  # continuous across years
            write_year(output_dir / split / f"{year}.h5", waves, first_step, samples_per_year,
                       n_lat, n_lon, seed, stats if split == "train" else None)
    write_stats(output_dir, stats)
