#!/usr/bin/env python
"""Gradient communication against the backward pass, measured: the hand-written all-reduce after
backward, DDP with its buckets, and FSDP with its default and a deeper prefetching.

    torchrun --standalone --nproc_per_node 2 scripts/comm_overlap.py --config tiny --out logs/comm

Every rank trains the config's model on random batches of its local size (the step's shapes
and arithmetic are those of train.py; the data does not matter for time). For each variant it
times ``--steps`` steps of forward, backward and gradient synchronisation (no optimizer
step: the same weights every step) after ``--warmup`` steps, and records one step's timeline
from real timestamps: when backward starts and ends, and when each gradient bucket's
all-reduce is handed to the backend (DDP calls a communication hook as soon as backward has
filled the bucket) and when it completes. Rank 0 writes OUT/overlap.md (the table),
OUT/overlap.json and OUT/overlap.png (the timelines).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts import instruments  # noqa: E402
from scripts.script_config import add_config_args, load_script_config  # noqa: E402


class Timeline:
    """Time stamps of one step, in seconds since it started.

    On a GPU the host only queues the work: its clock would time the launches, and a bucket's
    all-reduce would seem complete when it was queued. There a stamp is a CUDA event recorded on
    the current stream (in a bucket's completion callback, a stream that waits for the
    all-reduce), read once the device has finished the step (``finish``). On a CPU, the clock."""

    def __init__(self, device) -> None:
        self.device, self.events = device, device.type == "cuda"
        self.t0, self.first = 0.0, None
        self.spans: dict[str, list] = {}  # "forward", "backward", "sync" -> [start, end]
        self.buckets: dict[int, list] = {}  # bucket index -> [handed over, completed]

    def start(self) -> None:
        from utils import device as dev

        dev.synchronize(self.device)  # the step starts on an idle device
        self.spans, self.buckets = {}, {}
        self.t0 = time.perf_counter()
        self.first = self.now() if self.events else None

    def now(self):
        """A stamp: seconds since the start (CPU), or an event queued now on the current stream (GPU)."""
        if not self.events:
            return time.perf_counter() - self.t0
        from utils import device as dev

        event = dev.timing_event(self.device)
        event.record()
        return event

    def span(self, name: str, start) -> None:
        self.spans[name] = [start, self.now()]

    def finish(self) -> float:
        """Wait for the device to finish the step; every stamp becomes seconds since the start.
        Returns the step's seconds."""
        from utils import device as dev

        end = self.now()
        dev.synchronize(self.device)
        if self.events:
            def seconds(stamp):
                return stamp if isinstance(stamp, float) else self.first.elapsed_time(stamp) / 1e3

            self.spans = {k: [seconds(a), seconds(b)] for k, (a, b) in self.spans.items()}
            self.buckets = {k: [seconds(a), seconds(b)] for k, (a, b) in self.buckets.items()}
            end = seconds(end)
        return end


def recording_hook(timeline: Timeline, group):
    """DDP's default all-reduce (torch's ``allreduce_hook``: divide by the world size, then sum),
    with the time each bucket is handed over and completed."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    # no annotations: DDP checks a hook's annotations (see distributed/compression.py)
    def hook(state, bucket):
        index = bucket.index()
        timeline.buckets[index] = [timeline.now(), float("nan")]
        future = default_hooks.allreduce_hook(group, bucket)

        def done(fut):
            timeline.buckets[index][1] = timeline.now()
            return fut.value()

        return future.then(done)

    return hook


def variants(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    out = [("all-reduce after backward, per parameter (by hand)", {"kind": "after"}),
           ("all-reduce after backward, one flat buffer", {"kind": "after_flat"})]
    out += [(f"DDP, buckets of {mb:g} MB", {"kind": "ddp", "bucket_mb": mb}) for mb in args.bucket_mb]
    if args.fsdp:
        out += [("FSDP, default prefetching (next block)", {"kind": "fsdp", "ahead": 1}),
                ("FSDP, explicit prefetching of two blocks", {"kind": "fsdp", "ahead": 2})]
    return out


def average_flat(model, group) -> None:
    """All gradients in one buffer, one all-reduce: as few calls as possible, still after backward."""
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(piece.view_as(g))


def build(cfg, setting: dict[str, Any], timeline: Timeline, group, device):
    """The model for one variant, and the synchronisation to run after its backward (or None)."""
    import torch

    from exercises.allreduce_grads_solution import average_gradients
    from networks.backbone import build

    torch.manual_seed(cfg.run.seed)
    model = build(cfg.model).to(device)
    if setting["kind"] == "after":  # the data-parallel exercise's solution
        return model, lambda: average_gradients(model, group)
    if setting["kind"] == "after_flat":
        return model, lambda: average_flat(model, group)
    if setting["kind"] == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=setting["bucket_mb"],
                                      gradient_as_bucket_view=True)
        ddp.register_comm_hook(None, recording_hook(timeline, group))
        return ddp, None
    from torch.distributed.fsdp import fully_shard

    blocks = list(model.units().values())  # the transformer blocks
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    # FSDP2 by default overlaps each block's all-gather with the compute before it (one block
    # ahead; in backward it issues the next block's gather itself). It has no public switch to turn
    # that off (an empty list means "the default"); explicit lists prefetch further ahead, at the
    # cost of holding more gathered blocks at once.
    ahead = setting["ahead"]
    if ahead > 1:
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + ahead])
            block.set_modules_to_backward_prefetch(blocks[max(0, i - ahead):i][::-1])
    return model, None


def time_variant(cfg, setting: dict[str, Any], args: argparse.Namespace, group, device) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from utils.metrics import relative_l2_loss

    timeline = Timeline(device)
    model, sync = build(cfg, setting, timeline, group, device)
    batch = max(1, cfg.optim.global_batch_size // dist.get_world_size())
    gen = torch.Generator().manual_seed(dist.get_rank())
    inp = torch.randn(batch, cfg.model.n_in_channels, *cfg.model.img_size, generator=gen).to(device)
    tar = torch.randn(batch, cfg.model.n_out_channels, *cfg.model.img_size, generator=gen).to(device)
    times, lines = [], []
    for step in range(args.warmup + args.steps):
        dist.barrier(group)  # every rank starts the step together
        timeline.start()
        loss = relative_l2_loss(model(inp), tar)
        timeline.span("forward", 0.0)
        start = timeline.now()
        loss.backward()
        timeline.span("backward", start)  # with DDP: includes waiting for the last buckets
        if sync is not None:
            start = timeline.now()
            sync()
            timeline.span("all-reduce", start)
        elapsed = timeline.finish()  # on a GPU: once its work is done
        for p in model.parameters():
            p.grad = None
        if step >= args.warmup:
            times.append(elapsed)
            lines.append({"spans": dict(timeline.spans), "buckets": dict(timeline.buckets), "total": elapsed})
    median = statistics.median(times)
    typical = min(lines, key=lambda t: abs(t["total"] - median))  # the step closest to the median
    return {"step_ms": 1e3 * median, "timeline": typical}


def write_report(rows: list[dict[str, Any]], args: argparse.Namespace, cfg, world: int) -> None:
    from networks.backbone import build, count_parameters

    args.out.mkdir(parents=True, exist_ok=True)
    params = count_parameters(build(cfg.model))
    base = rows[0]["step_ms"]
    lines = [f"Config `{args.config}` ({params / 1e6:.2f}M parameters, {4 * params / 1e6:.1f} MB of fp32 "
             f"gradients), {world} ranks, local batch {max(1, cfg.optim.global_batch_size // world)}; "
             f"median of "
             f"{args.steps} steps (forward, backward, gradient synchronisation) on rank 0.", "",
             "| variant | step ms | vs by hand | all-reduces per step |", "|---|---|---|---|"]
    for r in rows:
        n = {"after": "one per parameter", "after_flat": 1, "fsdp": "-"}.get(
            r["kind"], len(r["timeline"]["buckets"]))
        lines.append(f"| {r['name']} | {r['step_ms']:.1f} | {base / r['step_ms']:.2f}x | {n} |")
    instruments.write_report(args.out, "overlap", "\n".join(lines), rows)
    plot([r for r in rows if r["kind"] != "fsdp"], args.out / "overlap.png")
    print("\n".join(lines))
    print(f"wrote {args.out / 'overlap.md'} and {args.out / 'overlap.png'}")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 1.3 + 0.9 * len(rows)), sharex=True, squeeze=False)
    colors = {"forward": "#bbbbbb", "backward": "#4c72b0", "all-reduce": "#dd8452"}
    for ax, r in zip(axes[:, 0], rows):
        t = r["timeline"]
        for name, (a, b) in t["spans"].items():
            ax.barh(1, 1e3 * (b - a), left=1e3 * a, color=colors[name], label=name)
        for i, (_, (a, b)) in enumerate(sorted(t["buckets"].items())):
            ax.barh(0, 1e3 * (b - a), left=1e3 * a, height=0.5, color=colors["all-reduce"],
                    edgecolor="black", linewidth=0.5, label="bucket all-reduce" if i == 0 else None)
        ax.set_yticks([0, 1], ["all-reduce", "compute"])
        ax.set_title(f"{r['name']}: {r['step_ms']:.1f} ms", fontsize=9, loc="left")
    axes[0, 0].legend(fontsize=7, loc="lower right", ncol=4)
    axes[-1, 0].set_xlabel("ms since the step started (rank 0, the step nearest the median)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(p, outputs=False)
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--bucket_mb", type=float, nargs="+", default=[25.0, 1.0, 0.25],
                   help="DDP bucket sizes to time, MB (25: DDP's default)")
    p.add_argument("--no_fsdp", dest="fsdp", action="store_false", help="leave out the FSDP variants")
    p.add_argument("--out", type=Path, default=Path("logs/comm"))
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or min(args.bucket_mb) <= 0:
        p.error("--steps must be at least 1, --warmup 0 or more and every --bucket_mb positive")

    import torch.distributed as dist

    from distributed.env import init_distributed, parse_env
    from utils import device as dev
    env = parse_env()
    if env.world_size < 2:
        p.error("start it on 2 or more ranks: torchrun --standalone --nproc_per_node 2 "
                "scripts/comm_overlap.py")
    cfg = load_script_config(p, args)
    dev.set_cpu_threads(env.local_world_size)
    device = dev.pick_device(env.local_rank, env.local_world_size)
    init_distributed(env, device, cfg.layout.collective_timeout_s, cfg.layout.rendezvous_timeout_s)
    rows = []
    for name, setting in variants(args):
        rows.append({"name": name, **setting, **time_variant(cfg, setting, args, None, device)})
        if env.rank == 0:
            print(f"{name}: {rows[-1]['step_ms']:.1f} ms per step", flush=True)
    if env.rank == 0:
        write_report(rows, args, cfg, env.world_size)
    dist.barrier()
    # leave without the interpreter's teardown: freeing gloo's process groups (and FSDP's mesh)
    # there once aborted a rank that had done all its work (SIGABRT); train.py does the same
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
