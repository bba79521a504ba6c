#!/usr/bin/env python
"""The pipeline bubble, made visible: when each stage ran each micro-batch's forward and
backward, for GPipe, 1F1B, interleaved 1F1B and zero bubble, and what micro-batches cost in memory.

    python scripts/pipeline_report.py --config tiny_deep --out logs/pipeline

Every measurement is a real training run (train_mp.py's loop, on CPU with gloo via torchrun,
or on the GPUs there are) of ``--steps`` steps. Each rank records, in the last step, the start
and end of every forward and backward its stages run (timestamps around the pipeline stage's
calls, after a barrier that starts the ranks together), and the peak of the bytes autograd
holds for backward (tensors saved by the stage's operations, each storage counted once, while
they are alive). Writes OUT/pipeline.md (tables), OUT/pipeline.json and
OUT/pipeline_timeline.png (ranks as rows, F/B boxes per micro-batch, idle time blank).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.instruments import write_report  # noqa: E402
from scripts.workers import run_worker, worker_env  # noqa: E402
from utils.config_groups import INTERLEAVED  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")  # the flushed ones, by default
ASYNC = "async_1f1b"  # distributed/async_pipeline.py: no flush (scripts/async_report.py draws it)
RECORD_FILE = "pipeline_rank{rank}.json"
MIB = 2**20


# ------------------------------------------------------------ the worker (one rank) ---
def worker(argv: list[str]) -> int:
    import torch
    import torch.distributed as dist

    from training.launcher import main
    from training.trainer import Callback
    from utils import device as dev
    from utils.profiling import SavedTensorMeter

    class PipelineRecord(Callback):
        """Each step's time, the stages' timeline of forward and backward parts, and the peak of
        saved activations; each rank writes its own record at the end."""

        def __init__(self) -> None:
            self.events: list = []
            self.steps: list[dict[str, Any]] = []

        def model_built(self, trainer) -> None:
            trainer.model.record_timeline(self.events)

        def step_start(self, trainer) -> None:
            # the ranks start the step together: their clocks line up. Not the asynchronous
            # pipeline's, whose stages do not wait for each other between steps: its clocks are
            # lined up once, at the first step
            again = trainer.cfg.layout.pipeline_schedule != ASYNC
            if again or not self.steps:
                dist.barrier()
            self.events.clear()
            self.meter = SavedTensorMeter()
            self.hooks = torch.autograd.graph.saved_tensors_hooks(self.meter.pack, self.meter.unpack)
            self.hooks.__enter__()
            dev.synchronize(trainer.device)  # on a GPU: the host clock reads the device's time
            self.start = time.perf_counter()
            if again or not self.steps:
                self.origin = self.start  # the events' times are from here

        def step_end(self, trainer, loss) -> None:
            self.hooks.__exit__(None, None, None)
            dev.synchronize(trainer.device)
            end = time.perf_counter()
            self.steps.append({"seconds": end - self.start, "saved_peak_bytes": self.meter.peak,
                               "events": [(k, s, m, a - self.origin, b - self.origin)
                                          for k, s, m, a, b in self.events]})

        def fit_end(self, trainer) -> None:
            record = {"rank": trainer.ctx.rank, "pp_rank": trainer.ctx.mesh.rank_in("pp"),
                      "stages": trainer.model.stage_ids, "steps": self.steps}
            path = trainer.ctx.run_dir / RECORD_FILE.format(rank=trainer.ctx.rank)
            path.write_text(json.dumps(record))

    return main(argv=argv, description="train_mp.py recording its pipeline", model_parallel=True,
                callbacks=[PipelineRecord()])


# ------------------------------------------------------------------ the driver ---
def bubble_on_paper(schedule: str, p: int, m: int, v: int) -> float | None:
    """Idle fraction of a flushed pipeline: (p - 1) / (m + p - 1); interleaving fills it v times
    faster, (p - 1) / (v m + p - 1). Zero-bubble schedules fill it with weight gradients: how
    much is left depends on the ratio of the backward's parts (no one formula). The asynchronous
    schedule fills the pipeline once per run and never drains it: none."""
    if schedule == "zero_bubble":
        return None
    if schedule == ASYNC:
        return 0.0
    v = v if schedule in INTERLEAVED else 1
    return (p - 1) / (v * m + p - 1)


def measure(args: argparse.Namespace, schedule: str, p: int, m: int) -> dict[str, Any]:
    name = f"{schedule}_pp{p}_m{m}"
    print(f"  {name}", flush=True)
    flags = [f"--yaml_config={args.yaml_config}", f"--config={args.config}", f"--run_num={name}",
             f"--expdir={args.out / 'runs'}", f"--num_iters={args.steps}", "--checkpoint_every=0",
             f"--global_batch_size={args.batch}", f"--pipeline_parallel={p}",
             f"--pipeline_schedule={schedule}", f"--num_microbatches={m}",
             f"--stages_per_rank={args.stages_per_rank}", "--limit_nsamples_val=8",
             f"--limit_nsamples={args.batch * args.steps}", *args.flags]
    run_worker(__file__, p, flags, worker_env())
    run_dir = next((args.out / "runs" / args.config).glob(f"*/{name}"))
    ranks = [json.loads((run_dir / RECORD_FILE.format(rank=r)).read_text()) for r in range(p)]
    last = [r["steps"][-1] for r in ranks]
    step = max(s["seconds"] for s in last)
    bubble = 1 - statistics.mean(sum(b - a for _, _, _, a, b in s["events"]) for s in last) / step
    if schedule == ASYNC:  # the step before the last (the last waits for the shared losses), drawn
        # from its first event on any rank; each rank idle for a share of its own step
        last = [r["steps"][-2] for r in ranks]
        t0 = min(e[3] for s in last for e in s["events"])
        last = [{**s, "events": [(*e[:3], e[3] - t0, e[4] - t0) for e in s["events"]]} for s in last]
        step = max(e[4] for s in last for e in s["events"])
        bubble = 1 - statistics.mean(sum(b - a for _, _, _, a, b in s["events"]) / s["seconds"] for s in last)
    # each step's time is its slowest rank's; the first step (shape inference) is left out
    per_step = [max(s["seconds"] for s in same) for same in zip(*(r["steps"] for r in ranks))][1:]
    return {"schedule": schedule, "pp": p, "microbatches": m, "v": args.stages_per_rank,
            "step_seconds": step, "samples_per_sec": args.batch / statistics.median(per_step or [step]),
            "bubble_measured": bubble,
            "bubble_on_paper": bubble_on_paper(schedule, p, m, args.stages_per_rank),
            "saved_MiB": [s["saved_peak_bytes"] / MIB for s in last],
            "timeline": [{"rank": r["pp_rank"], "events": s["events"]} for r, s in zip(ranks, last)]}


def table(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| schedule | stages (ranks) | micro-batches | samples/s | bubble on paper | bubble measured "
           "| saved activations per rank, MiB (peak) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        mib = " / ".join(f"{x:.1f}" for x in r["saved_MiB"])
        out.append(f"| {r['schedule']} | {r['pp']} | {r['microbatches']} | {r['samples_per_sec']:.1f} | "
                   f"{_fraction(r['bubble_on_paper'])} | {r['bubble_measured']:.2f} | {mib} |")
    return out


def _fraction(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(rows), 1, figsize=(11, 1.1 + 0.75 * sum(r["pp"] for r in rows)),
                             squeeze=False)
    cmap = plt.get_cmap("tab10")
    for ax, r in zip(axes[:, 0], rows):
        for lane in r["timeline"]:
            for kind, stage, mb, a, b in lane["events"]:
                y = r["pp"] - 1 - lane["rank"]
                ax.barh(y, (b - a) * 1e3, left=a * 1e3, height=0.8, color=cmap(mb % 10),
                        alpha=1.0 if kind == "F" else 0.55, edgecolor="black", linewidth=0.5,
                        hatch={"F": None, "B": "//", "W": ".."}[kind])
                label = f"{kind}{mb}" + (f"s{stage}" if r["schedule"] in INTERLEAVED else "")
                ax.text((a + b) / 2 * 1e3, y, label, ha="center", va="center", fontsize=6)
        ax.set_yticks(range(r["pp"]), [f"rank {r['pp'] - 1 - i}" for i in range(r["pp"])])
        ax.set_title(f"{r['schedule']}: {r['pp']} stages, {r['microbatches']} micro-batches; bubble "
                     f"{r['bubble_measured']:.2f} measured, {_fraction(r['bubble_on_paper'])} on paper",
                     fontsize=9)
        ax.set_xlim(0, r["step_seconds"] * 1e3)
    axes[-1, 0].set_xlabel("milliseconds into the training step (F: forward, B: backward, W: weight "
                           "gradients, colour: micro-batch; blank: waiting)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def driver(argv: list[str] | None = None) -> int:
    from utils.config import DEFAULT_YAML, load_config

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny_deep")
    p.add_argument("--yaml_config", default=str(DEFAULT_YAML))
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=(*SCHEDULES, ASYNC))
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4], help="pipeline sizes (ranks)")
    p.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--stages_per_rank", type=int, default=2, help="interleaved_1f1b's stages per rank")
    p.add_argument("--steps", type=int, default=3, help="training steps per run (the last is recorded)")
    p.add_argument("--batch", type=int, default=16, help="global batch")
    p.add_argument("--timeline", default="2:8", help="PP:M of the runs drawn in the picture")
    p.add_argument("--out", type=Path, default=Path("logs/pipeline"))
    p.add_argument("flags", nargs="*", help="more train_mp.py flags after --, e.g. -- --data_dir DIR")
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    depth = load_config(args.yaml_config, args.config).depth
    runs = [(s, pp, m) for pp in args.stages for m in args.microbatches for s in args.schedules
            if m >= pp and args.batch % m == 0
            and pp * (args.stages_per_rank if s in INTERLEAVED else 1) <= depth]
    print(f"{len(runs)} runs of {args.steps} steps:", flush=True)
    rows = [measure(args, *run) for run in runs]
    md = [f"Config `{args.config}`, global batch {args.batch}, fp32; interleaved_1f1b with "
          f"{args.stages_per_rank} stages per rank; the last of {args.steps} steps recorded.", "",
          *table(rows)]
    args.out.mkdir(parents=True, exist_ok=True)
    write_report(args.out, "pipeline", "\n".join(md), rows)
    pp, m = (int(x) for x in args.timeline.split(":"))
    drawn = [r for r in rows if (r["pp"], r["microbatches"]) == (pp, m)] or rows[:3]
    plot(drawn, args.out / "pipeline_timeline.png")
    print("\n".join(md))
    print(f"wrote {args.out / 'pipeline.md'} and {args.out / 'pipeline_timeline.png'}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2:]))
    sys.exit(driver())
