"""The batch path of the loader: steps copied by byte offset, recycled batch memory, and the
same bits as the per-sample path (``ERA5Dataset.__getitem__``) for every storage layout."""

import logging
import shutil

import h5py
import numpy as np
import pytest
import torch

from tests.conftest import TEST_IMG
from utils import h5_steps
from utils.data_loader import Batches, BatchMemory, ERA5Dataset, get_data_loader
from utils.h5_steps import StepReader


def rewrite(src_dir, dst_dir, **create_kwargs):
    """A copy of a data set whose year files store 'fields' as ``create_kwargs`` say."""
    shutil.copytree(src_dir, dst_dir)
    file_kwargs = create_kwargs.pop("file_kwargs", {})
    for path in dst_dir.glob("*/*.h5"):
        with h5py.File(path, "r") as f:
            data = f["fields"][:]
        with h5py.File(path, "w", **file_kwargs) as f:
            f.create_dataset("fields", data=data, **create_kwargs)
    return dst_dir


def per_sample(ds, indices):
    """The batch as the per-sample path (``__getitem__``) makes it."""
    pairs = [ds[i] for i in indices]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def reference(ds, indices):
    """The batch made without the project's readers: h5py slicing, then (x - mean) / std in
    float32 (the operations the loader has always done, in this order)."""
    h, w = ds.img_size
    inputs, targets = [], []
    for index in indices:
        file_no, t = ds.locate(index)
        with h5py.File(ds.files[file_no].path, "r") as f:
            x, y = f["fields"][t, :, :h, :w], f["fields"][t + ds.dt, : ds.n_out, :h, :w]
        inputs.append((x - ds.means) / ds.stds)
        targets.append((y - ds.means[: ds.n_out]) / ds.stds[: ds.n_out])
    return torch.from_numpy(np.stack(inputs)), torch.from_numpy(np.stack(targets))


def assert_same_bits(batch, expected):
    for got, want in zip(batch, expected):
        assert got.shape == want.shape and torch.equal(got.view(torch.int32), want.view(torch.int32))


LAYOUTS = {  # storage of 'fields' -> whether steps are copied by byte offset
    "one chunk per step (make data)": ({}, True),
    "contiguous": ({"chunks": None}, True),
    "compressed": ({"chunks": (1, 20, *TEST_IMG), "compression": "gzip"}, False),
    "chunk of two steps": ({"chunks": (2, 20, *TEST_IMG)}, False),
    "user block": ({"file_kwargs": {"userblock_size": 512}}, False),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_gives_the_per_sample_bits(layout, data_dir, tmp_path, cfg_factory):
    kwargs, plain = LAYOUTS[layout]
    root = data_dir if not kwargs else rewrite(data_dir, tmp_path / "copy", **kwargs)
    ds = ERA5Dataset(cfg_factory(data_dir=str(root)), "train")
    indices = [0, 38, 39, 5, 77]  # both years, the last sample of the first
    expected = reference(ds, indices)
    assert_same_bits(ds.__getitems__(indices), expected)
    assert_same_bits(per_sample(ds, indices), expected)
    assert ds._reader(0).plain is plain


@pytest.mark.parametrize("overrides", [{"n_out_channels": 3}, {"img_size": (12, 20)}])
def test_fewer_target_channels_and_crops(overrides, cfg_factory):
    ds = ERA5Dataset(cfg_factory(**overrides), "valid")
    indices = [3, 0, 17]
    expected = reference(ds, indices)
    assert_same_bits(ds.__getitems__(indices), expected)
    assert_same_bits(per_sample(ds, indices), expected)


def test_reader_falls_back_when_offsets_disagree(data_dir, monkeypatch, caplog):
    real = h5_steps.plain_step_offsets
    monkeypatch.setattr(h5_steps, "plain_step_offsets", lambda fields: real(fields) + 4)
    with caplog.at_level(logging.WARNING):
        reader = StepReader(data_dir / "train" / "2016.h5")
    assert not reader.plain and "disagrees with h5py" in caplog.text
    np.testing.assert_array_equal(reader.crop(7, *TEST_IMG), reader.fields[7])
    reader.close()


def test_reader_without_chunk_queries_reads_through_h5py(data_dir, monkeypatch):
    def old_h5py(fields):
        raise AttributeError("'h5py.h5d.DatasetID' object has no attribute 'get_chunk_info_by_coord'")

    monkeypatch.setattr(h5_steps, "plain_step_offsets", old_h5py)
    reader = StepReader(data_dir / "train" / "2016.h5")
    assert not reader.plain
    np.testing.assert_array_equal(reader.crop(5, *TEST_IMG), reader.fields[5])
    reader.close()


def test_reading_by_offset_without_preadv(data_dir, monkeypatch):
    """Where os.preadv is missing (macOS before 11, say) the bytes come through os.pread."""
    monkeypatch.delattr(h5_steps.os, "preadv")
    reader = StepReader(data_dir / "train" / "2016.h5")
    assert reader.plain
    np.testing.assert_array_equal(reader.read_step(9, np.empty(reader.step_shape, np.float32)),
                                  reader.fields[9])
    reader.close()


def test_a_step_cut_short_is_an_error(data_dir, tmp_path):
    path = tmp_path / "2016.h5"
    shutil.copy(data_dir / "train" / "2016.h5", path)
    reader = StepReader(path)
    reader.offsets[3] = path.stat().st_size - 100  # as if the file ended inside step 3
    with pytest.raises(OSError, match="step 3 is cut short .*truncated"):
        reader.read_step(3, np.empty(reader.step_shape, np.float32))
    reader.close()


def test_batch_memory_is_reused_only_when_given_back():
    memory = BatchMemory()
    first = memory.take((2, 3))
    pointer = first.data_ptr()
    assert memory.take((2, 3)).data_ptr() != pointer  # `first` is lent out: a second tensor
    memory.give_back(first)
    assert memory.take((2, 3)).data_ptr() == pointer  # given back: reused
    assert memory.take((2, 3)).data_ptr() != pointer  # lent out again
    assert memory.take((4, 3)).data_ptr() != pointer  # another shape
    assert memory.reused == 1


def test_batch_memory_ignores_what_it_did_not_lend():
    memory = BatchMemory()
    batch = memory.take((2, 3))
    pointer = batch.data_ptr()
    memory.give_back(batch[1:], batch.clone(), torch.empty(2, 3))  # a view, a copy, a stranger
    assert memory.take((2, 3)).data_ptr() != pointer
    shared = memory.take((2, 3))
    pointer = shared.share_memory_().data_ptr()  # e.g. put on a multiprocessing queue
    memory.give_back(shared)
    assert memory.take((2, 3)).data_ptr() != pointer


def test_batch_memory_forgets_batches_that_are_never_given_back():
    """A consumer that keeps its batches, or drops them without a word, loses nothing: the pool
    holds only weak references, so a dropped batch is freed and none is handed out twice."""
    memory = BatchMemory()
    kept = [memory.take((2, 3)) for _ in range(100)]
    assert len({t.data_ptr() for t in kept}) == 100
    del kept
    memory.take((2, 3))
    assert memory.reused == 0 and memory.made == 101 and len(memory._lent) == 1  # the dead forgotten


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_kept_by_the_consumer_stay_intact(workers, cfg_factory):
    """Recycling must not overwrite a batch that is still held: collect a whole epoch, then
    compare every batch with the per-sample path (with workers, batches come through shared
    memory and are never recycled)."""
    cfg = cfg_factory(num_data_workers=workers)
    loader, ds, sampler = get_data_loader(cfg, "train", 4, train=True)
    sampler.set_epoch(0)
    kept = list(loader)
    order = list(sampler)
    for b, batch in enumerate(kept):
        assert_same_bits(batch, reference(ds, order[4 * b : 4 * (b + 1)]))


def test_the_training_process_reuses_the_batches_it_gives_back(cfg_factory):
    loader, ds, sampler = get_data_loader(cfg_factory(), "train", 4, train=True)
    batches = Batches(loader, sampler)
    batches.set_epoch(0)
    for batch in batches:
        batches.give_back(*batch)
    n = sampler.batches_per_epoch()
    assert ds._memory.made == 2 and ds._memory.reused == 2 * n - 2


def test_the_trainer_gives_its_training_batches_back(cfg_factory, tmp_path):
    from training.context import RunContext
    from training.trainer import Trainer

    trainer = Trainer(cfg_factory(num_iters=3), RunContext(torch.device("cpu"), tmp_path / "run"), 4)
    trainer.train_epoch(0, 0)
    memory = trainer.train_data.loader.dataset._memory
    assert memory.made == 2 and memory.reused == 6  # 4 batches read (the 4th ends the loop), 8 tensors


def test_loader_workers_make_batches_in_shared_memory_and_do_not_recycle(cfg_factory, monkeypatch):
    """A worker's batches leave through shared memory (made there, they are not copied into it),
    where the worker cannot see their users."""
    from utils import data_loader

    ds = ERA5Dataset(cfg_factory(), "train")
    monkeypatch.setattr(data_loader, "get_worker_info", lambda: object())  # as inside a worker
    for _ in range(3):
        batch = ds.__getitems__([0, 1])
        assert all(t.is_shared() for t in batch)
    assert_same_bits(batch, reference(ds, [0, 1]))
    assert ds._memory.made == ds._memory.reused == 0


def test_pinned_batches_give_the_loader_its_memory_back_at_once(cfg_factory, monkeypatch):
    """On a GPU without workers, batches are pinned (copied into page-locked memory) by Batches,
    which hands the loader's own batch back right away: the next batch reuses it. Pinning is
    faked here (a CPU has no page-locked memory to give)."""
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: pinned.append(t.clone()) or pinned[-1])
    loader, ds, sampler = get_data_loader(cfg_factory(), "train", 4, train=True, pin_memory=True)
    assert not loader.pin_memory  # left to Batches
    batches = Batches(loader, sampler, pin_memory=True)
    batches.set_epoch(0)
    got = list(batches)  # the consumer keeps every (pinned) batch: they must stay intact
    n = sampler.batches_per_epoch()
    assert len(got) == n and len(pinned) == 2 * n and ds._memory.made == 2
    order = list(sampler)
    for b, batch in enumerate(got):
        assert_same_bits(batch, reference(ds, order[4 * b : 4 * (b + 1)]))
