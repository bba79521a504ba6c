#!/usr/bin/env python
"""Bigger model, better forecast? Final validation RMSE of finished runs against model size.

    python train.py --config tiny_small --run_num sizes
    python train.py --config tiny_large --run_num sizes
    python scripts/plot_model_sizes.py --run_dirs logs/tiny_small/1GPU/sizes \\
        example_logs/tiny/1GPU/demo logs/tiny_large/1GPU/sizes --out logs/plots/model_sizes.png

For each run: its parameters (the model its config.yaml describes), and from the last line
of its metrics.jsonl the latitude-weighted RMSE averaged over the channels, next to
persistence (predicting no change), which no model size changes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from ruamel.yaml import YAML  # noqa: E402

from networks.backbone import build, count_parameters  # noqa: E402
from utils.config import FIELDS, Config  # noqa: E402


def run_summary(run_dir: Path) -> dict[str, Any]:
    """Name, parameters, steps and final RMSE (mean over channels) of a finished run."""
    run_dir = Path(run_dir)
    metrics, config = run_dir / "metrics.jsonl", run_dir / "config.yaml"
    if not metrics.is_file() or not config.is_file():
        raise ValueError(f"{run_dir} is not a finished run (no metrics.jsonl or config.yaml)")
    (name, values), = YAML(typ="safe", pure=True).load(config.read_text()).items()
    cfg = Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items() if k in FIELDS})
    last = json.loads(metrics.read_text().splitlines()[-1])
    return {"name": name, "run_dir": str(run_dir), "parameters": count_parameters(build(cfg.model)),
            "embed_dim": cfg.model.embed_dim, "depth": cfg.model.depth, "step": last["step"],
            "val_loss": last["val_loss"],
            "rmse": sum(last["rmse"].values()) / len(last["rmse"]),
            "persistence": sum(last["persistence"].values()) / len(last["persistence"])}


def draw(runs: list[dict[str, Any]]) -> plt.Figure:
    runs = sorted(runs, key=lambda r: r["parameters"])
    fig, ax = plt.subplots(figsize=(6, 3.8), constrained_layout=True)
    x = [r["parameters"] for r in runs]
    ax.plot(x, [r["rmse"] for r in runs], "o-", label="model")
    ax.plot(x, [r["persistence"] for r in runs], "--", color="gray", label="persistence (no change)")
    for r in runs:
        ax.annotate(f"{r['name']}\nembed {r['embed_dim']}, depth {r['depth']}", (r["parameters"], r["rmse"]),
                    textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8)
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # 2e5, 3e5, ... would collide
    ax.set_xlabel("parameters")
    ax.set_ylabel("validation RMSE, mean of 20 channels")
    ax.set_ylim(0, max(r["persistence"] for r in runs) * 1.15)
    ax.legend(loc="center right")
    ax.set_title(f"Same data, same {runs[0]['step']} steps: bigger models forecast better")
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run_dirs", type=Path, nargs="+", required=True, help="finished run directories")
    p.add_argument("--out", type=Path, default=Path("logs/plots/model_sizes.png"))
    args = p.parse_args(argv)
    try:
        runs = [run_summary(d) for d in args.run_dirs]
    except (ValueError, OSError) as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    draw(runs).savefig(args.out, dpi=110)
    for r in sorted(runs, key=lambda r: r["parameters"]):
        print(f"{r['name']}: {r['parameters']} parameters, step {r['step']}, val loss {r['val_loss']:.6f}, "
              f"RMSE {r['rmse']:.4f} (persistence {r['persistence']:.4f})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
