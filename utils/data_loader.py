"""ERA5 samples from HDF5 year files, and the PyTorch DataLoader over them.

A sample is (normalised fields[t], normalised fields[t + dt]) from one year file: pairs
never cross a year boundary. Sample indices run over the year files in sorted order.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import multiprocessing
import signal
import weakref

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from utils.config import Config
from utils.era5 import DataError, find_year_files, load_stats, split_dir
from utils.h5_steps import StepReader
from utils.signals import ignore_in_worker

log = logging.getLogger(__name__)


# --------------------------------------------------------------------- sampler ---
# Which samples each data-parallel rank takes, in which order, from which batch on.
class ShardedSampler(Sampler[int]):
    """Each of ``num_shards`` ranks takes every num_shards-th index of one shared order.

    The order is a permutation seeded by (seed, epoch), identical on every rank, when
    ``shuffle``; the natural order otherwise. With ``drop_last`` the order is cut to a
    multiple of num_shards * batch_size so every rank runs the same number of full
    batches; without it, ranks may hold one sample fewer (no padding, so validation
    sees each sample exactly once). ``start_batch`` skips the batches already trained
    in this epoch, for an exact resume from a mid-epoch checkpoint.
    """

    def __init__(self, n_samples: int, num_shards: int = 1, shard_id: int = 0,
                 shuffle: bool = False, seed: int = 0, drop_last: bool = False,
                 batch_size: int = 1) -> None:
        if not 0 <= shard_id < num_shards:
            raise ValueError(f"shard_id {shard_id} not in [0, {num_shards})")
        self.n_samples, self.num_shards, self.shard_id = n_samples, num_shards, shard_id
        self.shuffle, self.seed, self.drop_last, self.batch_size = shuffle, seed, drop_last, batch_size
        self.epoch = 0
        self.start_batch = 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start_batch = epoch, start_batch

    def epoch_order(self) -> list[int]:
        """This rank's indices for the current epoch, before skipping."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
            order = torch.randperm(self.n_samples, generator=g).tolist()
        else:
            order = list(range(self.n_samples))
        if self.drop_last:
            per_step = self.num_shards * self.batch_size
            order = order[: (len(order) // per_step) * per_step]
        return order[self.shard_id :: self.num_shards]

    def __iter__(self):
        return iter(self.epoch_order()[self.start_batch * self.batch_size :])

    def __len__(self) -> int:
        return max(0, len(self.epoch_order()) - self.start_batch * self.batch_size)

    def batches_per_epoch(self) -> int:
        """Batches of this rank in a whole epoch (the last one partial without drop_last)."""
        n = len(self.epoch_order())
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)


# ---------------------------------------------------------------- batch memory ---
# Batch tensors that the training loop hands back to the loader for reuse.
#
# A fresh batch tensor is fresh memory: the kernel maps and zeroes every 4 KB page on its
# first write, which for a 21 MB batch of the `small` config is a sizeable part of reading it
# (measured on a 2-core VM: prototypes of this loader writing into fresh batches reached
# 0.71-0.85x of a plain h5py read, writing into recycled ones 0.97x). A plain read loop
# never pays this, because the allocator hands it back the block it has just freed.
#
# Only the consumer knows when a batch is no longer needed, so it says so: the loader lends
# a batch with ``take``, and the training loop calls ``give_back`` once its step is over (the
# forward pass, the backward that read the saved tensors and the optimizer step are all
# done). A batch that is never given back is never reused: the pool keeps only a weak
# reference to it, and it is freed as usual when its last user lets go. Batches that leave
# the process (loader workers send theirs through shared memory) are not lent from here.
class BatchMemory:
    """Float32 CPU tensors of a few shapes, lent out and given back.

    ``take(shape)`` returns a tensor of that shape that was given back earlier, or a new one.
    ``give_back(tensor)`` returns a tensor that ``take`` lent (other tensors are ignored); at
    most ``keep`` given-back tensors wait for reuse.
    """

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._free: list[torch.Tensor] = []
        # data pointer -> weak reference to the tensor lent out from it
        self._lent: dict[int, weakref.ref[torch.Tensor]] = {}
        self.reused = self.made = 0

    def take(self, shape: tuple[int, ...]) -> torch.Tensor:
        shape = tuple(shape)
        for i, tensor in enumerate(self._free):
            if tuple(tensor.shape) == shape:
                del self._free[i]
                self.reused += 1
                break
        else:
            tensor = torch.empty(shape)
            self.made += 1
        if len(self._lent) > 64:  # batches never given back (validation's): forget the dead ones
            self._lent = {ptr: ref for ptr, ref in self._lent.items() if ref() is not None}
        self._lent[tensor.data_ptr()] = weakref.ref(tensor)
        return tensor

    def give_back(self, *tensors: torch.Tensor) -> None:
        """The caller no longer uses these tensors (nor views of them)."""
        for tensor in tensors:
            ref = self._lent.pop(tensor.data_ptr(), None)
            lent = None if ref is None else ref()
            if lent is None or lent.shape != tensor.shape or lent.is_shared():
                continue  # not one of ours (a view, a copy, a pinned or shared tensor)
            self._free.append(lent)
            del self._free[: -self.keep]


def shared_empty(shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised float32 tensor in shared memory, for a batch a loader worker makes.
    Sending a tensor to the training process moves it into shared memory first; moving it
    before anything is written into it copies untouched pages, where moving the finished
    batch would copy the whole batch again."""
    return torch.empty(shape).share_memory_()


# ---------------------------------------------------------------- the data set ---


class ERA5Dataset(Dataset):
    """Pairs (x_t, x_{t+dt}) normalised with the global statistics.

    Year files are opened lazily, per process (DataLoader workers included): h5py handles
    cannot be pickled into workers, and each worker needs its own.
    """

    def __init__(self, cfg: Config, split: str, limit: int | None = None) -> None:
        self.data_dir = cfg.data_path
        self.files = find_year_files(self.data_dir, split, cfg)
        stats = load_stats(self.data_dir, cfg.model.n_in_channels)
        self.means, self.stds = stats["global_means"][0], stats["global_stds"][0]  # (C, 1, 1)
        self.dt = cfg.data.dt
        self.img_size = cfg.model.img_size
        self.n_out = cfg.model.n_out_channels
        self.samples_per_file = [f.n_steps - self.dt for f in self.files]
        self.offsets = np.cumsum([0] + self.samples_per_file)
        total = int(self.offsets[-1])
        self.n_samples = min(total, limit) if limit is not None else total
        self._readers: dict[int, StepReader] = {}
        self._step: np.ndarray | None = None  # one whole step, for crops of larger grids
        self._memory = BatchMemory()
        log.info("%s: %d samples from %d files in %s", split, self.n_samples, len(self.files),
                 split_dir(self.data_dir, split))

    def __getstate__(self) -> dict:  # for workers that are spawned: no open files, no batches
        state = self.__dict__.copy()
        state["_readers"], state["_step"], state["_memory"] = {}, None, BatchMemory()
        return state

    def __len__(self) -> int:
        return self.n_samples

    def locate(self, index: int) -> tuple[int, int]:
        """Global sample index -> (file number, time step within that file)."""
        if not 0 <= index < self.n_samples:
            raise IndexError(f"sample {index} out of range [0, {self.n_samples})")
        file_no = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return file_no, index - int(self.offsets[file_no])

    def _reader(self, file_no: int) -> StepReader:
        if file_no not in self._readers:
            self._readers[file_no] = StepReader(self.files[file_no].path)
        return self._readers[file_no]

    def read_raw(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Un-normalised (fields[t], fields[t + dt]) cropped to img_size, float32."""
        file_no, t = self.locate(index)
        reader = self._reader(file_no)
        return reader.crop(t, *self.img_size), reader.crop(t + self.dt, *self.img_size)

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole batch at once (the DataLoader calls this instead of ``__getitem__`` per
        sample). Each step is read straight into its row of the (B, C, H, W) batch and
        normalised there while it is still in cache; the float32 operations are those of
        ``__getitem__`` (subtract the mean, then divide by the std), so the values are the
        same bits. In the process that trains (no loader workers), the batch tensors are
        reused once the training loop gives them back (``give_back``, BatchMemory above).
        """
        h, w = self.img_size
        shapes = (len(indices), len(self.means), h, w), (len(indices), self.n_out, h, w)
        if get_worker_info() is None:
            inp, tar = (self._memory.take(shape) for shape in shapes)
        else:  # a worker: the batch leaves through shared memory, where it is never recycled
            inp, tar = (shared_empty(shape) for shape in shapes)
        for i, index in enumerate(indices):
            file_no, t = self.locate(index)
            reader = self._reader(file_no)
            self._normalised_step(reader, t, inp[i])
            self._normalised_step(reader, t + self.dt, tar[i])
        return inp, tar

    def give_back(self, *batch: torch.Tensor) -> None:
        """The consumer is done with a batch of ``__getitems__``: its memory may be reused."""
        self._memory.give_back(*batch)

    def _normalised_step(self, reader: StepReader, t: int, row: torch.Tensor) -> None:
        """row (c, h, w) <- (fields[t, :c, :h, :w] - mean) / std.

        In numpy, which runs these on one thread: torch's in-place operations would use every
        thread torch has, and in the training process (no loader workers) fight the model's
        own threads for the cores (an oversubscribed machine slowed an epoch of loading 50
        times). The float32 results are the same bits either way."""
        c, h, w = row.shape
        out = row.numpy()
        if not reader.plain:  # compressed, other chunks...: h5py's slicing, which crops itself
            np.subtract(reader.fields[t, :c, :h, :w], self.means[:c], out=out)
        elif (c, h, w) == reader.step_shape:  # the row is the whole step: read it in place
            reader.read_step(t, out)
            np.subtract(out, self.means, out=out)
        else:  # a crop of a larger grid, or fewer target channels: via one whole step
            if self._step is None:
                self._step = np.empty(reader.step_shape, np.float32)
            step = reader.read_step(t, self._step)
            np.subtract(step[:c, :h, :w], self.means[:c], out=out)
        np.divide(out, self.stds[:c], out=out)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        # (x - mean) / std, in place on read_raw's fresh arrays (temporaries cost more CPU)
        inp, tar = self.read_raw(index)
        tar = tar[: self.n_out]
        inp -= self.means
        inp /= self.stds
        tar -= self.means[: self.n_out]
        tar /= self.stds[: self.n_out]
        return torch.from_numpy(inp), torch.from_numpy(np.ascontiguousarray(tar))


def already_batched(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The DataLoader's collate step for a dataset whose ``__getitems__`` makes the batch itself."""
    return batch


class Batches:
    """The PyTorch DataLoader behind the small interface the training loop needs.

    Other loaders (DALI) implement the same: ``set_epoch(epoch, start_batch)``,
    iteration over (input, target) batches, and ``batches_per_epoch``. This one also says which
    samples the batch it gave last holds (``last_indices``), for a cache keyed by sample.
    """

    def __init__(self, loader: DataLoader, sampler: ShardedSampler, pin_memory: bool = False) -> None:
        self.loader, self.sampler = loader, sampler
        self.batches_per_epoch = sampler.batches_per_epoch()
        # without workers the batches are pinned here (get_data_loader leaves it to us): the
        # loader's own memory then goes back for the next batch as soon as it is copied
        self.pin_here = pin_memory and loader.num_workers == 0
        self.last_indices: list[int] = []  # the dataset's sample indices of the last batch, in its rows

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.sampler.set_epoch(epoch, start_batch)

    def __iter__(self):
        # the DataLoader cuts the sampler's order into batches of batch_size, in order (workers
        # too hand them back in order): the i-th batch holds the i-th slice of that order
        order, size = list(self.sampler), self.loader.batch_size
        batches = self._pinned() if self.pin_here else iter(self.loader)
        for i, batch in enumerate(batches):
            self.last_indices = order[i * size:(i + 1) * size]
            yield batch

    def _pinned(self):
        for inp, tar in self.loader:
            pinned = inp.pin_memory(), tar.pin_memory()
            self.loader.dataset.give_back(inp, tar)
            yield pinned

    def give_back(self, inp: torch.Tensor, tar: torch.Tensor) -> None:
        """The training loop is done with this batch: its memory may hold the next one. Batches
        from loader workers arrive in shared memory and are not reused."""
        if self.loader.num_workers == 0:
            self.loader.dataset.give_back(inp, tar)


@atexit.register
def _stop_loader_workers() -> None:
    """Stop loader worker processes before multiprocessing's own exit handler waits for them.

    Workers ignore the stop signals (utils/signals.py), so that a SIGTERM to the whole process
    group lets the training process write its checkpoint. multiprocessing's exit handler
    ends daemonic children (DataLoader workers are) with SIGTERM and then waits for them,
    which would wait forever. atexit runs the last registered handler first, and this one is
    registered after torch imported multiprocessing, so it runs first and kills them (they
    only read data). The DataLoader's SIGCHLD handler would report that as a failed worker:
    at exit there is nothing left to report it to, so the default handler comes back first.
    """
    children = [p for p in multiprocessing.active_children() if p.daemon]
    if not children:
        return
    with contextlib.suppress(ValueError):  # not the main thread: leave the handler as it is
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for p in children:
        p.kill()
    for p in children:
        p.join(timeout=10)


def get_data_loader(cfg: Config, split: str, local_batch_size: int, train: bool,
                    num_shards: int = 1, shard_id: int = 0, pin_memory: bool = False
                    ) -> tuple[DataLoader, ERA5Dataset, ShardedSampler]:
    """DataLoader for one split. Training shuffles per epoch and drops the last partial
    global batch; validation keeps every sample in file order."""
    limit = cfg.data.limit_nsamples if train else cfg.data.limit_nsamples_val
    dataset = ERA5Dataset(cfg, split, limit)
    if train and len(dataset) < num_shards * local_batch_size:
        raise DataError(
            f"{split} has {len(dataset)} samples, fewer than one global batch "
            f"({num_shards} x {local_batch_size}); lower the batch size or add data"
        )
    sampler = ShardedSampler(len(dataset), num_shards, shard_id, shuffle=train, seed=cfg.run.seed,
                             drop_last=train, batch_size=local_batch_size)
    workers = cfg.data.num_data_workers
    loader = DataLoader(
        dataset,
        batch_size=local_batch_size,
        sampler=sampler,
        num_workers=workers,
        # workers: a thread of the DataLoader pins; without, Batches does (see there)
        pin_memory=pin_memory and workers > 0,
        persistent_workers=workers > 0,
        worker_init_fn=ignore_in_worker,
        collate_fn=already_batched,  # ERA5Dataset.__getitems__ returns whole batches
        drop_last=train,
        # its own generator: creating an iterator must not draw from the global RNG, or
        # dropout masks after a mid-epoch resume would differ from an uninterrupted run
        generator=torch.Generator().manual_seed(cfg.run.seed),
    )
    return loader, dataset, sampler
