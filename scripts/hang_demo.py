#!/usr/bin/env python
"""What a hang looks like, and how to find who caused it: two ranks that call their collectives
differently, first as they are, then with the diagnosis switched on.

    python scripts/hang_demo.py                 # both cases, 10 s collective timeout
    python scripts/hang_demo.py --case shape --timeout 5

Cases (each starts 2 gloo ranks on this machine, twice):

- ``skip``: rank 1 skips the all-reduce of step 1 (a bug such as ``if rank != 1 or step != 1``)
  and goes on to write a checkpoint. Nothing fails at once: rank 0's all-reduce of step 1
  pairs with rank 1's of step 2 (collectives match by their order, not by any name), so both
  get a wrong sum. Rank 0's last all-reduce then has no partner and waits.
- ``shape``: the ranks all-reduce tensors of different sizes (4 and 8 elements).

The first run of each case is what you get by default: gloo's timeout message, or a process
killed by an abort, and no word of which rank is at fault. The second adds what this
project and PyTorch offer: the process group's timeout (short here, ``--collective_timeout_s``
in training), ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (PyTorch checks before every collective that
all ranks call the same one with the same shapes, and a monitored barrier names the ranks that
did not arrive), the heartbeat of distributed/health.py (the one line that training runs
also log) and faulthandler (each rank still running at the deadline dumps its Python stack).
Each run ends by itself (at most ``--timeout`` plus 15 s); the script exits 1 if a
diagnosed run did not name rank 1.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.workers import worker_env  # noqa: E402

CASES = ("skip", "shape")
STEPS = 3


# -------------------------------------------------------------- one rank ---
def rank_main(rank: int, case: str, port: int, timeout: float, diagnose: bool) -> int:
    import faulthandler

    import torch
    import torch.distributed as dist

    # the store is served by the demo itself (run_case), so that it outlives both ranks
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=timeout))
    beat = None
    if diagnose:
        from distributed import health

        beat = health.start("127.0.0.1", port, rank, 2)
        # still running just after the collective timeout: print every thread's Python stack
        faulthandler.dump_traceback_later(timeout + 0.5, exit=False)
    try:
        if case == "skip":
            for step in range(STEPS):
                if rank == 1 and step == 1:  # the bug: rank 1 skips this step's all-reduce
                    continue
                if beat:
                    beat.mark(step, "all_reduce of the gradients")
                x = torch.full((4,), float(step + 1))
                dist.all_reduce(x)
                print(f"step {step}: all_reduce gave {x[0].item():g} (expected {2 * (step + 1)})", flush=True)
            if beat:
                beat.mark(STEPS - 1, "writing a checkpoint")
            if rank == 1:  # rank 1 believes it is done and works on (the demo's 'checkpoint')
                # until rank 0 has given up (and, diagnosed, written its diagnosis: 2.5 s)
                time.sleep(timeout + (3 if diagnose else 1.5))
        else:
            if beat:
                beat.mark(0, "all_reduce of the gradients")
            x = torch.ones(4 if rank == 0 else 8)
            dist.all_reduce(x)
            print(f"all_reduce gave {x.tolist()}", flush=True)
    except Exception as err:
        print(f"error: {type(err).__name__}: {short(str(err))}", flush=True)
        if beat:
            stack = "".join(traceback.format_tb(err.__traceback__)).rstrip()
            print(f"its Python stack:\n{stack}", flush=True)
            print(f"diagnosis: {beat.diagnosis()}", flush=True)
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)  # skip the process group's teardown: the other rank may be gone


def short(message: str) -> str:
    """The first line of a backend's message, with DETAIL's collective fingerprints shortened."""
    line = message.strip().splitlines()[0] if message.strip() else ""
    line = re.sub(r"CollectiveFingerPrint\(SequenceNumber=(\d+), OpType=(\w+), TensorShape=(\[[^\]]*\]).*?"
                  r"(?=, but|$)", r"\2 of shape \3 (collective #\1)", line)
    return line[:400]


# -------------------------------------------------------------- the demo ---
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(case: str, timeout: float, diagnose: bool) -> tuple[str, float]:
    """Both ranks of one run; returns their output, prefixed by rank, and the seconds taken."""
    import torch.distributed as dist

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False,  # noqa: F841
                           timeout=datetime.timedelta(seconds=30))
    env = worker_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("TORCH_DISTRIBUTED_DEBUG", None)
    if diagnose:
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"  # read when torch starts: set before the ranks do
    start = time.monotonic()
    flags = ["--case", case, "--port", str(port), "--timeout", str(timeout)]
    flags += ["--diagnose"] if diagnose else []
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), *flags], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outputs = []
    for r, p in enumerate(procs):
        left = max(1.0, timeout + 15 - (time.monotonic() - start))
        try:
            out, _ = p.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += "\n(still running at the demo's deadline: killed)"
        status = (f"killed by {signal.Signals(-p.returncode).name}" if p.returncode < 0
                  else f"exit status {p.returncode}")
        lines = [ln for ln in out.splitlines() if ln.strip() and not ln.startswith("[W")]
        outputs += [f"  [rank {r}] {ln}" for ln in lines] + [f"  [rank {r}] ({status})"]
    return "\n".join(outputs), time.monotonic() - start


def names_rank_1(output: str) -> bool:
    """Whether rank 0's error or diagnosis names rank 1 (the rank at fault in both cases)."""
    said = [ln.removeprefix("  [rank 0] ") for ln in output.splitlines() if ln.startswith("  [rank 0] ")]
    return any(re.search(r"\b[Rr]anks? 1\b", ln) for ln in said if ln.startswith(("error:", "diagnosis:")))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", choices=(*CASES, "both"), default="both")
    p.add_argument("--timeout", type=float, default=10.0, help="the collective timeout, seconds")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--diagnose", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.timeout <= 0 or args.timeout > 60:
        p.error("--timeout must be between 0 and 60 seconds")
    if args.rank is not None:
        return rank_main(args.rank, args.case, args.port, args.timeout, args.diagnose)
    missed = []
    for case in (CASES if args.case == "both" else (args.case,)):
        for diagnose in (False, True):
            title = "with the diagnosis" if diagnose else "as it is"
            print(f"== case {case}, {title} (collective timeout {args.timeout:g} s)", flush=True)
            out, seconds = run_case(case, args.timeout, diagnose)
            print(out)
            print(f"  ended after {seconds:.1f} s\n", flush=True)
            if diagnose and not names_rank_1(out):
                missed.append(case)
    if missed:
        print(f"the diagnosis did not name rank 1 in case(s) {', '.join(missed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
