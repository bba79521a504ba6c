#!/usr/bin/env python
"""Draw a torch.profiler trace of training steps as a timeline picture.

    python train.py --config tiny_short --run_num profile --profile --profile_epoch 1 --profile_num_steps 4
    python scripts/plot_profile.py --run_dir logs/tiny_short/1GPU/profile --out logs/plots/profile.png

Rows, top to bottom, for every thread that ran the trainer's ranges: the steps (and the gaps
between them, where the training process waited for the next batch), the phases inside each
step (data copy in, forward, backward, optimizer: the NVTX/record_function ranges of
training/trainer.py), and the operators PyTorch ran (each aten op a thin mark, so dense
marks are busy compute and white space is waiting). On a GPU trace, Nsight Systems shows the
same ranges above the GPU's kernels; this picture is the CPU's side.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PHASES = {"data copy in": "#8c8c8c", "forward": "#4c72b0", "backward": "#dd8452",
          "optimizer": "#55a868", "graph replay": "#8172b3"}
STEP = re.compile(r"^step (\d+)$")


def read_trace(path: Path) -> list[dict[str, Any]]:
    """The trace's complete events (``"ph": "X"``), times in ms from the first one."""
    events = [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("ph") == "X"]
    if not events:
        raise ValueError(f"{path} holds no timed events; is it a torch.profiler trace?")
    start = min(e["ts"] for e in events)
    return [dict(e, t0=(e["ts"] - start) / 1000.0, t1=(e["ts"] - start + e.get("dur", 0)) / 1000.0)
            for e in events]


def timeline(events: list[dict[str, Any]]) -> dict[int, dict[str, list[tuple[str, float, float]]]]:
    """Per thread: the steps, the phases and the top-level operators, as (name, start, end) in ms."""
    threads: dict[int, dict[str, list]] = {}
    for e in events:
        if e.get("cat") != "user_annotation":
            continue
        name = e["name"]
        row = "steps" if STEP.match(name) else next((p for p in PHASES if name.startswith(p)), None)
        if row is None:
            continue
        rows = threads.setdefault(e["tid"], {"steps": [], "phases": [], "ops": []})
        if row == "steps":
            rows["steps"].append((name, e["t0"], e["t1"]))
        else:
            rows["phases"].append((row, e["t0"], e["t1"]))
    for tid, rows in threads.items():
        ops = sorted((e["t0"], e["t1"]) for e in events if e.get("cat") == "cpu_op" and e["tid"] == tid)
        end = -1.0
        for t0, t1 in ops:  # top-level only: an op inside the previous one is part of it
            if t0 >= end:
                rows["ops"].append(("op", t0, t1))
                end = t1
        for key in rows:
            rows[key].sort(key=lambda r: r[1])
    if not threads:
        raise ValueError("the trace has no training-step ranges (run with --profile and a profiling window)")
    return threads


def data_waits(steps: list[tuple[str, float, float]]) -> list[tuple[float, float]]:
    """The gaps between consecutive steps: the training loop waiting for its next batch."""
    return [(a[2], b[1]) for a, b in zip(steps, steps[1:]) if b[1] > a[2]]


def draw(threads: dict[int, dict[str, list]], title: str) -> plt.Figure:
    rows = [(tid, key) for tid in sorted(threads) for key in ("steps", "phases", "ops")]
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(rows) + 1.4), constrained_layout=True)
    for y, (tid, key) in enumerate(reversed(rows)):
        items = threads[tid][key]
        if key == "steps":
            for name, t0, t1 in items:
                ax.barh(y, t1 - t0, left=t0, color="#e8e8e8", edgecolor="black", height=0.7)
                ax.text((t0 + t1) / 2, y, name, ha="center", va="center", fontsize=8)
            for t0, t1 in data_waits(items):
                ax.barh(y, t1 - t0, left=t0, color="white", edgecolor="#c44e52", hatch="///", height=0.7)
        elif key == "phases":
            for name, t0, t1 in items:
                ax.barh(y, t1 - t0, left=t0, color=PHASES[name], height=0.7, label=name)
        else:
            ax.broken_barh([(t0, max(t1 - t0, 0.05)) for _, t0, t1 in items], (y - 0.35, 0.7),
                           color="#333333")
    ax.set_yticks(range(len(rows)), [f"thread {tid}: {key}" for tid, key in reversed(rows)])
    ax.set_xlabel("time (ms)")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    unique["waiting for data"] = plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="#c44e52",
                                               hatch="///")
    ax.legend(unique.values(), unique.keys(), loc="upper center", bbox_to_anchor=(0.5, -0.25 / len(rows) * 3),
              ncol=len(unique), frameon=False)
    ax.set_title(title)
    return fig


def newest_trace(run_dir: Path) -> Path:
    traces = sorted((Path(run_dir) / "profile").glob("*.pt.trace.json"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise ValueError(f"no torch.profiler trace in {run_dir}/profile; train with --profile and a "
                         f"profiling window (--profile_epoch E) first")
    return traces[-1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--run_dir", type=Path, help="a run directory: its newest trace in profile/")
    source.add_argument("--trace", type=Path, help="a .pt.trace.json file")
    p.add_argument("--out", type=Path, default=Path("logs/plots/profile.png"))
    args = p.parse_args(argv)
    try:
        trace = args.trace or newest_trace(args.run_dir)
        threads = timeline(read_trace(trace))
    except (ValueError, OSError, json.JSONDecodeError) as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    fig = draw(threads, f"torch.profiler trace: {trace.name}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    steps = [s for rows in threads.values() for s in rows["steps"]]
    waits = [w for rows in threads.values() for w in data_waits(rows["steps"])]
    print(f"wrote {args.out}: {len(steps)} steps, {sum(t1 - t0 for _, t0, t1 in steps):.0f} ms in steps, "
          f"{sum(t1 - t0 for t0, t1 in waits):.0f} ms waiting for data between them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
