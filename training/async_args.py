"""scripts/async_sgd.py's command line: its flags beside train.py's, the one-line refusals of what a
mode cannot run, and the run folder's name (the training is in training/async_sgd.py)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from training.launcher import arg_parser
from utils.config import Config

MODES = ("hogwild", "locked", "ddp", "server", "delayed")


def parser(description: str) -> argparse.ArgumentParser:
    p = arg_parser(description)
    p.add_argument("--mode", required=True, choices=MODES, help="see scripts/async_sgd.py --help's text")
    p.add_argument("--workers", type=int, default=2, help="hogwild, locked: processes sharing the model")
    p.add_argument("--staleness", type=int, default=0, help="delayed: updates between the weights a "
                   "gradient is computed at and the weights it updates")
    p.add_argument("--slow_rank", type=int, default=None, help="the worker (hogwild: 0 .. workers - 1; "
                   "torchrun modes: the rank) that sleeps --slow_ms before each gradient")
    p.add_argument("--slow_ms", type=float, default=0.0)
    p.add_argument("--log_every", type=int, default=20, help="updates per metrics record")
    return p


def run_dir_of(cfg: Config, args: argparse.Namespace, world: int) -> Path:
    """logs/CONFIG/MODE/RUN: 'server_2w' (2 trainers), 'hogwild_2w', 'ddp_2w', 'delayed_s3'."""
    workers = {"server": world - 1, "ddp": world}.get(args.mode, args.workers)
    name = f"delayed_s{args.staleness}" if args.mode == "delayed" else f"{args.mode}_{workers}w"
    if args.slow_rank is not None:  # check() made sure it names a worker and slows it
        name += f"_slow{args.slow_rank}"
    return cfg.exp_path / args.config / name / (args.run_num or "00")


def ignored_flags(cfg: Config) -> list[str]:
    """The train.py flags set away from their defaults that no mode here reads: each worker trains
    the serial model, in fp32 or bf16, one batch per update, unclipped."""
    lay = cfg.layout
    kept = {"--tensor_parallel": lay.tensor_parallel == 1, "--context_parallel": lay.context_parallel == 1,
            "--pipeline_parallel": lay.pipeline_parallel == 1, "--expert_parallel": lay.expert_parallel == 1,
            "--data_parallel": lay.replicated, "--engine": lay.engine == "native",
            "--grad_compression": lay.grad_compression == "none",
            "--freeze_schedule": cfg.freeze.freeze_schedule == "none",
            "--grad_accum_steps": cfg.memory.grad_accum_steps == 1,
            "--grad_clip_norm": cfg.optim.grad_clip_norm == 0, "--enable_jit": not cfg.optim.enable_jit,
            "--activation_checkpointing": cfg.memory.activation_checkpointing == "none",
            "--amp_mode fp16": cfg.optim.amp_mode != "fp16"}
    return [flag for flag, default in kept.items() if not default]


def check(cfg: Config, args: argparse.Namespace, world: int) -> None:
    """One-line refusals of what the mode cannot run."""
    launched = args.mode in ("ddp", "server")
    if launched and world < 2:
        least = "a server and 1 trainer at least" if args.mode == "server" else "2 ranks"
        raise ValueError(f"--mode {args.mode} runs on ranks: start it with torchrun --nproc_per_node 2 or "
                         f"more ({least})")
    if not launched and world > 1:
        raise ValueError(f"--mode {args.mode} starts its own processes: run it with python, not torchrun")
    workers = {"server": world - 1, "ddp": world, "delayed": 1}.get(args.mode, args.workers)
    if workers < 1 or cfg.optim.global_batch_size % workers:
        raise ValueError(f"global_batch_size {cfg.optim.global_batch_size} does not split over {workers} "
                         f"worker(s); choose a number of workers that divides it")
    if args.staleness < 0 or args.log_every < 1 or not 0 <= args.slow_ms < math.inf:
        raise ValueError("--staleness and --slow_ms must be 0 or more, --log_every at least 1")
    if args.staleness and args.mode != "delayed":
        raise ValueError(f"--staleness sets the delayed mode's fixed staleness; --mode {args.mode} has the "
                         f"staleness its timing gives: leave it out")
    if args.mode == "delayed" and args.staleness >= cfg.optim.num_iters:
        raise ValueError(f"--staleness {args.staleness} is not below the run's {cfg.optim.num_iters} "
                         f"updates: every gradient would be at the first weights")
    if getattr(args, "checkpoint_every", None) and args.mode in ("ddp", "delayed"):  # given, not configured
        raise ValueError(f"--checkpoint_every: --mode {args.mode} keeps no checkpoint (the server and "
                         f"Hogwild do); leave it out")
    if (args.slow_rank is None) != (args.slow_ms == 0):
        raise ValueError("--slow_rank and --slow_ms make one worker a straggler: give both, or neither")
    ranks = {"hogwild": range(args.workers), "locked": range(args.workers), "ddp": range(world),
             "server": range(1, world), "delayed": range(0)}[args.mode]
    if args.slow_rank is not None and args.slow_rank not in ranks:
        which = f"{ranks.start} .. {ranks.stop - 1}" if len(ranks) else "none: it runs in one process"
        raise ValueError(f"--slow_rank {args.slow_rank} is no worker of --mode {args.mode} (its workers: "
                         f"{which})")
    unused = ignored_flags(cfg)
    if unused:
        raise ValueError(f"scripts/async_sgd.py trains the serial model in each worker: {', '.join(unused)} "
                         f"would be ignored; leave {'it' if len(unused) == 1 else 'them'} out")
    data = Path(cfg.data.data_dir) / "train"
    if not data.is_dir():
        raise ValueError(f"{data} does not exist: pass --data_dir, the folder with train/, valid/ and stats/")
