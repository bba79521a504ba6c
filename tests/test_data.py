"""Synthetic ERA5 generator and the dataset / sampler over it."""

import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch

from tests.conftest import REPO, TEST_IMG, TEST_SAMPLES_PER_YEAR, subprocess_env
from utils import synthetic_era5 as gen
from utils.data_loader import DataError, ERA5Dataset, ShardedSampler, get_data_loader
from utils.era5 import CHANNELS, channel_index, latitudes


def fields(path):
    with h5py.File(path, "r") as f:
        return f["fields"][:]


def test_generator_layout(data_dir):
    for split, years in (("train", [2016, 2017]), ("valid", [2018]), ("test", [2019])):
        assert sorted(p.name for p in (data_dir / split).glob("*.h5")) == [f"{y}.h5" for y in years]
    with h5py.File(data_dir / "train" / "2016.h5", "r") as f:
        d = f["fields"]
        assert d.shape == (TEST_SAMPLES_PER_YEAR, 20, *TEST_IMG) and d.dtype == np.float32
        assert d.chunks == (1, 20, *TEST_IMG)  # one sample per chunk
        assert list(d.attrs["channels"]) == list(CHANNELS)
    assert np.load(data_dir / "stats" / "global_means.npy").shape == (1, 20, 1, 1)
    assert np.load(data_dir / "stats" / "global_stds.npy").shape == (1, 20, 1, 1)
    assert np.load(data_dir / "stats" / "time_means.npy").shape == (1, 20, *TEST_IMG)


def test_stats_are_those_of_the_training_years(data_dir):
    train = np.concatenate([fields(p) for p in sorted((data_dir / "train").glob("*.h5"))]).astype(np.float64)
    means = np.load(data_dir / "stats" / "global_means.npy").ravel()
    stds = np.load(data_dir / "stats" / "global_stds.npy").ravel()
    np.testing.assert_allclose(means, train.mean(axis=(0, 2, 3)), rtol=1e-5)
    np.testing.assert_allclose(stds, train.std(axis=(0, 2, 3)), rtol=1e-3)
    np.testing.assert_allclose(np.load(data_dir / "stats" / "time_means.npy")[0], train.mean(axis=0),
                               rtol=1e-5)


def test_deterministic_and_independent_of_block_size(tmp_path, monkeypatch):
    years = {"train": [2000, 2001], "valid": [2002], "test": [2003]}
    gen.generate(tmp_path / "a", (8, 16), 12, years, seed=3)
    monkeypatch.setattr(gen, "BLOCK_BYTES", 5 * 20 * 8 * 16 * 4)  # 5 samples per block
    gen.generate(tmp_path / "b", (8, 16), 12, years, seed=3)
    gen.generate(tmp_path / "c", (8, 16), 12, years, seed=4)
    a, b, c = (fields(tmp_path / x / "train" / "2001.h5") for x in "abc")
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)


def test_continuous_across_year_files(data_dir):
    """The first step of 2017 is the step after the last of 2016: the same function of time."""
    waves = gen.make_waves(1, *TEST_IMG)
    last_2016 = fields(data_dir / "train" / "2016.h5")[-1]
    first_2017 = fields(data_dir / "train" / "2017.h5")[0]
    expected = gen.fields_at(waves, np.array([TEST_SAMPLES_PER_YEAR - 1, TEST_SAMPLES_PER_YEAR]),
                             *TEST_IMG, seed=1)
    np.testing.assert_array_equal(expected[0], last_2016)
    np.testing.assert_array_equal(expected[1], first_2017)


def test_plausible_atmosphere(tmp_path):
    h, w = 32, 64
    waves = gen.make_waves(0, h, w)
    x = gen.fields_at(waves, np.arange(8), h, w, seed=0).astype(np.float64)
    mean = {c: x[:, channel_index(c)].mean() for c in CHANNELS}
    assert 255 < mean["t2m"] < 295 and 50_000 < mean["z500"] < 60_000
    assert 90_000 < mean["sp"] < 101_000 and 100_000 < mean["msl"] < 102_500
    assert x[:, channel_index("r850")].min() >= 0 and x[:, channel_index("r850")].max() <= 100
    # winds follow geopotential: v500 ~ d(z500)/dx, so they are strongly correlated
    z = x[:, channel_index("z500")]
    dz_dx = np.roll(z, -1, axis=-1) - np.roll(z, 1, axis=-1)
    v = x[:, channel_index("v500")]
    assert np.corrcoef(dz_dx.ravel(), v.ravel())[0, 1] > 0.9
    # diurnal cycle: the warm anomaly of t2m moves 90 degrees of longitude west per step
    t2m = x[:, channel_index("t2m")]
    tropics = t2m[:, np.abs(latitudes(h)) < 20].mean(axis=1)  # (T, W)
    anomaly = tropics - tropics.mean(axis=0)
    lon = np.radians(np.arange(w) * 360 / w)
    warm_lon = np.degrees(np.angle((anomaly * np.exp(1j * lon)).sum(axis=-1)))  # first harmonic
    shift = (warm_lon[1:] - warm_lon[:-1]) % 360
    assert np.all(np.abs(shift - 270) <= 30)  # 90 degrees west == 270 east


def test_waves_drift_eastward():
    h, w = 32, 64
    waves = gen.make_waves(0, h, w)
    psi = gen.stream_function(waves, np.array([0, 1]), latitudes(h), np.arange(w) * 360 / w)
    # best longitude shift of step 1 onto step 0, in grid columns (east positive)
    errors = [np.square(np.roll(psi[0], s, axis=-1) - psi[1]).sum() for s in range(-8, 9)]
    assert 0 < int(np.argmin(errors)) - 8 <= 4


def test_dataset_indexing_never_crosses_years(cfg_factory, data_dir):
    for dt in (1, 3):
        ds = ERA5Dataset(cfg_factory(dt=dt), "train")
        per_year = TEST_SAMPLES_PER_YEAR - dt
        assert len(ds) == 2 * per_year
        assert ds.locate(0) == (0, 0)
        assert ds.locate(per_year - 1) == (0, per_year - 1)
        assert ds.locate(per_year) == (1, 0)  # first sample of the second year
        inp, tar = ds.read_raw(per_year - 1)
        year = fields(data_dir / "train" / "2016.h5")
        np.testing.assert_array_equal(inp, year[per_year - 1])
        np.testing.assert_array_equal(tar, year[per_year - 1 + dt])
    with pytest.raises(IndexError):
        ds.locate(len(ds))


def test_sample_is_normalised(cfg_factory, data_dir):
    ds = ERA5Dataset(cfg_factory(), "valid")
    inp, tar = ds[5]
    raw = fields(data_dir / "valid" / "2018.h5")
    means = np.load(data_dir / "stats" / "global_means.npy")[0]
    stds = np.load(data_dir / "stats" / "global_stds.npy")[0]
    torch.testing.assert_close(inp, torch.from_numpy((raw[5] - means) / stds))
    torch.testing.assert_close(tar, torch.from_numpy((raw[6] - means) / stds))


def test_limits_and_out_channels(cfg_factory):
    cfg = cfg_factory(limit_nsamples=10, limit_nsamples_val=7, n_out_channels=3)
    assert len(ERA5Dataset(cfg, "train", cfg.limit_nsamples)) == 10
    loader, ds, _ = get_data_loader(cfg, "valid", 4, train=False)
    assert len(ds) == 7
    sizes = [inp.shape[0] for inp, _ in loader]
    assert sizes == [4, 3]  # validation keeps the last partial batch
    _, tar = ds[0]
    assert tar.shape == (3, *TEST_IMG)


def test_train_loader_shuffles_per_epoch_and_drops_last(cfg_factory):
    loader, ds, sampler = get_data_loader(cfg_factory(limit_nsamples=10), "train", 4, train=True)
    sampler.set_epoch(0)
    first = list(sampler)
    sampler.set_epoch(1)
    second = list(sampler)
    assert len(first) == 8 and len(second) == 8 and first != second
    assert [inp.shape[0] for inp, _ in loader] == [4, 4]


def test_sampler_shards_are_disjoint_and_resumable():
    shards = [ShardedSampler(23, 3, r, shuffle=True, seed=5, drop_last=True, batch_size=2) for r in range(3)]
    for s in shards:
        s.set_epoch(4)
    orders = [list(s) for s in shards]
    flat = sum(orders, [])
    assert len(flat) == len(set(flat)) == 18  # 23 cut to 3 ranks x 2 x 3 batches
    shards[1].set_epoch(4, start_batch=2)
    assert list(shards[1]) == orders[1][4:]
    val = [list(ShardedSampler(23, 3, r)) for r in range(3)]
    assert sorted(sum(val, [])) == list(range(23))  # validation: every sample exactly once


def _write(path, shape):
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        f.create_dataset("fields", data=np.zeros(shape, np.float32))


@pytest.mark.parametrize("setup, message", [
    (lambda d: None, r"does not exist; generate synthetic data with `make data`"),
    (lambda d: (d / "train").mkdir(parents=True), r"no \.h5 files in .*train"),
    (lambda d: _write(d / "train" / "2016.h5", (5, 19, 16, 32)), r"has 19 channels but n_in_channels is 20"),
    (lambda d: _write(d / "train" / "2016.h5", (5, 20, 8, 32)), r"8 x 32 fields, smaller than img_size"),
    (lambda d: _write(d / "train" / "2016.h5", (1, 20, 16, 32)), r"has 1 time steps, too few for dt=1"),
])
def test_data_errors(tmp_path, cfg_factory, setup, message):
    root = tmp_path / "bad"
    setup(root)
    with pytest.raises(DataError, match=message):
        ERA5Dataset(cfg_factory(data_dir=str(root)), "train")


def test_missing_fields_dataset_and_stats(tmp_path, cfg_factory):
    root = tmp_path / "bad"
    (root / "train").mkdir(parents=True)
    with h5py.File(root / "train" / "2016.h5", "w") as f:
        f.create_dataset("data", data=np.zeros(3))
    with pytest.raises(DataError, match="has no dataset 'fields'"):
        ERA5Dataset(cfg_factory(data_dir=str(root)), "train")
    _write(root / "train" / "2016.h5", (5, 20, 16, 32))
    with pytest.raises(DataError, match="missing statistics file .*global_means.npy"):
        ERA5Dataset(cfg_factory(data_dir=str(root)), "train")


def test_too_few_samples_for_one_batch(cfg_factory):
    with pytest.raises(DataError, match="fewer than one global batch"):
        get_data_loader(cfg_factory(limit_nsamples=3), "train", 4, train=True)


def test_make_data_regenerates_when_the_generator_changes(tmp_path):
    """`make data` (and so `make train`) rebuilds demo data older than its generator."""
    (tmp_path / "stats").mkdir()
    (tmp_path / "stats" / "global_stds.npy").touch()  # newer than every file of the repository

    def dry_run(*extra):
        return subprocess.run(["make", "-n", *extra, f"DATA={tmp_path}", "data"], cwd=REPO,
                              capture_output=True, text=True, check=True).stdout

    assert "make_synthetic_era5.py" not in dry_run()
    for changed in ("scripts/make_synthetic_era5.py", "utils/synthetic_era5.py", "utils/era5.py"):
        assert "make_synthetic_era5.py" in dry_run("-W", changed), changed


def test_a_loader_with_workers_alive_at_exit_does_not_hang(data_dir):
    """Workers ignore SIGTERM (so a group signal lets training checkpoint); multiprocessing's exit
    handler would SIGTERM them and wait forever. The script keeps the loader until exit."""
    code = f"""
import sys
from tests.conftest import make_cfg
from utils.data_loader import get_data_loader
cfg = make_cfg({str(data_dir)!r}, {str(data_dir)!r}, num_data_workers=2)
loader, _, _ = get_data_loader(cfg, "train", 4, True)
next(iter(loader))
print("iterated", flush=True)
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=subprocess_env(),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "iterated", result.stderr
    assert "Traceback" not in result.stderr and "exited unexpectedly" not in result.stderr, result.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc/self/task")
def test_loader_work_stays_on_one_thread_whatever_torch_has(tmp_path):
    """Loading in the training process (0 workers) with torch allowed 8 threads: normalising a
    batch must not start torch's thread pool (on a busy machine those threads fight the model's
    for the cores). A 64 x 128 grid makes each step large enough for torch to go parallel, and
    the script shows that a torch operation of the same size does start the pool."""
    code = f"""
import os, pathlib, torch
from utils.synthetic_era5 import generate
from tests.conftest import make_cfg
from utils.data_loader import get_data_loader
torch.set_num_threads(8)
years = {{"train": [2016], "valid": [2017], "test": [2018]}}
generate(pathlib.Path({str(tmp_path)!r}), (64, 128), 6, years, seed=0)
cfg = make_cfg({str(tmp_path)!r}, {str(tmp_path)!r}, img_size=(64, 128), num_data_workers=0)
threads = lambda: len(os.listdir("/proc/self/task"))
before = threads()
loader, _, _ = get_data_loader(cfg, "train", 2, True)
for _ in loader:
    pass
after = threads()
torch.ones(20, 64, 128).sub_(1.0)  # what the loader did before
print(before, after, threads())
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=subprocess_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    before, after, with_torch_op = map(int, result.stdout.split())
    assert after == before, f"loading started {after - before} threads"
    assert with_torch_op > after, "torch did not go parallel here: the test cannot see the loader's threads"


def test_the_tests_make_their_data_with_the_library():
    """The generator is library code (utils/synthetic_era5.py); the script is its command line only,
    so no test imports scripts/ to make data."""
    import ast

    for path in sorted((REPO / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                assert not any(n.endswith("make_synthetic_era5") for n in names), path.name


def test_a_data_set_of_another_grid_and_channel_count_trains(tmp_path):
    """A learner's own fields in the course's format (``write_data_set``): 3 named channels on a
    16 x 32 grid, a pattern moving east one column a step (a forecast to learn). The Trainer
    learns it (the validation loss falls) and validation reports the channels by their names."""
    import json

    from tests.conftest import make_cfg
    from training.context import RunContext
    from training.trainer import Trainer
    from utils.era5 import channel_names, write_data_set

    pattern = np.random.default_rng(0).standard_normal((3, 16, 32)).astype(np.float32) + 2.0
    year = lambda start, steps: np.stack([np.roll(pattern, start + t, axis=-1) for t in range(steps)])
    splits = {"train": {"2000": year(0, 32)}, "valid": {"2001": year(32, 8)}, "test": {"2002": year(40, 4)}}
    write_data_set(tmp_path / "data", splits, ("p", "q", "r"))
    assert channel_names(tmp_path / "data", 3) == ("p", "q", "r")
    cfg = make_cfg(tmp_path / "data", tmp_path / "logs", img_size=(16, 32), n_in_channels=3, n_out_channels=3,
                   num_iters=28, lr=3e-3)
    trainer = Trainer(cfg, RunContext(device=torch.device("cpu"), run_dir=tmp_path / "run"), 4)
    trainer.fit()
    epochs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(epochs) == 4 and all(list(e["rmse"]) == ["p", "q", "r"] for e in epochs)  # 7 steps each
    assert epochs[-1]["val_loss"] < 0.9 * epochs[0]["val_loss"], [e["val_loss"] for e in epochs]
    with pytest.raises(DataError, match=r"fields of shape \(4, 2, 16, 32\), expected \(T, 3, H, W\)"):
        write_data_set(tmp_path / "bad", {"train": {"2000": year(0, 4)[:, :2]}}, ("p", "q", "r"))
    with pytest.raises(DataError, match="needs at least one training year"):
        write_data_set(tmp_path / "bad", {"valid": {"2001": year(0, 4)}}, ("p", "q", "r"))
