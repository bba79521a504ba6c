#!/usr/bin/env python
"""The learning-rate range test: train with a learning rate that grows exponentially each step,
record the loss, stop when it diverges, and suggest a learning rate from the curve.

    python scripts/lr_range_test.py --config tiny
    python scripts/lr_range_test.py --config tiny --lr_min 1e-6 --lr_max 1 --steps 200 --expdir logs
    python scripts/lr_range_test.py --config tiny --optimizer LAMB

The run is the config's training step as train.py takes it (model, data, optimizer, precision),
in one process; only the schedule differs: step i uses lr_min * (lr_max / lr_min) ** (i / steps).
The loss is smoothed (an exponential moving average, bias-corrected) and the test stops when the
smoothed loss exceeds 4 times its lowest value, or is not finite. The suggestion is a tenth of the
learning rate at the lowest smoothed loss (Smith's rule of thumb: at the minimum the rate is
already too large to train with; a tenth of it still makes fast progress). Writes
EXPDIR/lr_range/CONFIG/lr_range.json and lr_range.png, and prints the suggestion.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.script_config import add_config_args, load_script_config  # noqa: E402

SMOOTHING = 0.9  # weight of the past in the moving average of the loss
DIVERGED = 4.0  # stop when the smoothed loss is this many times its lowest


def range_test(cfg, steps: int, lr_min: float, lr_max: float, out: Path) -> dict:

    from training.context import RunContext
    from training.trainer import Trainer
    from utils import device as dev

    device = dev.pick_device(0, 1)
    trainer = Trainer(cfg, RunContext(device=device, run_dir=out / "run"), cfg.optim.global_batch_size)
    growth = (lr_max / lr_min) ** (1.0 / max(1, steps - 1))
    trainer.set_lr_factor(lambda i: growth ** i)

    lrs, losses, smoothed = [], [], []
    average, best, reason = 0.0, math.inf, f"reached lr_max after {steps} steps"
    for lr, loss in trainer.run_steps(steps):  # the rate grows after each step
        loss = loss.item()
        lrs.append(lr)
        losses.append(loss)
        average = SMOOTHING * average + (1 - SMOOTHING) * loss
        smoothed.append(average / (1 - SMOOTHING ** len(lrs)))
        best = min(best, smoothed[-1])
        if not math.isfinite(smoothed[-1]) or smoothed[-1] > DIVERGED * best:
            reason = f"diverged at lr {lr:.3g} (step {len(lrs)})"
            break
    if not lrs:
        raise ValueError(f"the training data holds fewer samples than one batch of "
                         f"{cfg.optim.global_batch_size}; use a smaller --global_batch_size or more data")
    finite = [i for i, v in enumerate(smoothed) if math.isfinite(v)]
    lowest = min(finite, key=lambda i: smoothed[i])
    return {"lr": lrs, "loss": losses, "smoothed": smoothed, "stopped": reason,
            "lowest_at_lr": lrs[lowest], "suggested_lr": lrs[lowest] / 10}


def plot(result: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), constrained_layout=True)
    ax.plot(result["lr"], result["loss"], color="#bbbbbb", lw=1, label="loss of each step")
    ax.plot(result["lr"], result["smoothed"], color="#4c72b0", label="smoothed")
    ax.axvline(result["lowest_at_lr"], color="#dd8452", ls=":",
               label=f"lowest smoothed loss: {result['lowest_at_lr']:.2g}")
    ax.axvline(result["suggested_lr"], color="#55a868", ls="--",
               label=f"suggested: {result['suggested_lr']:.2g}")
    finite = [v for v in result["smoothed"] if math.isfinite(v)]
    if finite:
        ax.set_ylim(0, min(max(finite), DIVERGED * min(finite)) * 1.1)
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.legend()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(p)
    p.add_argument("--steps", type=int, default=200, help="steps from lr_min to lr_max")
    p.add_argument("--lr_min", type=float, default=1e-6)
    p.add_argument("--lr_max", type=float, default=1.0)
    p.add_argument("--optimizer", default=None, help="Adam, AdamW, LAMB or SGD (default: the config's)")
    args = p.parse_args(argv)
    if args.steps < 2 or not 0 < args.lr_min < args.lr_max:
        p.error("--steps must be at least 2 and 0 < --lr_min < --lr_max")

    # the rate is the test's: no warm-up, no decay, no clipping of the divergence it looks for
    cfg = load_script_config(p, args, lr=args.lr_min, lr_schedule="constant", warmup=0, grad_clip_norm=0.0,
                             num_iters=args.steps, optimizer_type=args.optimizer)
    name = args.config + (f"_{args.optimizer}" if args.optimizer else "")
    out = (args.expdir or cfg.exp_path) / "lr_range" / name
    out.mkdir(parents=True, exist_ok=True)
    try:
        result = range_test(cfg, args.steps, args.lr_min, args.lr_max, out)
    except ValueError as err:  # data that cannot be read: one line
        p.exit(2, f"error: {err}\n")
    (out / "lr_range.json").write_text(json.dumps(result))
    plot(result, out / "lr_range.png",
         f"learning-rate range test: {args.config}, batch {cfg.optim.global_batch_size}, "
         f"{cfg.optim.optimizer_type}")
    print(f"{result['stopped']}; the smoothed loss was lowest at lr {result['lowest_at_lr']:.3g}")
    print(f"suggested lr: {result['suggested_lr']:.3g} (a tenth of that)")
    print(f"wrote {out / 'lr_range.json'} and {out / 'lr_range.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
