"""Turn a sharded (FSDP) checkpoint into one consolidated file that any layout loads.

    python scripts/convert_checkpoint.py logs/tiny/4GPU/00 --out logs/tiny/1GPU/00/checkpoint.pt
    python train.py --config tiny --num_iters 640      # continues on one device

RUN is a run directory (its newest sharded checkpoint is converted) or one step folder of
its checkpoint_dcp/. Runs in one process, no GPU or process group needed. The output is
what a ddp or model-parallel run writes: whole tensors with the serial model's names.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training import sharded_checkpoint as sharded  # noqa: E402
from utils import checkpoint as ckpt  # noqa: E402

log = logging.getLogger("convert_checkpoint")


def source_folder(run: Path) -> Path:
    if (run / ".metadata").is_file():
        return run
    folder = sharded.latest(run)
    if folder is None:
        raise ValueError(f"{run} holds no sharded checkpoint (no {sharded.DCP_DIR}/{sharded.LATEST}); "
                         f"pass a run directory of a --data_parallel fsdp run")
    return folder


def convert(run: Path, out: Path) -> int:
    """Write the consolidated checkpoint; returns its step."""
    state = sharded.read_consolidated(source_folder(run))
    ckpt.save_atomic(state, out)
    return state["step"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, help="run directory, or a step folder of its checkpoint_dcp/")
    p.add_argument("--out", type=Path, required=True,
                   help=f"file to write, e.g. RUN_DIR_OF_THE_NEXT_RUN/{ckpt.CHECKPOINT_NAME}")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.out.exists():
            raise ValueError(f"{args.out} exists; remove it or choose another --out")
        step = convert(args.run, args.out)
    except ValueError as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    log.info("wrote the checkpoint of step %d to %s", step, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
