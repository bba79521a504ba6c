"""What the measuring scripts share: one collective counter, one reader of a run's metrics, one
report writer.

* :class:`CollectiveCounter` wraps torch.distributed's tensor collectives so that each adds its
  payload to a count while counting is on: an all-reduce's or broadcast's tensor, an all-gather's
  whole output, a reduce-scatter's whole input, an all-to-all's input, what a point-to-point send
  or receive carries. DDP's gradient all-reduce runs in C++; :func:`count_ddp_gradients` routes it
  through the (counted) Python all-reduce with a communication hook.
* :func:`read_metrics` reads a run folder's metrics.jsonl (one record per epoch).
* :func:`write_report` writes a report's Markdown and JSON side by side, each atomically.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# (torch.distributed's function, the kind it is counted as, the payload's position and keyword);
# FSDP2 calls the *_single forms from torch 2.13 on, the *_tensor ones before
WRAPPED = (
    ("all_reduce", "all_reduce", 0, "tensor"),
    ("broadcast", "broadcast", 0, "tensor"),
    ("all_gather", "all_gather", 0, "tensor_list"),
    ("all_gather_into_tensor", "all_gather", 0, "output_tensor"),
    ("all_gather_single", "all_gather", 0, "output_tensor"),
    ("reduce_scatter_tensor", "reduce_scatter", 1, "input"),
    ("reduce_scatter_single", "reduce_scatter", 1, "input"),
    ("all_to_all_single", "all_to_all", 1, "input"),
    ("send", "send", 0, "tensor"),
    ("recv", "recv", 0, "tensor"),
    ("isend", "send", 0, "tensor"),
    ("irecv", "recv", 0, "tensor"),
)


def nbytes(t: Any) -> int:
    if isinstance(t, (list, tuple)):
        return sum(nbytes(x) for x in t)
    return t.numel() * t.element_size()


class CollectiveCounter:
    """Bytes and calls per kind of collective, counted while :meth:`counting` is open.
    :meth:`install` wraps the functions once per process."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.active = False

    def add(self, kind: str, payload: Any) -> None:
        if self.active:
            self.bytes[kind] = self.bytes.get(kind, 0) + nbytes(payload)
            self.calls[kind] = self.calls.get(kind, 0) + 1

    def install(self) -> CollectiveCounter:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        for name, kind, position, keyword in WRAPPED:
            original = getattr(dist, name, None)
            if original is None:
                continue
            setattr(dist, name, self._counted(original, kind, position, keyword))
            if name in ("isend", "irecv"):  # the pipeline's P2POp lists are checked against (and
                setattr(c10d, name, getattr(dist, name))  # call) distributed_c10d's functions
        return self

    def _counted(self, original: Any, kind: str, position: int, keyword: str) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.add(kind, kwargs[keyword] if keyword in kwargs else args[position])
            return original(*args, **kwargs)

        return counted

    @contextlib.contextmanager
    def counting(self, reset: bool = False) -> Iterator[None]:
        if reset:
            self.bytes.clear()
            self.calls.clear()
        self.active = True
        try:
            yield
        finally:
            self.active = False


def count_ddp_gradients(model: Any, group: Any) -> bool:
    """DDP's bucket all-reduce through torch.distributed.all_reduce (which a CollectiveCounter
    counts), averaged as DDP averages. False where the model is not DDP, or already has a hook of
    the project's (experts, context parallel, compression), whose collectives are counted anyway."""
    if not hasattr(model, "register_comm_hook"):
        return False
    import torch.distributed as dist

    def hook(state, bucket):  # no annotations: DDP checks them (a bucket must be a dist.GradBucket)
        buf = bucket.buffer()
        buf.div_(dist.get_world_size(group))
        work = dist.all_reduce(buf, group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    try:
        model.register_comm_hook(None, hook)
    except RuntimeError:  # DDP takes one hook: the project's, whose collectives are counted anyway
        return False
    return True


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every epoch's record of a run folder's metrics.jsonl, in order."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{path} not found; pass a run folder written by the training scripts")
    epochs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not epochs:
        raise ValueError(f"{path} is empty; let the run finish an epoch first")
    return epochs


def write_report(out_dir: Path, name: str, markdown: str, data: Any) -> tuple[Path, Path]:
    """OUT/NAME.md and OUT/NAME.json, each replaced in one step."""
    from utils.checkpoint import write_text_atomic

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js = out_dir / f"{name}.md", out_dir / f"{name}.json"
    write_text_atomic(md, markdown if markdown.endswith("\n") else markdown + "\n")
    write_text_atomic(js, json.dumps(data, indent=1, default=str) + "\n")  # paths, dtypes as text
    return md, js
