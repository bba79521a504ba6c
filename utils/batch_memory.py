"""Batch tensors that the training loop hands back to the loader for reuse.

A fresh batch tensor is fresh memory: the kernel maps and zeroes every 4 KB page on its
first write, which for a 21 MB batch of the `small` config is a sizeable part of reading it
(measured on a 2-core VM: prototypes of this loader writing into fresh batches reached
0.71-0.85x of a plain h5py read, writing into recycled ones 0.97x). A plain read loop
never pays this, because the allocator hands it back the block it has just freed.

Only the consumer knows when a batch is no longer needed, so it says so: the loader lends
a batch with ``take``, and the training loop calls ``give_back`` once its step is over (the
forward pass, the backward that read the saved tensors and the optimizer step are all
done). A batch that is never given back is never reused: the pool keeps only a weak
reference to it, and it is freed as usual when its last user lets go. Batches that leave
the process (loader workers send theirs through shared memory) are not lent from here.
"""

from __future__ import annotations

import weakref

import torch


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
