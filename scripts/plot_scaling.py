#!/usr/bin/env python
"""Throughput versus number of GPUs (or CPU ranks), with ideal scaling, and loss curves.

Reads the TensorBoard event files that train.py writes to RUN_DIR (the run directory is
LOGDIR/<config>/<N>GPU/<run_num>; N is taken from that name) and writes one PNG:

    python scripts/plot_scaling.py logs/bs16_opt logs/bs64_opt --out scaling.png
    python scripts/plot_scaling.py logs/tiny --out docs/img/scaling_cpu.png --skip_epochs 1

Each argument is a run directory or a folder searched for them. Throughput is the mean
"Avg samples per sec" over the epochs after the first ``--skip_epochs`` (start-up and
compilation make the first epoch slow); ideal scaling is the smallest run's throughput
times the ratio of ranks.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

THROUGHPUT_TAG = "Avg samples per sec"
LOSS_TAGS = ("Loss/train", "Loss/valid")


@dataclass
class Run:
    path: Path
    ranks: int
    label: str
    throughput: list[tuple[int, float]] = field(default_factory=list)  # (step, samples/s)
    losses: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    def mean_throughput(self, skip_epochs: int) -> float:
        values = [v for _, v in self.throughput]
        kept = values[skip_epochs:] or values  # a run of few epochs: use what there is
        return sum(kept) / len(kept)


def find_run_dirs(paths: list[Path]) -> list[Path]:
    found = []
    for p in paths:
        if not p.exists():
            raise SystemExit(f"error: {p} does not exist")
        found += sorted({e.parent for e in p.rglob("events.out.tfevents.*")} if p.is_dir() else set())
    if not found:
        raise SystemExit(f"error: no TensorBoard event files under {', '.join(map(str, paths))}; "
                         f"pass run directories written by train.py")
    return sorted(set(found))


def ranks_of(path: Path) -> int:
    for part in reversed(path.parts):
        m = re.fullmatch(r"(\d+)GPU(_\w+)?", part)  # train_mp.py: 8GPU_tp2_cp1_dp4
        if m:
            return int(m.group(1))
    raise SystemExit(f"error: cannot tell the number of ranks of {path}: expected a folder named "
                     f"<N>GPU in its path (LOGDIR/<config>/<N>GPU/<run_num>)")


def read_run(path: Path) -> Run:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})  # 0 = keep every point
    acc.Reload()
    tags = set(acc.Tags().get("scalars", []))
    if THROUGHPUT_TAG not in tags:
        raise SystemExit(f"error: {path} has no '{THROUGHPUT_TAG}' scalars; did the run finish an epoch?")
    ranks = ranks_of(path)
    rel = path.parts[-3:] if len(path.parts) >= 3 else path.parts
    run = Run(path=path, ranks=ranks, label="/".join(rel))
    run.throughput = [(e.step, e.value) for e in acc.Scalars(THROUGHPUT_TAG)]
    run.losses = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in LOSS_TAGS if t in tags}
    return run


def plot(runs: list[Run], out: Path, skip_epochs: int, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(11, 4.2))
    by_ranks: dict[int, list[float]] = {}
    for r in runs:
        by_ranks.setdefault(r.ranks, []).append(r.mean_throughput(skip_epochs))
    ranks = sorted(by_ranks)
    measured = [sum(by_ranks[n]) / len(by_ranks[n]) for n in ranks]
    ideal = [measured[0] * n / ranks[0] for n in ranks]
    ax_t.plot(ranks, ideal, "k--", label="ideal scaling")
    ax_t.plot(ranks, measured, "o-", label="measured")
    for n, v in zip(ranks, measured):
        ax_t.annotate(f"{v:.0f}", (n, v), textcoords="offset points", xytext=(4, -12), fontsize=8)
    ax_t.set_xscale("log", base=2)
    ax_t.set_yscale("log")
    ax_t.set_xticks(ranks, [str(n) for n in ranks])
    ax_t.set_xlabel("number of GPUs / ranks")
    ax_t.set_ylabel("samples per second")
    ax_t.set_title("throughput")
    ax_t.legend()
    for i, r in enumerate(sorted(runs, key=lambda r: (r.ranks, r.label))):
        color = f"C{i % 10}"
        for tag, style in zip(LOSS_TAGS, ("--", "-")):
            points = r.losses.get(tag, [])
            if points:
                steps, values = zip(*points)
                name = "train" if tag == LOSS_TAGS[0] else "valid"
                ax_l.plot(steps, values, style, color=color, label=f"{r.label} ({name})")
    ax_l.set_xlabel("optimizer step")
    ax_l.set_ylabel("loss")
    ax_l.set_yscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")  # 40, not 4 x 10^1
    for axis in (ax_t.yaxis, ax_l.yaxis):
        axis.set_major_formatter(plain)
        axis.set_minor_formatter(plain)
    ax_l.set_title("loss")
    ax_l.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[int, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", type=Path, help="run directories, or folders holding them")
    p.add_argument("--out", type=Path, default=Path("scaling.png"), help="PNG to write")
    p.add_argument("--skip_epochs", type=int, default=1, help="leading epochs left out of the mean")
    p.add_argument("--title", help="figure title")
    args = p.parse_args(argv)
    if args.skip_epochs < 0:
        raise SystemExit("error: --skip_epochs must be 0 or more")
    runs = [read_run(d) for d in find_run_dirs(args.paths)]
    plot(runs, args.out, args.skip_epochs, args.title)
    summary: dict[int, list[float]] = {}
    for r in runs:
        summary.setdefault(r.ranks, []).append(r.mean_throughput(args.skip_epochs))
    base_n = min(summary)
    base = sum(summary[base_n]) / len(summary[base_n])
    print(f"{'ranks':>5} {'samples/s':>10} {'speed-up':>9} {'efficiency':>10}")
    means = {}
    for n in sorted(summary):
        v = sum(summary[n]) / len(summary[n])
        means[n] = v
        print(f"{n:>5} {v:>10.1f} {v / base:>9.2f} {v / base / (n / base_n):>10.0%}")
    print(f"wrote {args.out}")
    return means


if __name__ == "__main__":
    main(sys.argv[1:])
