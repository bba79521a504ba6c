"""ERA5 batches from an NVIDIA DALI pipeline, a drop-in for the PyTorch DataLoader.

The samples and their order are those of the PyTorch loader: the same
:class:`~utils.data_loader.ERA5Dataset` reads the raw fields and the same
:class:`~utils.data_loader.ShardedSampler` decides which indices this rank takes in
which epoch. DALI adds a pool of Python worker processes that read whole batches in
parallel (a *parallel external source*) and does the normalisation inside the pipeline:
on the GPU when there is one (the batch is uploaded and normalised there), on the CPU
otherwise (``device_id=None``).

DALI is imported only when this loader is used, so everything else works without it.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from utils import device as dev
from utils.config import Config
from utils.data_loader import DataError, ERA5Dataset, ShardedSampler, get_data_loader
from utils.signals import ignore_stop_signals

log = logging.getLogger(__name__)

INSTALL_HINT = ("NVIDIA DALI is not installed; install it with `pip install --extra-index-url "
                "https://pypi.nvidia.com nvidia-dali-cuda120` or use --data_loader_config pytorch")


def import_dali() -> Any:
    try:
        import nvidia.dali as dali
    except ImportError as err:
        raise DataError(INSTALL_HINT) from err
    return dali


class BatchSource:
    """The callable DALI's workers run: batch number of a DALI epoch -> raw arrays.

    DALI counts its own epochs from 0 for each pipeline; DALI epoch k is training epoch
    ``first_epoch + k``, and only the first one skips ``start_batch`` batches (resume).
    Workers get a copy of this object, so everything it needs is in it.
    """

    def __init__(self, dataset: ERA5Dataset, sampler: ShardedSampler, first_epoch: int,
                 start_batch: int) -> None:
        self.dataset, self.sampler = dataset, sampler
        self.first_epoch, self.start_batch = first_epoch, start_batch
        self._orders: dict[int, list[int]] = {}

    def indices(self, dali_epoch: int) -> list[int]:
        if dali_epoch not in self._orders:
            self._orders = {}  # only the current epoch is kept
            self.sampler.set_epoch(self.first_epoch + dali_epoch,
                                   self.start_batch if dali_epoch == 0 else 0)
            self._orders[dali_epoch] = list(self.sampler)
        return self._orders[dali_epoch]

    def batch_indices(self, dali_epoch: int, batch: int) -> list[int]:
        bs = self.sampler.batch_size
        return self.indices(dali_epoch)[batch * bs : (batch + 1) * bs]

    def __setstate__(self, state: dict) -> None:
        """Runs in each worker that DALI spawns (a fresh interpreter, default signal actions,
        which would end it on Slurm's USR1 or TERM): the stop signals are ignored there, as in
        the PyTorch loader's workers. Forked workers inherit the trainer's handlers instead."""
        self.__dict__.update(state)
        ignore_stop_signals()

    def __call__(self, info) -> tuple[list[np.ndarray], list[np.ndarray]]:
        chosen = self.batch_indices(info.epoch_idx, info.iteration)
        if not chosen:
            raise StopIteration
        n_out = self.dataset.n_out
        inputs, targets = [], []
        for index in chosen:
            inp, tar = self.dataset.read_raw(index)
            inputs.append(inp)
            targets.append(np.ascontiguousarray(tar[:n_out]))
        return inputs, targets


class DALIBatches:
    """The ``Batches`` interface of utils/data_loader.py over a DALI pipeline.

    A pipeline runs whole epochs. ``set_epoch`` keeps the running pipeline when it is
    about to start exactly the epoch asked for, and builds a new one otherwise (first
    use, a resume in mid-epoch, or an iteration that was stopped early), so a batch is
    never taken from the wrong epoch and nothing is consumed before it is asked for.
    """

    def __init__(self, cfg: Config, split: str, local_batch_size: int, train: bool,
                 num_shards: int = 1, shard_id: int = 0,
                 device: torch.device | None = None, num_threads: int | None = None) -> None:
        self.dali = import_dali()
        _, self.dataset, self.sampler = get_data_loader(cfg, split, local_batch_size, train,
                                                        num_shards, shard_id)
        self.batch_size = local_batch_size
        self.device = device or torch.device("cpu")
        self.workers = cfg.data.num_data_workers
        self.start_method = cfg.data.dali_start_method
        self.num_threads = num_threads or max(1, torch.get_num_threads())
        self.shuffle, self.drop_last = train, train
        self.batches_per_epoch = self.sampler.batches_per_epoch()
        n_out = cfg.model.n_out_channels
        self.means, self.stds = self.dataset.means, self.dataset.stds  # (C, 1, 1) float32
        self.out_means = np.ascontiguousarray(self.means[:n_out])
        self.out_stds = np.ascontiguousarray(self.stds[:n_out])
        self.pipe = None
        self._ready_for: tuple[int, int] | None = None  # epoch the running pipeline starts next
        self._wanted = (0, 0)
        self._copying: tuple[Any, Any] | None = None  # (DALI's last outputs, their copies' event)

    def _key(self, epoch: int, start_batch: int) -> tuple[int, int]:
        return (epoch if self.shuffle else 0, start_batch)  # unshuffled: every epoch alike

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self._wanted = self._key(epoch, start_batch)

    def _build(self, first_epoch: int, start_batch: int) -> None:
        self.close()
        dali = self.dali
        fn, types = dali.fn, dali.types
        on_gpu = self.device.type == "cuda"
        source = BatchSource(self.dataset, self.sampler, first_epoch, start_batch)
        parallel = self.workers > 0
        options: dict[str, Any] = {}
        if parallel:
            # forking after CUDA is initialised is unsafe; spawn pickles the source instead
            start = self.start_method if self.start_method != "auto" else "spawn" if on_gpu else "fork"
            options = {"py_num_workers": self.workers, "py_start_method": start}

        @dali.pipeline_def(batch_size=self.batch_size, num_threads=self.num_threads,
                           device_id=self.device.index if on_gpu else None,
                           prefetch_queue_depth=2, **options)
        def pipeline():
            inp, tar = fn.external_source(source=source, num_outputs=2, batch=True, batch_info=True,
                                          parallel=parallel, dtype=types.FLOAT)
            if on_gpu:
                inp, tar = inp.gpu(), tar.gpu()
            # (C, H, W) - (C, 1, 1) broadcasts per channel, exactly as ERA5Dataset.__getitem__
            return (inp - self.means) / self.stds, (tar - self.out_means) / self.out_stds

        self.pipe = pipeline()
        self.pipe.build()
        self._ready_for = (first_epoch, start_batch)

    def __iter__(self):
        epoch, start_batch = self._wanted
        if self.pipe is None or self._ready_for != (epoch, start_batch):
            self._build(epoch, start_batch)
        self._ready_for = None  # stays None if the caller stops early
        while True:
            self._wait_for_copies()  # run() may reuse the last batch's buffers
            try:
                outputs = self.pipe.run()
            except StopIteration:
                break
            batch = self._to_torch(outputs[0]), self._to_torch(outputs[1])
            self._copying = outputs, dev.copies_done(self.device)
            yield batch
        self.pipe.reset()  # DALI epoch ends; the next one is the next training epoch
        self._ready_for = self._key(epoch + 1, 0)

    def _wait_for_copies(self) -> None:
        """On a GPU the copies out of DALI's buffers are queued on torch's stream, behind the
        steps queued before them, and the host runs ahead: DALI must not get those buffers back
        (its next run() or reset, or a closed pipeline) before the copies have run. The outputs
        are held until then (DALI's default executor frees a buffer with its last reference)."""
        if self._copying is not None:
            _, event = self._copying
            if event is not None:
                event.synchronize()
            self._copying = None

    def _to_torch(self, batch) -> torch.Tensor:
        dense = batch.as_tensor()
        if self.device.type != "cuda":
            return torch.from_numpy(np.array(dense))  # copy (done on return): DALI reuses its buffers
        from nvidia.dali.plugin.pytorch import feed_ndarray

        out = torch.empty(dense.shape(), dtype=torch.float32, device=self.device)
        # device-to-device copy, queued on torch's current stream as DALI's own PyTorch
        # iterator does: on another stream it could overwrite memory that kernels already
        # queued on torch's stream still read. It runs later: see _wait_for_copies.
        feed_ndarray(dense, out, cuda_stream=dev.current_stream_handle(self.device))
        return out

    def give_back(self, inp: torch.Tensor, tar: torch.Tensor) -> None:
        """Nothing to reuse: every batch is a fresh copy of DALI's output."""

    def close(self) -> None:
        """Stop the pipeline and its worker processes."""
        if getattr(self, "pipe", None) is not None:  # __init__ may have failed before it
            self._wait_for_copies()
            del self.pipe
            self.pipe = None
            self._ready_for = None

    def __del__(self) -> None:
        self.close()
