#!/usr/bin/env python
"""Freezing layers as training goes, measured: what a step costs with k blocks frozen (with and
without the activation cache, against the cost model's FLOPs), fine-tuning from a checkpoint
with the earliest blocks frozen as training goes against training every layer and against
freezing random blocks, and the layout of a pipeline that shrinks as its blocks freeze.

    python scripts/freeze_report.py --init logs/tiny/1GPU/00/checkpoint.pt --out logs/freezing

Every number comes from real training runs of the project's Trainer with the freezing step
(training/freezing.py): one device for the step times and the fine-tuning, two ranks through
torchrun (train_mp.py's loop) for the pipeline. A step's time on a CPU is the CPU time the
training process spent in it, on one thread: on a machine shared with other jobs the wall
clock counts their time too (on a GPU: the wall clock, the device synchronised). Writes
OUT/freezing.md (tables), OUT/freezing.json and OUT/freezing.png (the four panels of
docs/12-freezing.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from scripts import cost_model as cm  # noqa: E402
from scripts.instruments import read_metrics, write_report  # noqa: E402
from scripts.workers import run_worker, worker_env  # noqa: E402
from training.context import Callback, RunContext  # noqa: E402
from training.freezing import freeze_order  # noqa: E402
from training.launcher import step_for  # noqa: E402
from training.trainer import EagerStep, Trainer  # noqa: E402
from utils import checkpoint as ckpt  # noqa: E402
from utils import device as dev  # noqa: E402
from utils.config import DEFAULT_YAML, Config, load_config, with_overrides  # noqa: E402


class StepClock(Callback):
    """Each step's seconds and loss; optionally the weights of a checkpoint loaded into the model
    as it is built (fine-tuning starts from them). On a CPU the seconds are this process's CPU
    time, which other processes on the machine do not lengthen; on a GPU the wall clock's, the
    device synchronised around the step."""

    def __init__(self, device: torch.device, init: Path | None = None) -> None:
        self.init = init
        self.clock = time.process_time if device.type == "cpu" else time.perf_counter
        self.steps: list[dict[str, float]] = []

    def model_built(self, trainer: Trainer) -> None:
        if self.init is not None:
            trainer.weights.load_model_state(ckpt.load(self.init)["model"])

    def step_start(self, trainer: Trainer) -> None:
        dev.synchronize(trainer.device)
        self.start = self.clock()

    def step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
        dev.synchronize(trainer.device)
        seconds = self.clock() - self.start
        self.steps.append({"step": trainer.step, "seconds": seconds, "loss": loss.item()})


def train(cfg: Config, run_dir: Path, init: Path | None = None) -> tuple[list[dict[str, float]], list[dict]]:
    """One run on this process's device: each step's time and loss, and its metrics records."""
    device = torch.device("cuda", 0) if dev.cuda_available() else torch.device("cpu")
    clock = StepClock(device, init)
    step = step_for(cfg, EagerStep)
    Trainer(cfg, RunContext(device=device, run_dir=run_dir), cfg.optim.global_batch_size, step=step,
            callbacks=[clock]).fit()
    return clock.steps, read_metrics(run_dir)


# ------------------------------------------------------------- step time vs frozen ---
def step_times(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every number of frozen blocks, frozen from the first step, recomputed or cached: the median
    step of the second epoch (the cache full), and the cost model's FLOPs for it."""
    base = config(args, args.config, limit_nsamples=args.batch * args.epoch_steps,
                  num_iters=2 * args.epoch_steps, warmup=0)
    m = cm.Model.from_config(base)
    rows = []
    for frozen in range(base.model.depth + 1):
        for cached in (False, True) if frozen else (False,):
            flags = {"freeze_schedule": "steps", "freeze_steps": (0,) * frozen,
                     "freeze_cache_mib": 1024.0 if cached else 0.0} if frozen else {}
            name = f"frozen{frozen}{'_cached' if cached else ''}"
            steps, _ = train(with_overrides(base, **flags), args.out / "runs" / name)
            seconds = statistics.median(s["seconds"] for s in steps[args.epoch_steps:])
            rows.append({"frozen": frozen, "cached": cached, "seconds": seconds,
                         "flops": cm.freezing_flops(m, args.batch, frozen, cached)["total"]})
            print(f"  {name}: {seconds * 1e3:.0f} ms per step", flush=True)
    whole = rows[0]
    for r in rows:  # the FLOPs' share of nothing frozen, times the time measured with nothing frozen
        r["predicted_seconds"] = whole["seconds"] * r["flops"] / whole["flops"]
    return rows


# ------------------------------------------------------------------- fine-tuning ---
RUNS = {"every layer trains": {},
        "earliest blocks frozen (cached)": {"freeze_schedule": "formula", "freeze_cache_mib": 1024.0},
        "random blocks frozen": {"freeze_schedule": "formula", "freeze_order": "random"}}


def fine_tuning(args: argparse.Namespace) -> dict[str, Any]:
    """From ``--init``'s weights, the same steps three ways (fresh optimizer and schedule each)."""
    base = config(args, args.finetune_config, num_iters=args.finetune_steps, dt=args.dt, seed=args.seed,
                  freeze_every=args.freeze_every, freeze_alpha=args.alpha, checkpoint_every=0)
    out = {}
    for name, flags in RUNS.items():
        steps, records = train(with_overrides(base, **flags), args.out / "runs" / name.split()[0], args.init)
        clock = 0.0
        for s in steps:
            clock += s["seconds"]
            s["elapsed"] = clock
        cfg = with_overrides(base, **flags)
        order = freeze_order(cfg) if cfg.freeze.freeze_schedule != "none" else []
        out[name] = {"steps": steps, "order": order,
                     "epochs": [{"step": r["step"], "val_loss": r["val_loss"],
                                 "frozen_blocks": r.get("frozen_blocks")} for r in records]}
        print(f"  {name}: val loss {records[-1]['val_loss']:.4f} after {clock:.1f} s of steps", flush=True)
    return out


# --------------------------------------------------------------------- pipeline ---
def worker(argv: list[str]) -> int:
    from training.launcher import main

    return main(argv=argv, description="train_mp.py for the freezing report", model_parallel=True)


def pipeline(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Two ranks, pp 2 x dp 1, the blocks freezing at ``--pipeline_freeze_steps``: each step's
    frozen blocks and stages, from the run's metrics."""
    flags = [f"--yaml_config={args.yaml_config}", f"--config={args.finetune_config}", "--run_num=pipeline",
             f"--expdir={args.out / 'runs'}", f"--num_iters={args.pipeline_steps}", "--checkpoint_every=0",
             "--pipeline_parallel=2", "--freeze_schedule=steps", "--freeze_cache_mib=1024",
             f"--limit_nsamples={args.batch * 4}", "--limit_nsamples_val=16",
             "--freeze_steps", *map(str, args.pipeline_freeze_steps), *data_flags(args)]
    run_worker(__file__, 2, flags, worker_env())
    run_dir = next((args.out / "runs" / args.finetune_config).glob("*/pipeline"))
    rows = []
    for record in read_metrics(run_dir):
        first = record["step"] - len(record["frozen_blocks"])
        rows += [{"step": first + i, "frozen": k, "stages": s}
                 for i, (k, s) in enumerate(zip(record["frozen_blocks"], record["pipeline_stages"]))]
    return rows


# ------------------------------------------------------------------ the report ---
def config(args: argparse.Namespace, name: str, **values: Any) -> Config:
    cfg = load_config(args.yaml_config, name)
    values = {"global_batch_size": args.batch, "limit_nsamples_val": 64, "checkpoint_every": 0,
              "expdir": str(args.out / "runs"), **values}
    if args.data_dir:
        values["data_dir"] = args.data_dir
    return with_overrides(cfg, **values)


def data_flags(args: argparse.Namespace) -> list[str]:
    return [f"--data_dir={args.data_dir}"] if args.data_dir else []


def markdown(args: argparse.Namespace, timing: list[dict], tuned: dict[str, Any], layout: list[dict]) -> str:
    lines = [f"Step time of `{args.config}` (batch {args.batch}, fp32), median of the second epoch's "
             f"{args.epoch_steps} steps; predicted: the cost model's FLOPs against nothing frozen, times "
             f"the measured time with nothing frozen.", "",
             "| frozen blocks | recomputed, ms | predicted | cached, ms | predicted |",
             "|---|---|---|---|---|"]
    for k in sorted({r["frozen"] for r in timing}):
        plain = next(r for r in timing if r["frozen"] == k and not r["cached"])
        cached = next((r for r in timing if r["frozen"] == k and r["cached"]), plain)
        lines.append(f"| {k} | {plain['seconds'] * 1e3:.0f} | {plain['predicted_seconds'] * 1e3:.0f} | "
                     f"{cached['seconds'] * 1e3:.0f} | {cached['predicted_seconds'] * 1e3:.0f} |")
    lines += ["", f"Fine-tuning `{args.finetune_config}` from {args.init} to a forecast {args.dt} steps "
              f"ahead, {args.finetune_steps} steps of batch {args.batch}; formula alpha {args.alpha:.3g}, "
              f"an epoch of the formula every {args.freeze_every} steps.", "",
              "| run | blocks in the order they freeze | frozen at the end | seconds of steps "
              "| last validation loss |", "|---|---|---|---|---|"]
    for name, run in tuned.items():
        frozen = run["epochs"][-1]["frozen_blocks"]
        order = ", ".join(map(str, run["order"])) or "-"
        lines.append(f"| {name} | {order} | {frozen[-1] if frozen else 0} | "
                     f"{run['steps'][-1]['elapsed']:.1f} | {run['epochs'][-1]['val_loss']:.4f} |")
    lines += ["", "Pipeline, 2 ranks: each step's frozen blocks and each stage's active blocks.", "",
              "| steps | frozen blocks | stages (active blocks) | layout |", "|---|---|---|---|"]
    for (k, stages), group in _runs(layout):
        ranks = ", ".join(f"{a}-{b - 1}" if b - a > 1 else f"{a}" for a, b in stages)
        lines.append(f"| {group[0]}-{group[-1]} | {k} | {ranks} | pp {len(stages)} x dp {2 // len(stages)} |")
    return "\n".join(lines)


def _runs(layout: list[dict]) -> list[tuple[tuple[int, tuple], list[int]]]:
    """Consecutive steps with the same frozen blocks and stages."""
    out: list = []
    for r in layout:
        key = (r["frozen"], tuple(tuple(s) for s in r["stages"]))
        if out and out[-1][0] == key:
            out[-1][1].append(r["step"])
        else:
            out.append((key, [r["step"]]))
    return out


def plot(args: argparse.Namespace, timing: list[dict], tuned: dict[str, Any], layout: list[dict],
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0, 0]
    for cached, colour in ((False, "tab:blue"), (True, "tab:orange")):
        rows = [r for r in timing if r["cached"] == cached or (cached and r["frozen"] == 0)]
        label = "cached" if cached else "recomputed"
        ax.plot([r["frozen"] for r in rows], [r["seconds"] * 1e3 for r in rows], "o-", color=colour,
                label=f"{label}: measured")
        ax.plot([r["frozen"] for r in rows], [r["predicted_seconds"] * 1e3 for r in rows], "--", color=colour,
                label=f"{label}: FLOPs (cost model)")
    ax.set(xlabel="frozen blocks", ylabel="ms per step", title=f"{args.config}: step time as blocks freeze")
    ax.legend(fontsize=8)
    window = max(1, args.finetune_steps // 20)
    for (name, run), style in zip(tuned.items(), ("-", "-", "--")):
        losses = [s["loss"] for s in run["steps"]]
        smooth = [statistics.mean(losses[max(0, i - window + 1):i + 1]) for i in range(len(losses))]
        axes[0, 1].plot([s["step"] + 1 for s in run["steps"]], smooth, style, label=name)
        axes[1, 0].plot([s["elapsed"] for s in run["steps"]], smooth, style, label=name)
    axes[0, 1].set(xlabel="step", ylabel=f"training loss (mean of {window} steps)",
                   title=f"fine-tuning from part 1's weights ({args.dt}-step forecast)")
    axes[1, 0].set(xlabel="seconds of training steps", ylabel=f"training loss (mean of {window} steps)",
                   title="the same runs against time")
    for a in (axes[0, 1], axes[1, 0]):
        a.legend(fontsize=8)
    plot_layout(axes[1, 1], layout, load_config(args.yaml_config, args.finetune_config).depth)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_layout(ax: Any, layout: list[dict], depth: int) -> None:
    """Steps across, blocks up: frozen (grey), or the colour of the stage that trains them."""
    colours = ["tab:blue", "tab:green", "tab:purple", "tab:red"]
    for r in layout:
        ax.bar(r["step"], r["frozen"], bottom=0, width=1.0, color="lightgrey", edgecolor="white")
        for s, (a, b) in enumerate(r["stages"]):
            ax.bar(r["step"], b - a, bottom=a, width=1.0, color=colours[s % 4], edgecolor="white")
    for (_, stages), group in _runs(layout):
        ax.text((group[0] + group[-1]) / 2, depth + 0.15, f"pp {len(stages)} x dp {2 // len(stages)}",
                ha="center", fontsize=8)
    ax.set(xlabel="step", ylabel="block", ylim=(0, depth + 0.6),
           title="pipeline on 2 ranks: frozen (grey), stage 0 (blue), stage 1 (green)")
    ax.set_yticks([i + 0.5 for i in range(depth)], [str(i) for i in range(depth)])


def driver(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--yaml_config", default=str(DEFAULT_YAML))
    p.add_argument("--config", default="tiny_deep", help="the model whose step time is measured")
    p.add_argument("--finetune_config", default="tiny", help="the model of --init, fine-tuned")
    p.add_argument("--init", type=Path, required=True, help="the checkpoint fine-tuning starts from")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--epoch_steps", type=int, default=4, help="step times: steps per epoch (2 epochs)")
    p.add_argument("--finetune_steps", type=int, default=240)
    p.add_argument("--dt", type=int, default=2, help="fine-tuning: forecast this many 6-hour steps ahead")
    p.add_argument("--alpha", type=float, default=1 / 3, help="fine-tuning: the formula's alpha")
    p.add_argument("--freeze_every", type=int, default=48, help="fine-tuning: steps per epoch of the formula")
    p.add_argument("--seed", type=int, default=1, help="fine-tuning: the data order and the random blocks' "
                   "order (seed 0 draws 0, 1, 3, 2 for 4 blocks: almost the earliest first)")
    p.add_argument("--pipeline_steps", type=int, default=16)
    p.add_argument("--pipeline_freeze_steps", type=int, nargs="+", default=[4, 8, 12])
    p.add_argument("--data_dir", default=None, help="every run's data (default: the configs')")
    p.add_argument("--out", type=Path, default=Path("logs/freezing"))
    p.add_argument("--replot", action="store_true", help="draw OUT/freezing.png again from OUT/freezing.json "
                   "(no runs)")
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    torch.set_num_threads(1)  # (the CPU time of one thread: see the module's docstring)
    if args.replot:
        data = json.loads((args.out / "freezing.json").read_text())
        plot(args, data["step_times"], data["fine_tuning"], data["pipeline"], args.out / "freezing.png")
        return 0
    if not args.init.is_file():
        raise SystemExit(f"error: {args.init} does not exist; train part 1's run first "
                         f"(python train.py --config {args.finetune_config})")
    print(f"step time per number of frozen blocks ({args.config}):", flush=True)
    timing = step_times(args)
    print(f"fine-tuning {args.finetune_config} from {args.init}:", flush=True)
    tuned = fine_tuning(args)
    print("a pipeline of 2 ranks as its blocks freeze:", flush=True)
    layout = pipeline(args)
    text = markdown(args, timing, tuned, layout)
    write_report(args.out, "freezing", text, {"step_times": timing, "fine_tuning": tuned, "pipeline": layout})
    plot(args, timing, tuned, layout, args.out / "freezing.png")
    print(text)
    print(f"wrote {args.out / 'freezing.md'} and {args.out / 'freezing.png'}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2:]))
    sys.exit(driver())
