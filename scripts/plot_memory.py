#!/usr/bin/env python
"""Where one training step's memory goes, kind by kind: the record of ``--memory_snapshot``.

    torchrun --standalone --nproc_per_node 2 train.py --config tiny_short --memory_snapshot --run_num mem_ddp
    torchrun --standalone --nproc_per_node 2 train.py --config tiny_short --data_parallel fsdp \\
        --memory_snapshot --run_num mem_fsdp
    python scripts/plot_memory.py logs/tiny_short/2GPU/mem_ddp logs/tiny_short/2GPU/mem_fsdp \\
        --out logs/plots/memory.png

For each run, one rank's ``memory/memory_phases_rank<N>.json`` (utils/profiling.py,
MemoryRecord): stacked bars of the bytes it holds in parameters, gradients, optimizer state and
activations at the start of the step and at the end of its forward, backward and optimizer
ranges, side by side so that layouts compare at a glance.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

KINDS = (("parameters", "darkgreen"), ("gradients", "mediumblue"), ("optimizer_state", "goldenrod"),
         ("activations", "red"))
MIB = 2**20


def read_record(run_dir: Path, rank: int) -> dict[str, Any]:
    path = Path(run_dir) / "memory" / f"memory_phases_rank{rank}.json"
    if not path.is_file():
        raise ValueError(f"{path} does not exist: train with --memory_snapshot first (and --rank "
                         f"below the run's number of ranks)")
    return json.loads(path.read_text())


def plot(runs: list[tuple[str, dict[str, Any]]], out: Path) -> None:
    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 3.8), sharey=True, squeeze=False)
    for ax, (label, record) in zip(axes[0], runs):
        phases = record["phases"]
        names = [p["phase"] for p in phases]
        bottom = [0.0] * len(phases)
        for kind, color in KINDS:
            values = [p[kind] / MIB for p in phases]
            ax.bar(names, values, bottom=bottom, color=color, label=kind.replace("_", " "))
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_title(f"{label}\nstep {record['step']}: activations peak "
                     f"{record['activations_peak'] / MIB:.1f} MiB", fontsize=9)
        ax.set_xlabel("end of")
    axes[0][0].set_ylabel("MiB held by this rank")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", nargs="+", type=Path, help="run folders trained with --memory_snapshot")
    p.add_argument("--rank", type=int, default=0, help="whose record to draw")
    p.add_argument("--out", type=Path, default=Path("logs/plots/memory.png"))
    args = p.parse_args(argv)
    try:
        runs = [("/".join(d.parts[-2:]), read_record(d, args.rank)) for d in args.run_dirs]
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    plot(runs, args.out)
    for label, record in runs:
        end = record["phases"][-1]
        print(f"{label}: " + ", ".join(f"{k} {max(p[k] for p in record['phases']) / MIB:.2f} MiB"
                                       for k, _ in KINDS) + f" (largest over the step); process peak "
              f"{record['process_peak'] / MIB:.0f} MiB ({record['process_peak_kind']}); after the "
              f"optimizer {sum(end[k] for k, _ in KINDS) / MIB:.2f} MiB held")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
