"""Whole time steps of an ERA5 year file, copied straight from the file when stored plainly.

Slicing with h5py (``fields[t]``) builds an HDF5 selection, runs the read through HDF5's
type-conversion machinery and returns a fresh array on every call: about a third of the
time of reading a 655 KB step (measured on a 2-core VM: 90 us by slicing, 55 us by one
``pread`` of the same bytes). When a step is stored as plain native float32 bytes, as one
uncompressed chunk per time step (what ``make data`` writes) or inside a contiguous dataset
(what ``create_dataset(data=...)`` writes), ``StepReader`` asks HDF5 once where each step
lies and then copies its bytes with one ``pread`` into memory the caller owns. Anything
else (compression or other filters, other chunk shapes, a user block, external or virtual
storage) is read through h5py. The values are the file's float32 values either way: the
first and last steps are compared with h5py's reading when a file is opened.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import h5py
import numpy as np

log = logging.getLogger(__name__)


def plain_step_offsets(fields: h5py.Dataset) -> np.ndarray | None:
    """Byte offset in the file of every time step of ``fields`` (T, C, H, W), or None when
    the steps are not stored as plain bytes that a ``pread`` can copy."""
    if fields.dtype != np.dtype("float32") or not fields.dtype.isnative:
        return None
    if fields.file.id.get_create_plist().get_userblock() != 0:  # addresses would be shifted
        return None
    n_steps, *step_shape = fields.shape
    step_bytes = int(np.prod(step_shape)) * fields.dtype.itemsize
    plist = fields.id.get_create_plist()
    layout = plist.get_layout()
    if layout == h5py.h5d.CONTIGUOUS and plist.get_external_count() == 0:
        start = fields.id.get_offset()  # None until written
        return None if start is None else start + step_bytes * np.arange(n_steps, dtype=np.int64)
    if layout == h5py.h5d.CHUNKED and fields.chunks == (1, *step_shape) and plist.get_nfilters() == 0:
        offsets = np.empty(n_steps, dtype=np.int64)
        for t in range(n_steps):
            info = fields.id.get_chunk_info_by_coord((t, 0, 0, 0))
            if info.byte_offset is None or info.size != step_bytes:  # a chunk never written
                return None
            offsets[t] = info.byte_offset
        return offsets
    return None


def _pread_into(fd: int, out: np.ndarray, offset: int) -> int:
    """Copy ``out.nbytes`` bytes of the file at ``offset`` into ``out``; the bytes read."""
    if hasattr(os, "preadv"):  # straight into the buffer (Linux, BSD)
        return os.preadv(fd, [out.reshape(-1).view(np.uint8)], offset)
    data = os.pread(fd, out.nbytes, offset)  # elsewhere: one extra copy
    out.reshape(-1).view(np.uint8)[: len(data)] = np.frombuffer(data, np.uint8)
    return len(data)


class StepReader:
    """Reads ``fields[t]`` of one year file into a caller's (C, H, W) float32 array.

    Opened lazily in each process that reads (DataLoader workers included): HDF5 handles
    and file descriptors are not shared across processes.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file = h5py.File(self.path, "r")
        self.fields: h5py.Dataset = self._file["fields"]
        self.step_shape: tuple[int, int, int] = tuple(self.fields.shape[1:])
        try:
            self.offsets = plain_step_offsets(self.fields)
        except AttributeError:  # h5py built against an HDF5 older than 1.10.5: no chunk queries
            log.info("%s: this h5py cannot locate chunks; reading through h5py", self.path)
            self.offsets = None
        self._fd: int | None = None
        if self.offsets is not None:
            self._fd = os.open(self.path, os.O_RDONLY)
            if not self._agrees_with_h5py():
                log.warning("%s: reading steps by byte offset disagrees with h5py; reading through "
                            "h5py instead (slower)", self.path)
                self._close_fd()
                self.offsets = None

    @property
    def plain(self) -> bool:
        """Whether steps are copied from the file's bytes (else read through h5py)."""
        return self.offsets is not None

    def read_step(self, t: int, out: np.ndarray) -> np.ndarray:
        """``fields[t]`` into ``out`` (a C-contiguous float32 array of ``step_shape``), copied by
        byte offset: only for plain files (other files are read with ``fields[...]``)."""
        if self.offsets is None:
            raise ValueError(f"{self.path}: steps are not stored plainly; read them through h5py")
        n = _pread_into(self._fd, out, int(self.offsets[t]))
        if n != out.nbytes:
            raise OSError(f"{self.path}: step {t} is cut short ({n} of {out.nbytes} bytes); the file "
                          f"is truncated, re-copy or regenerate it")
        return out

    def crop(self, t: int, h: int, w: int) -> np.ndarray:
        """A new array holding ``fields[t, :, :h, :w]`` (copied by byte offset when it is the
        whole step and the steps are plain)."""
        if self.plain and (h, w) == self.step_shape[1:]:
            return self.read_step(t, np.empty(self.step_shape, np.float32))
        return self.fields[t, :, :h, :w]

    def _agrees_with_h5py(self) -> bool:
        step = np.empty(self.step_shape, np.float32)
        for t in {0, len(self.offsets) - 1}:
            # compared as integers: NaN != NaN, but the same NaN bits are the same data
            if not np.array_equal(self.read_step(t, step).view(np.uint32), self.fields[t].view(np.uint32)):
                return False
        return True

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        self._close_fd()
        self._file.close()
