"""What every entry script shares: command-line flags, run set-up, error handling.

train.py, train_graph.py and train_mp.py differ only in the Trainer they run (and
train_mp.py in a few extra flags); parsing, the process group, the run directory and
logging are done here once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from utils import device as dev
from utils import preemption
from utils.config import DEFAULT_YAML, Config, load_config, with_overrides
from utils.distributed import DistEnv, init_distributed, parse_env
from utils.logging_utils import setup_logging
from utils.trainer import RunContext, Trainer, TrainingError, local_batch_size

log = logging.getLogger(__name__)


def arg_parser(description: str) -> argparse.ArgumentParser:
    """Flags shared by all training scripts. A flag left out keeps the YAML value."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--yaml_config", default=str(DEFAULT_YAML), help="YAML file of configurations")
    p.add_argument("--config", default="base", help="configuration name in the YAML file")
    p.add_argument("--run_num", default="00", help="run name inside the config's log folder")
    p.add_argument("--num_iters", type=int, help="optimizer steps to train")
    p.add_argument("--local_batch_size", type=int,
                   help="per-rank batch (default: global_batch_size / data-parallel ranks)")
    p.add_argument("--global_batch_size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--num_data_workers", type=int, help="DataLoader workers (0 = load in the main process)")
    p.add_argument("--data_loader_config", choices=("pytorch", "dali"))
    p.add_argument("--amp_mode", choices=("none", "fp16", "bf16"))
    p.add_argument("--enable_fused", action=argparse.BooleanOptionalAction, default=None,
                   help="fused Adam (--no-enable_fused to switch off)")
    p.add_argument("--enable_jit", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the model and loss (--no-enable_jit to switch off)")
    p.add_argument("--expdir", help="root of the run directories")
    p.add_argument("--data_dir", help="ERA5 folder with train/, valid/, stats/")
    p.add_argument("--seed", type=int)
    p.add_argument("--checkpoint_every", type=int, help="steps between checkpoints (0 = only at the end)")
    p.add_argument("--limit_nsamples", type=int)
    p.add_argument("--limit_nsamples_val", type=int)
    prof = p.add_argument_group("profiling window (utils/profiling.py)")
    prof.add_argument("--profile_epoch", type=int,
                      help="epoch (0-based) whose steps rank 0 brackets with cudaProfilerStart/Stop")
    prof.add_argument("--profile_start_step", type=int, help="first profiled step of that epoch (0-based)")
    prof.add_argument("--profile_num_steps", type=int, help="steps in the window (default: to epoch end)")
    prof.add_argument("--profile", action=argparse.BooleanOptionalAction, default=None,
                      help="write a torch.profiler trace of the window to RUN_DIR/profile (CPU or GPU)")
    ddp = p.add_argument_group("data parallel")
    ddp.add_argument("--bucket_cap_mb", type=float, default=25.0,
                     help="DDP gradient bucket size in MB (default 25)")
    ddp.add_argument("--disable_broadcast_buffers", action="store_true",
                     help="do not broadcast module buffers from rank 0 every forward")
    ddp.add_argument("--noddp", action="store_true",
                     help="no gradient synchronisation: each rank trains alone (profiling compute only)")
    stop = p.add_argument_group("preemption (see utils/preemption.py)")
    stop.add_argument("--stop_check_every", type=int, default=10,
                      help="steps between the ranks' checks for a stop signal (TERM, USR1, USR2); "
                           "on one, training checkpoints and exits with status 75")
    return p


CONFIG_FLAGS = ("num_iters", "global_batch_size", "lr", "num_data_workers", "data_loader_config",
                "amp_mode", "enable_fused", "enable_jit", "expdir", "data_dir", "seed",
                "checkpoint_every", "limit_nsamples", "limit_nsamples_val",
                "profile_epoch", "profile_start_step", "profile_num_steps", "profile")


def resolve_config(args: argparse.Namespace, extra_flags: tuple[str, ...] = ()) -> Config:
    cfg = load_config(args.yaml_config, args.config)
    return with_overrides(cfg, **{k: getattr(args, k) for k in CONFIG_FLAGS + extra_flags})


def run_dir_for(cfg: Config, config_name: str, run_num: str, world_size: int) -> Path:
    return cfg.exp_path / config_name / f"{world_size}GPU" / str(run_num)


def ddp_options(args: argparse.Namespace) -> dict:
    if args.bucket_cap_mb <= 0:
        raise ValueError(f"--bucket_cap_mb must be positive, got {args.bucket_cap_mb}")
    return {
        "bucket_cap_mb": args.bucket_cap_mb,
        "forward_sync_buffers": not args.disable_broadcast_buffers,  # buffers always synced at init
        "gradient_as_bucket_view": True,
    }


def make_context(args: argparse.Namespace, cfg: Config, env: DistEnv, run_dir: Path) -> RunContext:
    device = dev.pick_device(env.local_rank)
    return RunContext(device=device, run_dir=run_dir, rank=env.rank, world_size=env.world_size,
                      local_rank=env.local_rank, dp_size=env.world_size, dp_rank=env.rank,
                      use_ddp=not args.noddp, ddp_options=ddp_options(args),
                      stop_check_every=args.stop_check_every)


def write_resolved_config(cfg: Config, run_dir: Path, name: str) -> None:
    from ruamel.yaml import YAML

    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "config.yaml", "w") as f:
        YAML().dump({name: cfg.to_dict()}, f)


def main(trainer_cls: type[Trainer], argv: list[str] | None = None, description: str = "",
         parser: argparse.ArgumentParser | None = None, extra_flags: tuple[str, ...] = (),
         setup: Callable[[argparse.Namespace, Config, RunContext], RunContext] | None = None) -> int:
    """Parse flags, set up ranks and logging, train; one-line errors for user mistakes.

    ``extra_flags``: more flags that override config keys. ``setup``: called once the process
    group exists, returns the context to train with (train_mp.py: its communicator groups,
    data-parallel part and run directory).
    """
    parser = parser or arg_parser(description)
    args = parser.parse_args(argv)
    env = parse_env()
    setup_logging(env.rank)
    try:
        cfg = resolve_config(args, extra_flags)
        if setup is None and cfg.tensor_parallel * cfg.context_parallel > 1:
            raise ValueError(f"config {args.config!r} sets tensor_parallel={cfg.tensor_parallel}, "
                             f"context_parallel={cfg.context_parallel}: model parallel runs use "
                             f"train_mp.py")
        run_dir = run_dir_for(cfg, args.config, args.run_num, env.world_size)
        dev.set_cpu_threads(env.local_world_size)
        ctx = make_context(args, cfg, env, run_dir)
        init_distributed(env, ctx.device)
        if setup is not None:
            ctx = setup(args, cfg, ctx)
            run_dir = ctx.run_dir
        local_batch = local_batch_size(cfg.global_batch_size, ctx.dp_size, args.local_batch_size)
        if ctx.is_main:
            write_resolved_config(cfg, run_dir, args.config)
        setup_logging(env.rank, run_dir / "out.log")
        log.info("config %s on %s, %d rank(s); run directory %s", args.config, ctx.device,
                 env.world_size, run_dir)
        trainer = trainer_cls(cfg, ctx, local_batch)
    except ValueError as err:  # a user mistake: config, flags, data
        # one write per line: print() writes the text and the newline separately, and the
        # ranks' identical messages would interleave on a shared stderr
        sys.stderr.write(f"error: {err}\n")
        sys.stderr.flush()
        return exit_now(2)
    preemption.install_handlers()
    try:
        trainer.fit()
    except TrainingError as err:
        log.error("rank %d: %s", env.rank, err)
        return exit_now(1)
    except Exception:
        log.error("rank %d failed:\n%s", env.rank, traceback.format_exc())
        return exit_now(1)
    if trainer.stopped_early:  # every rank waits until rank 0 has written the checkpoint
        if dist.is_initialized():
            dist.barrier()
        return exit_now(preemption.EXIT_STOPPED)
    if ctx.is_main:
        log.info("TensorBoard logs are in %s; view them with: tensorboard --logdir %s",
                 run_dir, cfg.exp_path)
    return exit_now(0)


def exit_now(code: int) -> int:
    """End the process at once when it is one rank of several, skipping the interpreter's
    clean-up. After an error other ranks may be waiting in a collective: joining them would
    hang, and the launcher (torchrun, srun --kill-on-bad-exit) stops them when we exit. After
    success, freeing DDP's gloo process group can deadlock (its worker thread waits for the
    GIL to free a finished collective's tensors while the main thread, holding the GIL, waits
    to join it; seen with torch 2.13 right after a barrier), and so can
    destroy_process_group. The operating system closes the connections instead."""
    if dist.is_initialized():
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
