"""Batch tensors that are recycled once nothing outside the pool holds them.

A fresh batch tensor is fresh memory: the kernel maps and zeroes every 4 KB page on its
first write, which for a 21 MB batch of the `small` config is a sizeable part of reading it
(measured on a 2-core VM: prototypes of this loader writing into fresh batches reached
0.71-0.85x of a plain h5py read, writing into recycled ones 0.97x). A plain read loop
never pays this, because the allocator hands it back the block it has just freed.

The pool keeps the tensors it made and hands out views of them. Every tensor that uses the
memory (the view handed out, views of it, a tensor autograd saved for backward, a numpy
array over it) holds a reference to the same storage, so the storage's use count says
whether anything outside the pool still needs it. Batches that leave the process (loader
workers send theirs through shared memory) must never be recycled: the pool is only for the
process that consumes the batches.
"""

from __future__ import annotations

import math

import torch

# torch's count of references to a storage (tensors and views, saved ones included); private,
# so its absence turns recycling off rather than failing
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def storage_users(tensor: torch.Tensor) -> int | None:
    """How many references torch counts to ``tensor``'s storage (None: cannot tell)."""
    if _use_count is None:
        return None
    return _use_count(tensor.untyped_storage()._cdata)


class BatchMemory:
    """Float32 CPU tensors of a few shapes, reused when free.

    ``take(shape)`` returns a view of a kept tensor of that shape that nothing else uses, or
    of a new one. At most ``keep`` tensors are kept; past that the oldest is forgotten (its
    memory is freed once its users let go of it).
    """

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        # (tensor, the use count it has when only the pool holds it)
        self._kept: list[tuple[torch.Tensor, int]] = []
        self.reused = self.made = 0

    def take(self, shape: tuple[int, ...]) -> torch.Tensor:
        shape = tuple(shape)
        for tensor, idle in self._kept:
            if tuple(tensor.shape) == shape and storage_users(tensor) == idle and not tensor.is_shared():
                self.reused += 1
                return tensor.view(shape)
        tensor = torch.empty(shape)
        idle = storage_users(tensor)
        if idle is not None:
            self._kept.append((tensor, idle))
            del self._kept[: -self.keep]
        self.made += 1
        return tensor.view(shape)


def shared_empty(shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised float32 tensor in shared memory, for a batch a loader worker makes:
    sending it to the training process then moves no bytes (a tensor in ordinary memory is
    first copied into shared memory), as the DataLoader's own collate does in workers."""
    storage = torch.UntypedStorage._new_shared(4 * math.prod(shape))
    return torch.empty(0).set_(storage, 0, shape)
