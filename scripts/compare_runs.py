#!/usr/bin/env python
"""Several runs side by side: their validation loss against the step in one plot, and a table of
what differs between them (the settings), their final losses, gradient bytes sent per step and
speed.

    python scripts/compare_runs.py logs/tiny/2GPU/00 logs/tiny/2GPU/bf16 --out logs/plots/compare.png

Reads each RUN_DIR's metrics.jsonl and config.yaml (written by the training scripts); the
first run is the reference the others are compared with. Prints the table (markdown) and
writes it next to the plot (OUT with the suffix .md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for its packages

# settings that say nothing about the mathematics of a run
IGNORED = {"expdir", "data_dir", "checkpoint_every", "num_data_workers", "stop_check_every"}


def read_run(run_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from scripts.plot_training import read_metrics

    config_path = run_dir / "config.yaml"
    if not (run_dir / "metrics.jsonl").is_file() or not config_path.is_file():
        raise SystemExit(f"error: {run_dir} has no metrics.jsonl and config.yaml; pass run folders "
                         f"written by train.py (logs/CONFIG/NGPU/RUN)")
    epochs = read_metrics(run_dir)
    from ruamel.yaml import YAML

    (config,) = YAML(typ="safe").load(config_path.read_text()).values()
    return epochs, config


def differences(configs: list[dict[str, Any]]) -> list[str]:
    """The settings whose values are not the same in every run."""
    keys = sorted({k for c in configs for k in c} - IGNORED)
    return [k for k in keys if len({json.dumps(c.get(k)) for c in configs}) > 1]


def table(names: list[str], runs: list[tuple[list[dict], dict]]) -> list[str]:
    keys = differences([config for _, config in runs])
    ref = runs[0][0][-1]
    lines = ["| run | " + " | ".join(keys) + (" | " if keys else "") +
             "final train loss | final val loss | vs first | gradient MB per step | samples/s |",
             "|---" * (len(keys) + 6) + "|"]
    for name, (epochs, config) in zip(names, runs):
        last = epochs[-1]
        sent = last.get("grad_comm_bytes_per_step")
        later = epochs[1:] or epochs  # the first epoch's speed includes start-up
        speed = sum(e["samples_per_sec"] for e in later) / len(later)
        cells = [str(config.get(k)) for k in keys]
        lines.append(f"| {name} | " + " | ".join(cells) + (" | " if cells else "") +
                     f"{last['train_loss']:.4f} | {last['val_loss']:.4f} | "
                     f"{last['val_loss'] / ref['val_loss']:.2f}x | "
                     f"{'-' if sent is None else f'{sent / 1e6:.2f}'} | {speed:.0f} |")
    return lines


def plot(names: list[str], runs: list[tuple[list[dict], dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), constrained_layout=True)
    for name, (epochs, _) in zip(names, runs):
        ax.plot([e["step"] for e in epochs], [e["val_loss"] for e in epochs], "o-", ms=3, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dirs", type=Path, nargs="+", help="run folders; the first is the reference")
    p.add_argument("--out", type=Path, default=Path("logs/plots/compare.png"))
    args = p.parse_args(argv)
    runs = [read_run(d) for d in args.run_dirs]
    names = [d.name if d.name not in ("00",) else f"{d.parent.name}/{d.name}" for d in args.run_dirs]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot(names, runs, args.out)
    lines = table(names, runs)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
