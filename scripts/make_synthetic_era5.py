#!/usr/bin/env python
"""Write a synthetic ERA5-like data set in the exact layout of the NERSC tutorial data
(utils/synthetic_era5.py says how its weather is made).

    python scripts/make_synthetic_era5.py --output_dir data/synthetic --img_size 32 64
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from utils.synthetic_era5 import generate  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output_dir", type=Path, default=Path("data/synthetic"))
    p.add_argument("--img_size", type=int, nargs=2, default=[32, 64], metavar=("H", "W"))
    p.add_argument("--samples_per_year", type=int, default=1460,
                   help="6-hourly samples per year file (1460 = a whole year)")
    p.add_argument("--train_years", type=int, nargs="+", default=[2016])
    p.add_argument("--valid_years", type=int, nargs="+", default=[2017])
    p.add_argument("--test_years", type=int, nargs="+", default=[2018])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress line")
    args = p.parse_args(argv)
    if min(args.img_size) < 2 or args.samples_per_year < 2:
        p.error("--img_size needs at least 2 x 2 and --samples_per_year at least 2")
    all_years = args.train_years + args.valid_years + args.test_years
    if len(set(all_years)) != len(all_years):
        p.error("a year may belong to only one of --train_years, --valid_years, --test_years")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    years = {"train": args.train_years, "valid": args.valid_years, "test": args.test_years}
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    generate(args.output_dir, tuple(args.img_size), args.samples_per_year, years, args.seed)
    print(f"synthetic ERA5 written to {args.output_dir}", file=sys.stderr)


if __name__ == "__main__":
    main()
