#!/usr/bin/env python
"""Plot target versus prediction of one validation sample from a run's checkpoint.

    python scripts/plot_prediction.py --run_dir logs/tiny/1GPU/00 --out logs/plots/prediction_t2m.png

Reads the run's resolved config.yaml and checkpoint.pt, predicts validation sample
--sample, and writes a PNG of the target, the prediction and their difference for one
channel (normalised units), with the persistence error beside it for comparison.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from networks.backbone import build  # noqa: E402
from utils import checkpoint as ckpt  # noqa: E402
from utils.config import available_configs, load_config, with_overrides  # noqa: E402
from utils.data_loader import ERA5Dataset  # noqa: E402
from utils.era5 import CHANNELS  # noqa: E402
from utils.plots import target_vs_prediction  # noqa: E402


def load_run(run_dir: Path, data_dir: str | None):
    names = available_configs(run_dir / "config.yaml")
    cfg = with_overrides(load_config(run_dir / "config.yaml", names[0]), data_dir=data_dir)
    model = build(cfg.model)
    model.load_state_dict(ckpt.load(run_dir / ckpt.CHECKPOINT_NAME)["model"])
    return cfg, model.eval()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run_dir", type=Path, required=True, help="folder with config.yaml and checkpoint.pt")
    p.add_argument("--out", type=Path, required=True, help="PNG file to write")
    p.add_argument("--channel", default="t2m", choices=CHANNELS)
    p.add_argument("--sample", type=int, default=0, help="validation sample number")
    p.add_argument("--data_dir", help="override the run's data directory")
    args = p.parse_args(argv)
    for name in ("config.yaml", ckpt.CHECKPOINT_NAME):
        if not (args.run_dir / name).is_file():
            p.error(f"{args.run_dir / name} does not exist; pass the run directory of a finished run")
    try:
        cfg, model = load_run(args.run_dir, args.data_dir)
        inp, tar = ERA5Dataset(cfg, "valid")[args.sample]
    except (ValueError, IndexError) as err:
        p.error(str(err))
    with torch.no_grad():
        pred = model(inp[None])[0]
    fig = target_vs_prediction(pred, tar, args.channel, persistence=inp)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
