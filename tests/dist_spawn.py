"""Run a function on several CPU ranks (gloo) and fail everywhere if any rank fails.

Every rank runs ``fn(*args)``, catches its own error, then the ranks all-reduce a failure
flag, so one failing rank makes every rank report failure instead of leaving the others
waiting in a collective. The process group has a timeout, and so does the join.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 60
# The ranks start from a fork server that has imported torch, its compiler front end (every
# optimizer's constructor imports torch._dynamo) and the project: each rank then starts in a
# fraction of a second instead of importing them again (about 2.5 s of CPU each, which the
# suite's few dozen ranks would spend on 2 cores). The server is started once per process, from
# nothing but these imports (no threads, no process group), so forking it is safe; each rank
# still gets the caller's sys.path and working folder, as with "spawn".
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.nn.parallel", "training.trainer",
           "distributed.parallelize"]


def _worker(rank: int, world: int, init_file: str, fn, args, result_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    error = ""
    try:
        fn(*args)
    except Exception:  # reported below, after every rank has said how it went
        error = traceback.format_exc()
    if error:  # before the ranks agree: once one exits, the others may be stopped at once
        with open(os.path.join(result_dir, f"rank{rank}.err"), "w") as f:
            f.write(error)
    failed = torch.tensor([1 if error else 0])
    dist.all_reduce(failed)
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: a process group still referenced (by a device
    # mesh, say) is destroyed there, and gloo's threads then once aborted a rank that had done
    # all its work ("terminate called without an active exception", 1 run in about 15).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failed.item() else 0)


def run_ranks(world: int, fn, *args) -> None:
    """Run ``fn(*args)`` on ``world`` ranks; raise AssertionError with the first rank's error."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        mp.set_forkserver_preload(PRELOAD)
        ctx = mp.start_processes(_worker, args=(world, init_file, fn, args, tmp), nprocs=world,
                                 join=False, start_method="forkserver")
        deadline = time.monotonic() + 3 * TIMEOUT_S
        try:
            while not ctx.join(timeout=2):
                if time.monotonic() > deadline:
                    for proc in ctx.processes:
                        proc.terminate()
                    raise AssertionError(f"ranks still running after {3 * TIMEOUT_S} s; stopped them")
        except mp.ProcessRaisedException as err:
            raise AssertionError(str(err)) from None
        except mp.ProcessExitedException:
            errors = [p.read_text() for p in sorted(Path(tmp).glob("rank*.err"))]
            raise AssertionError("\n".join(errors) or "a rank failed") from None
