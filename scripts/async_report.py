#!/usr/bin/env python
"""What asynchronous training costs and buys on the course's model, measured in real runs.

    python scripts/async_report.py --out logs/async

Parts (``--parts``, all by default):

- ``timeline``: one step of flushed 1F1B and of the asynchronous pipeline (weight stashing), when
  each stage ran each micro-batch's forward and backward (scripts/pipeline_report.py's recorder);
- ``throughput``: samples/s of flushed and asynchronous pipelines in plain training runs of
  ``--throughput_steps`` steps (the recorder's hooks cost time of their own);
- ``pipeline``: the validation loss after ``--pipeline_steps`` steps of flushed 1F1B and of the
  asynchronous schedule in each mode (train_mp.py on ``--stages`` ranks), at each ``--lrs``;
- ``staleness``: the training loss against updates of SGD whose gradients are 0, 1 and 3 updates
  stale (scripts/async_sgd.py --mode delayed);
- ``straggler``: samples/s of synchronous DDP, the parameter server and Hogwild with 2 workers,
  each alone and with one worker slowed by ``--slow_ms`` before every batch.

Writes OUT/async.md and OUT/async.json (every number), OUT/async_timeline.png and
OUT/async_staleness.png; the runs go to OUT/runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.instruments import read_metrics, write_report  # noqa: E402
from scripts.workers import worker_env  # noqa: E402

PARTS = ("timeline", "throughput", "pipeline", "staleness", "straggler")
# (schedule, weight_stashing, micro-batches per step: 0 for --microbatches): each mode in its paper's
# setting. PipeDream's modes update once per micro-batch; 2BW needs p - 1 or more per step; the rules
# of the flushed schedule and of 2BW do not depend on the number
PIPELINE_MODES = (("1f1b", None, 0), ("async_1f1b", "stash", 1), ("async_1f1b", "vertical", 1),
                  ("async_1f1b", "none", 1), ("async_1f1b", "2bw", 0))


def launch(ranks: int, script: str, flags: list[str]) -> None:
    """``script FLAGS`` in one process, or on ``ranks`` ranks through torchrun."""
    start = [sys.executable] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    cmd = start + [str(REPO / script), *flags]
    result = subprocess.run(cmd, cwd=REPO, env=worker_env(), capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"error: {' '.join(cmd)} failed:\n{result.stderr[-2000:]}")


def common(args: argparse.Namespace) -> list[str]:
    return [f"--yaml_config={args.yaml_config}", f"--config={args.config}", f"--expdir={args.out / 'runs'}",
            "--checkpoint_every=0", f"--limit_nsamples_val={args.val_samples}", *args.flags]


# ------------------------------------------------------------------ the parts ---
def timeline(args: argparse.Namespace) -> list[dict[str, Any]]:
    """pipeline_report.py's recording of one step's forwards and backwards, flushed and not, on
    --timeline_stages ranks (drawn); and with one micro-batch per step, where a flushed pipeline
    (GPipe: 1F1B needs as many micro-batches as stages) idles most."""
    from scripts import pipeline_report

    report = argparse.Namespace(yaml_config=args.yaml_config, config=args.config, out=args.out, steps=4,
                                batch=args.batch, stages_per_rank=2, flags=args.flags)
    p, asynchronous = args.timeline_stages, pipeline_report.ASYNC
    rows = [pipeline_report.measure(report, s, p, m)
            for s, m in (("1f1b", args.microbatches), (asynchronous, args.microbatches), ("gpipe", 1),
                         (asynchronous, 1))]
    pipeline_report.plot(rows[:2], args.out / "async_timeline.png")
    return [{k: r[k] for k in ("schedule", "pp", "microbatches", "bubble_on_paper", "bubble_measured")}
            for r in rows]


def throughput(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Flushed against asynchronous at one micro-batch per step (GPipe: 1F1B needs as many as
    stages) and at --microbatches, on --timeline_stages ranks: a plain run's samples/s."""
    rows = []
    for schedule, m in (("gpipe", 1), ("async_1f1b", 1), ("1f1b", args.microbatches),
                        ("async_1f1b", args.microbatches)):
        name = f"speed_{schedule}_m{m}"
        print(f"  {name}", flush=True)
        launch(args.timeline_stages, "train_mp.py", common(args) + [
            f"--run_num={name}", f"--num_iters={args.throughput_steps}", f"--global_batch_size={args.batch}",
            f"--limit_nsamples={args.batch * args.throughput_steps}",
            f"--pipeline_parallel={args.timeline_stages}", f"--pipeline_schedule={schedule}",
            f"--num_microbatches={m}"])
        last = read_metrics(next((args.out / "runs" / args.config).glob(f"*/{name}")))[-1]
        rows.append({"schedule": schedule, "pp": args.timeline_stages, "microbatches": m,
                     "samples_per_sec": last["samples_per_sec"]})
    return rows


def pipeline(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for lr in args.lrs:
        for schedule, mode, m in PIPELINE_MODES:
            m = m or args.microbatches
            name = f"{schedule}_{mode or 'flush'}_m{m}_lr{lr:g}"
            print(f"  {name}", flush=True)
            flags = common(args) + [
                f"--run_num={name}", f"--num_iters={args.pipeline_steps}", f"--lr={lr}",
                f"--global_batch_size={args.batch}", f"--pipeline_parallel={args.stages}",
                f"--pipeline_schedule={schedule}", f"--num_microbatches={m}"]
            launch(args.stages, "train_mp.py", flags + ([f"--weight_stashing={mode}"] if mode else []))
            last = read_metrics(next((args.out / "runs" / args.config).glob(f"*/{name}")))[-1]
            rows.append({"schedule": schedule, "weight_stashing": mode, "microbatches": m, "lr": lr,
                         "steps": last["step"], "val_loss": last["val_loss"],
                         "samples_per_sec": last["samples_per_sec"]})
    return rows


def sgd_run(args: argparse.Namespace, ranks: int, name: str, flags: list[str]) -> tuple[Path, list[dict]]:
    launch(ranks, "scripts/async_sgd.py",
           common(args) + [f"--run_num={name}", f"--global_batch_size={args.batch}", *flags])
    folder = next((args.out / "runs" / args.config).glob(f"*/{name}"))
    return folder, read_metrics(folder)


def staleness(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for s in (0, 1, 3):
        print(f"  staleness {s}", flush=True)
        _, logged = sgd_run(args, 1, f"staleness{s}", ["--mode=delayed", f"--staleness={s}",
                                                       f"--num_iters={args.sgd_updates}", "--log_every=10"])
        rows.append({"staleness": s, "updates": [m["step"] for m in logged],
                     "train_loss": [m["train_loss"] for m in logged], "val_loss": logged[-1]["val_loss"]})
    return rows


def straggler(args: argparse.Namespace) -> list[dict[str, Any]]:
    runs = (("ddp", 2, 1), ("server", 3, 2), ("hogwild", 1, 1))  # mode, processes started, the slowed one
    rows = []
    for mode, ranks, slowed in runs:
        for slow_ms in (0.0, args.slow_ms):
            name = f"{mode}_slow{slow_ms:g}"
            print(f"  {name}", flush=True)
            flags = [f"--mode={mode}", f"--num_iters={args.sgd_updates}", f"--log_every={args.sgd_updates}"]
            flags += [f"--slow_rank={slowed}", f"--slow_ms={slow_ms}"] if slow_ms else []
            flags += ["--workers=2"] if mode == "hogwild" else []
            folder, logged = sgd_run(args, ranks, name, flags)
            last = logged[-1]
            others = [n for w, n in last["updates_by_worker"].items() if int(w) != slowed]
            row = {"mode": mode, "slow_ms": slow_ms, "updates": last["step"],
                   "samples_per_sec": last["run_samples_per_sec"], "val_loss": last["val_loss"],
                   # DDP: every rank takes every step; the others: what the workers not slowed made
                   "other_updates_per_sec": (last["step"] if mode == "ddp" else sum(others) / len(others))
                   / last["run_seconds"]}
            if mode == "server":  # who made the updates, and how stale they were
                log = [u for u in json.loads((folder / "updates.json").read_text()) if u[3]]
                row["slowed_share"] = sum(u[0] == slowed for u in log) / len(log)
                row["staleness_mean"] = sum(u[2] for u in log) / len(log)
                row["slowed_staleness_mean"] = _mean([u[2] for u in log if u[0] == slowed])
            rows.append(row)
    return rows


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


# ------------------------------------------------------------------ the report ---
def markdown(result: dict[str, Any], args: argparse.Namespace) -> str:
    out = [f"Config `{args.config}`, global batch {args.batch}."]
    if "timeline" in result:
        out += ["", "| schedule | stages | micro-batches | bubble on paper | bubble measured |",
                "|---|---|---|---|---|"]
        out += [f"| {r['schedule']} | {r['pp']} | {r['microbatches']} | {r['bubble_on_paper']:.2f} "
                f"| {r['bubble_measured']:.2f} |" for r in result["timeline"]]
    if "throughput" in result:
        out += ["", f"{args.throughput_steps} steps:", "",
                "| schedule | stages | micro-batches | samples/s |", "|---|---|---|---|"]
        out += [f"| {r['schedule']} | {r['pp']} | {r['microbatches']} | {r['samples_per_sec']:.1f} |"
                for r in result["throughput"]]
    if "pipeline" in result:
        lrs = sorted({r["lr"] for r in result["pipeline"]})
        out += ["", f"Validation loss after {args.pipeline_steps} steps, {args.stages} stages:", "",
                "| schedule | micro-batches per step | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |",
                "|---|---|" + "---|" * len(lrs)]
        loss = {(r["lr"], r["schedule"], r["weight_stashing"]): r for r in result["pipeline"]}
        for schedule, mode, _ in PIPELINE_MODES:
            cells = [loss[lr, schedule, mode] for lr in lrs]
            label = "1F1B, flushed" if mode is None else f"asynchronous, {mode}"
            out.append(f"| {label} | {cells[0]['microbatches']} | "
                       + " | ".join(f"{c['val_loss']:.4f}" for c in cells) + " |")
    if "staleness" in result:
        out += ["", f"SGD with stale gradients, {args.sgd_updates} updates:", "",
                "| staleness | training loss, last 10 updates | validation loss |", "|---|---|---|"]
        out += [f"| {r['staleness']} | {r['train_loss'][-1]:.4f} | {r['val_loss']:.4f} |"
                for r in result["staleness"]]
    if "straggler" in result:
        out += ["", f"2 workers, {args.sgd_updates} updates (DDP: steps of both workers' batches), "
                    f"one worker slowed by {args.slow_ms:g} ms per batch or not:", "",
                "| mode | slowed | samples/s | the other worker's updates/s | validation loss "
                "| the slowed worker's share of updates | staleness (mean, the slowed worker's) |",
                "|---|---|---|---|---|---|---|"]
        for r in result["straggler"]:
            share = f"{r['slowed_share']:.2f}" if "slowed_share" in r else "-"
            stale = f"{r['staleness_mean']:.2f}, {r['slowed_staleness_mean'] or 0:.2f}" \
                if "staleness_mean" in r else "-"
            out.append(f"| {r['mode']} | {r['slow_ms']:g} ms | {r['samples_per_sec']:.1f} "
                       f"| {r['other_updates_per_sec']:.2f} | {r['val_loss']:.4f} | {share} | {stale} |")
    return "\n".join(out)


def plot_staleness(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        ax.plot(r["updates"], r["train_loss"], marker="o", ms=3, label=f"staleness {r['staleness']}")
    ax.set(xlabel="updates", ylabel="training loss (mean of the last 10 updates)",
           title="SGD with gradients computed at older weights")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from utils.config import DEFAULT_YAML

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--yaml_config", default=str(DEFAULT_YAML))
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    p.add_argument("--stages", type=int, default=4, help="pipeline ranks of the loss measurements")
    p.add_argument("--timeline_stages", type=int, default=2, help="pipeline ranks of the timeline (one "
                   "core each on a 2-core machine)")
    p.add_argument("--microbatches", type=int, default=4, help="the timeline's, the flushed "
                   "schedule's and 2BW's micro-batches per step (PipeDream's modes take 1)")
    p.add_argument("--batch", type=int, default=16, help="global batch")
    p.add_argument("--pipeline_steps", type=int, default=60)
    p.add_argument("--throughput_steps", type=int, default=40)
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 4e-3], help="pipeline: Adam's rates")
    p.add_argument("--sgd_updates", type=int, default=60, help="staleness and straggler runs' updates")
    p.add_argument("--slow_ms", type=float, default=1000.0)
    p.add_argument("--val_samples", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("logs/async"))
    p.add_argument("flags", nargs="*", help="more flags of the runs after --, e.g. -- --data_dir DIR")
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    result: dict[str, Any] = {}
    for part in args.parts:
        print(f"{part}:", flush=True)
        result[part] = globals()[part](args)
    if "staleness" in result:
        plot_staleness(result["staleness"], args.out / "async_staleness.png")
    md, _ = write_report(args.out, "async", markdown(result, args), result)
    print(md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
