#!/usr/bin/env python
"""Plot how a run learned: losses per epoch, and the model's RMSE against persistence.

    python scripts/plot_training.py --run_dir example_logs/tiny/1GPU/demo --out logs/plots/demo_training.png

Reads RUN_DIR/metrics.jsonl (one line per epoch, written by train.py) and writes one PNG:
training and validation loss against the optimizer step, and the latitude-weighted RMSE of a
few channels next to the RMSE of persistence (predicting no change) after every epoch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_CHANNELS = ("u10m", "t2m", "z500")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for its packages


def read_metrics(run_dir: Path) -> list[dict]:
    """The run's epochs (scripts/instruments.py), or a one-line error."""
    from scripts.instruments import read_metrics as read

    try:
        return read(run_dir)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None


def plot(epochs: list[dict], channels: tuple[str, ...], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [e["step"] for e in epochs]
    fig, (ax_loss, ax_rmse) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    ax_loss.plot(steps, [e["train_loss"] for e in epochs], "o--", label="train (epoch mean)")
    ax_loss.plot(steps, [e["val_loss"] for e in epochs], "o-", label="valid")
    ax_loss.set_yscale("log")
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel("relative L2 loss")
    ax_loss.set_title("loss")
    ax_loss.legend()
    for i, ch in enumerate(channels):
        ax_rmse.plot(steps, [e["rmse"][ch] for e in epochs], "o-", color=f"C{i}", label=f"{ch} model")
        ax_rmse.plot(steps, [e["persistence"][ch] for e in epochs], ":", color=f"C{i}",
                     label=f"{ch} persistence")
    ax_rmse.set_xlabel("optimizer step")
    ax_rmse.set_ylabel("RMSE (normalised units)")
    ax_rmse.set_title("validation RMSE: model vs persistence")
    ax_rmse.legend(fontsize=8, loc="center right")
    fig.suptitle(title)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run_dir", type=Path, required=True, help="folder with metrics.jsonl")
    p.add_argument("--out", type=Path, required=True, help="PNG file to write")
    p.add_argument("--channels", nargs="+", default=list(DEFAULT_CHANNELS), help="channels to plot")
    args = p.parse_args(argv)
    epochs = read_metrics(args.run_dir)
    unknown = [c for c in args.channels if c not in epochs[-1]["rmse"]]
    if unknown:
        raise SystemExit(f"error: unknown channel(s) {', '.join(unknown)}; "
                         f"choose from {', '.join(epochs[-1]['rmse'])}")
    plot(epochs, tuple(args.channels), args.out, title=str(args.run_dir))
    last = epochs[-1]
    print(f"wrote {args.out}; after step {last['step']}: val loss {last['val_loss']:.4f}, "
          + ", ".join(f"RMSE({c}) {last['rmse'][c]:.3f} vs persistence {last['persistence'][c]:.3f}"
                      for c in args.channels))


if __name__ == "__main__":
    sys.exit(main())
