#!/usr/bin/env python
"""The project's data-parallel layouts against DeepSpeed's ZeRO stages, measured side by side:
memory per rank (parameters, gradients, optimizer state) and time per step, same model, batch
and ranks.

    python scripts/deepspeed_compare.py --config tiny --ranks 2 --out logs/deepspeed

Every row is a real train.py run (torchrun, gloo on CPU or NCCL on GPUs): `--steps` steps of
the global batch, then as many again, timed (the first epoch holds the start-up). Memory is
rank 0's from the run's metrics.jsonl: the tensors' own sizes (this rank's partitions; under
DeepSpeed the fp32 master partitions count as optimizer state, as the ZeRO paper counts them),
and on CPU the process's peak resident memory. Needs DeepSpeed (`make deepspeed`). Writes
OUT/deepspeed.md (the table), OUT/deepspeed.json and OUT/deepspeed_memory.png.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.instruments import read_metrics, write_report  # noqa: E402
from scripts.workers import worker_env  # noqa: E402
from utils.config import DEFAULT_YAML  # noqa: E402

# (label, train.py flags): the project's layouts, then DeepSpeed's stages and offload
LAYOUTS: tuple[tuple[str, list[str]], ...] = (
    ("native ddp", ["--data_parallel=ddp"]),
    ("native zero1", ["--data_parallel=zero1"]),
    ("native fsdp", ["--data_parallel=fsdp"]),
    ("deepspeed 0", ["--engine=deepspeed", "--zero_stage=0"]),
    ("deepspeed 1", ["--engine=deepspeed", "--zero_stage=1"]),
    ("deepspeed 2", ["--engine=deepspeed", "--zero_stage=2"]),
    ("deepspeed 3", ["--engine=deepspeed", "--zero_stage=3"]),
    ("deepspeed 2 offload", ["--engine=deepspeed", "--zero_stage=2", "--cpu_offload"]),
    ("deepspeed 3 offload", ["--engine=deepspeed", "--zero_stage=3", "--cpu_offload"]),
)


def measure(args: argparse.Namespace, label: str, flags: list[str]) -> dict[str, Any]:
    name = label.replace(" ", "_")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
           str(REPO / "train.py"), f"--yaml_config={args.yaml_config}", f"--config={args.config}",
           f"--run_num={name}", f"--expdir={args.out / 'runs'}", f"--num_iters={2 * args.steps}",
           f"--global_batch_size={args.batch}", f"--limit_nsamples={args.batch * args.steps}",
           "--limit_nsamples_val=8", "--checkpoint_every=0", *flags, *args.flags]
    # a fixed mmap threshold: glibc otherwise moves it as the process frees large blocks, and
    # the peak resident memory of the same run would vary from one run to the next
    env = worker_env(MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"error: {' '.join(cmd)} failed:\n{result.stderr[-2000:]}")
    run_dir = next((args.out / "runs" / args.config).glob(f"*/{name}"))
    last = read_metrics(run_dir)[-1]
    return {"layout": label, "memory_MiB": last["memory_MiB"], "train_loss": last["train_loss"],
            "step_ms": 1000 * args.batch / last["samples_per_sec"]}


def table(rows: list[dict[str, Any]]) -> list[str]:
    peak = "allocator_peak_MiB" if "allocator_peak_MiB" in rows[0]["memory_MiB"] else "peak_rss_MiB"
    lines = [f"| layout | parameters MiB | gradients MiB | optimizer state MiB | sum MiB | {peak} | "
             f"ms per step | train loss |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["memory_MiB"]
        total = m["parameters_MiB"] + m["gradients_MiB"] + m["optimizer_MiB"]
        lines.append(f"| {r['layout']} | {m['parameters_MiB']:.2f} | {m['gradients_MiB']:.2f} | "
                     f"{m['optimizer_MiB']:.2f} | {total:.2f} | {m[peak]:.0f} | {r['step_ms']:.0f} | "
                     f"{r['train_loss']:.6f} |")
    return lines


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, time) = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    labels = [r["layout"].replace("deepspeed", "DS").replace(" offload", "\noffload").replace("native ", "")
              for r in rows]
    bottom = [0.0] * len(rows)
    for key, color in (("parameters_MiB", "tab:blue"), ("gradients_MiB", "tab:orange"),
                       ("optimizer_MiB", "tab:green")):
        values = [r["memory_MiB"][key] for r in rows]
        mem.bar(labels, values, bottom=bottom, color=color, label=key.replace("_MiB", ""))
        bottom = [b + v for b, v in zip(bottom, values)]
    mem.set_ylabel("MiB on rank 0")
    mem.set_title("training state per rank (measured)")
    mem.legend(fontsize=8)
    mem.tick_params(axis="x", labelsize=7)
    time.barh(labels[::-1], [r["step_ms"] for r in rows][::-1], color="tab:gray")
    time.set_xlabel("ms per step")
    time.set_title("time per step")
    time.tick_params(axis="y", labelsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--yaml_config", default=str(DEFAULT_YAML))
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="steps per epoch; the second epoch is timed")
    p.add_argument("--batch", type=int, default=16, help="global batch")
    p.add_argument("--layouts", nargs="+", default=[label for label, _ in LAYOUTS],
                   help="which rows to run (labels as in the table)")
    p.add_argument("--out", type=Path, default=Path("logs/deepspeed"))
    p.add_argument("flags", nargs="*", help="more train.py flags after --, e.g. -- --amp_mode bf16")
    args = p.parse_args(argv)
    known = dict(LAYOUTS)
    unknown = [name for name in args.layouts if name not in known]
    if unknown:
        p.error(f"unknown layout {unknown[0]!r}; choose from: {', '.join(known)}")
    from training.deepspeed_engine import import_deepspeed

    try:
        import_deepspeed()
    except ValueError as err:
        p.error(str(err))
    args.out = args.out.resolve()
    rows = [measure(args, name, known[name]) for name in args.layouts]
    title = f"config {args.config}, {args.ranks} ranks, global batch {args.batch}"
    md = [f"{title}, {args.steps} steps timed after {args.steps} of warm-up:", "", *table(rows)]
    args.out.mkdir(parents=True, exist_ok=True)
    write_report(args.out, "deepspeed", "\n".join(md), rows)
    plot(rows, args.out / "deepspeed_memory.png", title)
    print("\n".join(md))
    print(f"wrote {args.out / 'deepspeed.md'} and {args.out / 'deepspeed_memory.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
