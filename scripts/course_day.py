#!/usr/bin/env python3
"""A learner's day: the README's quick start and the pages of some parts, followed in this clone as
a learner follows them, timed.

    git clone <this repository> day && cd day
    python3 scripts/course_day.py                 # the quick start, then parts 1 to 5
    python3 scripts/course_day.py --parts 1 2 --out logs/course_day

Every command of the pages' ```bash blocks that runs on this machine is run as written, in order,
from the top of the clone (after `source .venv/bin/activate`, with .venv/bin first on PATH), and
timed; each one's output goes to OUT/NN.log. Left out, each with its reason in the report: the
Perlmutter commands (sbatch, srun, salloc, srun_pm.sh, nsys), TensorBoard (a server: it runs
until stopped), the exercises (`make exercise` fails until the learner has written its part),
the test suite, and the real-size synthetic data (optional, tens of minutes a year). Reading is
counted at WORDS_PER_MINUTE words a minute over every word of the page. Solving the exercises and
discussing the questions are not counted.

It needs only Python's standard library: it starts before `make data` has made `.venv`. The
report, OUT/day.md and OUT/day.json, names the machine (CPU model and instruction set) and the
date. A command that fails stops the day with its last lines.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from page_stats import REPO, Command, readme_commands  # noqa: E402 (runs before .venv exists)

WORDS_PER_MINUTE = 150  # technical prose read with care, tables and code included

LEFT_OUT = [  # (pattern of the command, why a learner off Perlmutter does not run it here)
    (r"^([A-Z_]+=\S+ )*(sbatch|srun|salloc|nsys)\b|^bash srun_pm\.sh ", "Perlmutter"),
    (r"^(\.venv/bin/)?tensorboard\b", "a server, watched beside the runs"),
    (r"^make exercise\b", "an exercise: fails until the learner writes its part"),
    (r"^make test\b|-m pytest\b", "the test suite, not a lesson"),
    (r"--img_size 360 720\b", "the real-size synthetic data, optional"),
]


def left_out(command: str) -> str | None:
    """Why the day does not run `command`, or None if it runs it."""
    return next((why for pattern, why in LEFT_OUT if re.search(pattern, command)), None)


def part_pages(parts: list[int]) -> list[Path]:
    return [REPO / "README.md", *(p for n in parts for p in sorted((REPO / "docs").glob(f"{n:02d}-*.md")))]


def machine() -> str:
    """CPU model and instruction set (utils/device.py's, through .venv's python: made by then)."""
    code = "from utils.device import cpu_description; import os; print(cpu_description(), os.cpu_count())"
    result = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-c", code], cwd=REPO,
                            capture_output=True, text=True)
    model, _, cores = result.stdout.strip().rpartition(" ")
    return f"{model}, {cores} cores" if result.returncode == 0 else "unknown CPU"


def run(cmd: Command, env: dict[str, str], log: Path) -> float:
    """Runs one command as a shell would, its output to `log`; its wall seconds."""
    start = time.monotonic()
    with log.open("w") as out:
        result = subprocess.run(cmd.text, shell=True, cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, executable="/bin/bash")
    seconds = time.monotonic() - start
    if result.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise SystemExit(f"error: {cmd.where}: `{cmd.text}` failed (exit {result.returncode}) after "
                         f"{seconds:.0f} s; its output is in {log}:\n{tail}")
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="parts 1 to 13")
    parser.add_argument("--out", type=Path, default=Path("logs/course_day"))
    args = parser.parse_args(argv)
    if not all(1 <= n <= 13 for n in args.parts):
        raise SystemExit(f"error: --parts {args.parts}: the parts are 1 to 13")
    out = args.out if args.out.is_absolute() else REPO / args.out
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    rows, ran, skipped = [], [], []
    for page in part_pages(args.parts):
        name = page.relative_to(REPO).as_posix()
        text = page.read_text()
        seconds = 0.0
        for cmd in readme_commands(text, name):
            if cmd.text == "source .venv/bin/activate":
                env["PATH"] = f"{REPO / '.venv' / 'bin'}:{env['PATH']}"
                env["VIRTUAL_ENV"] = str(REPO / ".venv")
                continue
            why = left_out(cmd.text)
            if why:
                skipped.append({"where": cmd.where, "command": cmd.text, "why": why})
                continue
            print(f"[{datetime.datetime.now():%H:%M:%S}] {cmd.where}: {cmd.text}", flush=True)
            log = out / f"{len(ran) + 1:02d}.log"
            ran.append({"where": cmd.where, "command": cmd.text, "log": log.name,
                        "seconds": round(run(cmd, env, log), 1)})
            seconds += ran[-1]["seconds"]
        rows.append({"page": name, "run_s": round(seconds, 1),
                     "read_s": round(len(text.split()) / WORDS_PER_MINUTE * 60, 1)})
    report = {"machine": machine(), "date": datetime.date.today().isoformat(), "parts": args.parts,
              "words_per_minute": WORDS_PER_MINUTE, "pages": rows, "commands": ran, "left_out": skipped}
    (out / "day.json").write_text(json.dumps(report, indent=1))
    run_s, read_s = sum(r["run_s"] for r in rows), sum(r["read_s"] for r in rows)
    lines = [f"{report['machine']}, {report['date']}", "", "| page | running, min | reading, min |",
             "|---|---|---|",
             *(f"| {r['page']} | {r['run_s'] / 60:.1f} | {r['read_s'] / 60:.1f} |" for r in rows),
             f"| all | {run_s / 60:.1f} | {read_s / 60:.1f} |", "",
             f"In all {(run_s + read_s) / 3600:.1f} h; left out: "
             + "; ".join(f"{s['where']} ({s['why']})" for s in skipped)]
    (out / "day.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
