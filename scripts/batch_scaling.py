#!/usr/bin/env python
"""The scaling study: the same number of samples at global batches from 16 to 512, with the
learning rate kept constant, scaled linearly or by the square root of the batch, for Adam and
LAMB; the final validation loss of each run, plotted against the batch.

    python scripts/batch_scaling.py --config tiny
    python scripts/batch_scaling.py --config tiny --batches 16,64,256 --rules sqrt --optimizers Adam

More ranks are stood in for by gradient accumulation: a global batch B runs as B / micro_batch
micro-batches of the config's batch, whose gradients add up to the gradient of the whole batch.
That is exact here, since the model has no batch statistics (no batch norm): data parallelism
over B / micro_batch ranks would take the same steps (tests/test_sharded.py proves
accumulation, and tests/test_ddp.py data parallelism, equal to one big batch). Every run
sees ``--samples`` samples, so a batch 32 times larger takes 32 times fewer steps: the question
is which learning rate makes up for that.

    constant: lr(B) = lr0                  (the step size of the small batch)
    linear:   lr(B) = lr0 * B / B0          (Goyal et al. 2017: k times fewer, k times larger steps)
    sqrt:     lr(B) = lr0 * sqrt(B / B0)    (keeps the variance of the step: SC23's bs*_opt runs)

B0 is the config's global batch and lr0 the base rate of each optimizer (``--adam_lr``,
``--lamb_lr``). The warm-up covers the same number of samples at every batch (the config's
``warmup`` steps of B0 samples), then the rate follows the config's schedule to the end. Writes
EXPDIR/batch_scaling/CONFIG/scaling.json and scaling.png, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from utils.config import Config

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.script_config import add_config_args, load_script_config  # noqa: E402

RULES = {
    "constant": lambda batch, base: 1.0,
    "linear": lambda batch, base: batch / base,
    "sqrt": lambda batch, base: math.sqrt(batch / base),
}
COLOURS = {"constant": "#8c8c8c", "linear": "#dd8452", "sqrt": "#4c72b0"}


def scaled_lr(rule: str, lr0: float, batch: int, base_batch: int) -> float:
    return lr0 * RULES[rule](batch, base_batch)


def plan_run(cfg: Config, batch: int, micro_batch: int, samples: int) -> dict:
    """The config keys of one run: as many steps as ``samples`` fill, the warm-up over as many
    samples as the config's (cfg.warmup steps of its batch), the batch as micro-batches."""
    steps = max(1, samples // batch)
    optim = cfg.optim
    warmup = min(steps - 1, math.ceil(optim.warmup * optim.global_batch_size / batch)) if optim.warmup else 0
    return {"global_batch_size": batch, "grad_accum_steps": batch // micro_batch, "num_iters": steps,
            "warmup": warmup}


def train_once(cfg: Config, batch: int, micro_batch: int, lr: float, optimizer: str, samples: int,
               run_dir: Path) -> dict:
    """One run: ``samples // batch`` steps of global batch ``batch`` (as micro-batches of
    ``micro_batch``) with the trainer's step, then the validation loss."""
    from training.context import RunContext
    from training.trainer import Trainer
    from utils import device as dev
    from utils.config import with_overrides

    plan = plan_run(cfg, batch, micro_batch, samples)
    steps, warmup = plan["num_iters"], plan["warmup"]
    run_cfg = with_overrides(cfg, lr=lr, optimizer_type=optimizer, checkpoint_every=0, **plan)
    trainer = Trainer(run_cfg, RunContext(device=dev.pick_device(0, 1), run_dir=run_dir), batch)
    if trainer.train_data.batches_per_epoch == 0:
        raise ValueError(f"the training data holds fewer samples than one batch of {batch}; "
                         f"use smaller --batches or more data")
    start = time.time()  # epoch after epoch (at batch 512 the demo year holds one batch)
    losses = [loss for _, loss in trainer.run_steps(steps)]
    train_loss = [float(x) for x in losses]  # one host sync per run, at the end
    val = trainer.validate()
    if not all(map(math.isfinite, train_loss)):
        val["loss"] = math.inf  # diverged: the plot marks it
    return {"batch": batch, "optimizer": optimizer, "lr": lr, "steps": steps, "warmup": warmup,
            "val_loss": val["loss"], "last_train_loss": train_loss[-1], "seconds": time.time() - start}


def plot(runs: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    optimizers = sorted({r["optimizer"] for r in runs})
    fig, axes = plt.subplots(1, len(optimizers), figsize=(5.5 * len(optimizers), 4), sharey=True,
                             constrained_layout=True, squeeze=False)
    finite = [r["val_loss"] for r in runs if math.isfinite(r["val_loss"])]
    top = max(finite) * 1.5 if finite else 1.0
    bottom = min(finite) / 1.5 if finite else 0.01
    batches = sorted({r["batch"] for r in runs})
    for ax, name in zip(axes[0], optimizers):
        for rule in RULES:
            mine = sorted((r for r in runs if r["optimizer"] == name and r["rule"] == rule),
                          key=lambda r: r["batch"])
            if not mine:
                continue
            xs = [r["batch"] for r in mine]
            ys = [r["val_loss"] if math.isfinite(r["val_loss"]) else top for r in mine]
            ax.plot(xs, ys, "o-", color=COLOURS[rule], label=rule)
            for r in mine:  # a diverged run sits on the top edge, marked with a cross
                if not math.isfinite(r["val_loss"]):
                    ax.plot([r["batch"]], [top], "x", color=COLOURS[rule], markersize=10)
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_yscale("log")  # the losses span two orders of magnitude
        ax.set_xlabel("global batch (same number of samples)")
        ax.set_title(name)
        ax.set_ylim(bottom, top * 1.1)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(title="learning rate")
    axes[0][0].set_ylabel("final validation loss")
    fig.suptitle(title)
    fig.savefig(path, dpi=110)


def parse_list(text: str, kind: type) -> list:
    return [kind(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(p)
    p.add_argument("--batches", default="16,32,64,128,256,512", help="global batches, comma-separated")
    p.add_argument("--rules", default="constant,linear,sqrt", help="learning-rate scaling rules")
    p.add_argument("--optimizers", default="Adam,LAMB")
    p.add_argument("--samples", type=int, default=5120, help="training samples of every run "
                   "(tiny's 320 steps of 16)")
    p.add_argument("--micro_batch", type=int, default=None,
                   help="samples per forward (default: the config's global batch)")
    p.add_argument("--adam_lr", type=float, default=None, help="Adam's rate at the config's batch "
                   "(default: the config's lr)")
    p.add_argument("--lamb_lr", type=float, default=1e-2, help="LAMB's rate at the config's batch "
                   "(the range test suggested 0.019 for tiny; docs/08-large-batches.md)")
    args = p.parse_args(argv)

    try:
        batches, rules = parse_list(args.batches, int), parse_list(args.rules, str)
        optimizers = parse_list(args.optimizers, str)
    except ValueError:
        p.error("--batches takes whole numbers separated by commas, e.g. 16,64,256")
    cfg = load_script_config(p, args)
    for name in optimizers:  # the config's own check of the name: one line if unknown
        load_script_config(p, args, optimizer_type=name)
    base, micro = cfg.optim.global_batch_size, args.micro_batch or cfg.optim.global_batch_size
    lr0 = {"Adam": args.adam_lr or cfg.optim.lr, "LAMB": args.lamb_lr}
    unknown = [r for r in rules if r not in RULES]
    if unknown:
        p.error(f"unknown rule {unknown[0]!r}; choose from {', '.join(RULES)}")
    if any(name not in lr0 for name in optimizers):
        p.error("the study compares Adam and LAMB: --optimizers takes Adam, LAMB or both")
    if not batches or any(b < micro or b % micro for b in batches):
        p.error(f"every batch must be a multiple of the micro-batch ({micro}): --batches {args.batches}")
    if args.samples < max(batches):
        p.error(f"--samples {args.samples} is less than one batch of {max(batches)}")
    if min(lr0.values()) <= 0:
        p.error("learning rates must be positive")

    out = (args.expdir or cfg.exp_path) / "batch_scaling" / args.config
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    for name in optimizers:
        for batch in batches:
            # at the base batch the three rules give the same rate: one run stands for all
            for rule in (rules if batch != base else rules[:1]):
                lr = scaled_lr(rule, lr0[name], batch, base)
                try:
                    run = train_once(cfg, batch, micro, lr, name, args.samples,
                                     out / "runs" / f"{name}_b{batch}_{rule}")
                except ValueError as err:  # data that cannot be read, or too little: one line
                    p.exit(2, f"error: {err}\n")
                same = rules if batch == base else [rule]
                runs += [{**run, "rule": r} for r in same]
                print(f"{name:5s} batch {batch:4d} {rule:8s} lr {lr:.3g}: {run['steps']} steps, "
                      f"val loss {run['val_loss']:.4f} ({run['seconds']:.0f} s)", flush=True)
    (out / "scaling.json").write_text(json.dumps({"config": args.config, "base_batch": base,
                                                  "samples": args.samples, "lr0": lr0, "runs": runs}))
    plot(runs, out / "scaling.png",
         f"{args.config}: {args.samples} samples at each batch (lr0 at batch {base}: "
         + ", ".join(f"{n} {lr0[n]:g}" for n in optimizers) + ")")
    print(f"\nfinal validation loss ({args.samples} samples each; lr at batch {base}: "
          + ", ".join(f"{n} {lr0[n]:g}" for n in optimizers) + ")")
    print("optimizer  rule      " + "".join(f"{b:>9d}" for b in batches))
    for name in optimizers:
        for rule in rules:
            cells = {r["batch"]: r["val_loss"] for r in runs if r["optimizer"] == name and r["rule"] == rule}
            print(f"{name:10s} {rule:9s}" + "".join(f"{cells[b]:9.4f}" for b in batches))
    best = min(runs, key=lambda r: (r["batch"] != max(batches), r["val_loss"]))
    print(f"best at batch {max(batches)}: {best['optimizer']} with the {best['rule']} rule "
          f"(lr {best['lr']:.3g}, val loss {best['val_loss']:.4f})")
    print(f"wrote {out / 'scaling.json'} and {out / 'scaling.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
