"""What every entry script shares: command-line flags, run set-up, error handling.

train.py, train_graph.py and train_mp.py differ only in the Trainer they run and in
whether model-parallel dimensions may be larger than 1; parsing, the process group, the
device mesh, the run directory and logging are done here once.

Every config key is a flag of the same name (generated from utils/config.py, with its
help text); a flag left out keeps the YAML value.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import sys
import traceback
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from distributed import mesh as meshes
from distributed.env import any_rank, heartbeat, init_distributed, parse_env
from training import run_dir as rundir
from training.context import Callback, RunContext, local_batch_size
from training.trainer import EagerStep, Trainer, TrainingError
from utils import device as dev
from utils import signals
from utils.config import DEFAULT_YAML, FIELDS, GROUPS, REPO_ROOT, Config, load_config, with_overrides
from utils.config_groups import OptimizerConfig, ParallelConfig

log = logging.getLogger(__name__)

DEFAULT_RUN_NUM = "00"


# ------------------------------------------------------------------------ logs ---
# Logging set-up: rank 0 logs INFO to the console and out.log; other ranks WARNING.
#
# Until the run's log file exists (it is created only once the run is sure to start, so a
# run that fails before training leaves nothing on disk), rank 0's records are kept in
# memory and written to the file first when it is opened.
FORMAT = "%(asctime)s %(levelname)s %(message)s"
BUFFER_LIMIT = 10_000  # records kept before the log file exists (a start-up produces tens)


class _StartupBuffer(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) < BUFFER_LIMIT:
            self.records.append(record)


def setup_logging(rank: int = 0, log_file: Path | None = None) -> None:
    """Console logging; with ``log_file`` (rank 0) also the file, starting with what was logged
    since the last call without one."""
    root = logging.getLogger()
    buffered = [r for h in root.handlers if isinstance(h, _StartupBuffer) for r in h.records]
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    fmt = logging.Formatter(FORMAT if rank == 0 else f"[rank {rank}] {FORMAT}")
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(fmt)
    root.addHandler(console)
    if rank != 0:
        return
    if log_file is None:
        root.addHandler(_StartupBuffer())
        return
    log_file.parent.mkdir(parents=True, exist_ok=True)
    file_handler = logging.FileHandler(log_file)
    file_handler.setFormatter(fmt)
    for record in buffered:
        file_handler.handle(record)
    root.addHandler(file_handler)


# ----------------------------------------------------------------------- flags ---


def _flag_type(hint: Any) -> tuple[Any, dict[str, Any]]:
    """argparse type and extra options for a Config field's type hint."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is tuple:  # tuple[int, ...]: any number of values, none included
        return args[0], {"nargs": "*" if args[-1] is Ellipsis else len(args)}
    if args:  # Optional[X]
        hint = args[0]
    if hint is bool:
        return None, {"action": argparse.BooleanOptionalAction}
    return hint, {}


def add_config_flags(parser: argparse.ArgumentParser, keys: tuple[str, ...] | None = None) -> None:
    """One flag per config key (or per key of ``keys``: a script that takes some of train.py's
    flags, such as the cost model's layout), in argument groups named after the configuration's
    groups. A flag left out is None: the YAML value stays."""
    for group in GROUPS.values():
        fields = [f for f in dataclasses.fields(group) if keys is None or f.name in keys]
        if not fields:
            continue
        section = parser.add_argument_group(group.title, (group.__doc__ or "").split("\n\n")[0])
        hints = typing.get_type_hints(group)
        for f in fields:
            ftype, extra = _flag_type(hints[f.name])
            if ftype is not None:
                extra["type"] = ftype
            if "choices" in f.metadata:
                extra["choices"] = f.metadata["choices"]
            section.add_argument(f"--{f.name}", *f.metadata.get("aliases", ()), dest=f.name, default=None,
                                 help=f.metadata.get("help"), **extra)


def arg_parser(description: str = "") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--yaml_config", default=str(DEFAULT_YAML), help="YAML file of configurations")
    p.add_argument("--config", default="base", help="configuration name in the YAML file")
    p.add_argument("--run_num", default=None,
                   help=f"run name inside the config's log folder (default {DEFAULT_RUN_NUM}; when that "
                        f"folder holds a run with other settings, the next free number)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None,
                   help="passed by DeepSpeed's launcher (deepspeed --num_gpus N); the rank is read "
                        "from the environment (LOCAL_RANK) as under torchrun")
    add_config_flags(p)
    return p


def resolve_config(args: argparse.Namespace) -> Config:
    cfg = load_config(args.yaml_config, args.config)
    return with_overrides(cfg, **{name: getattr(args, name) for name in FIELDS if hasattr(args, name)})


def run_dir_for(cfg: Config, config_name: str, run_num: str, mesh: meshes.ParallelMesh,
                model_parallel: bool) -> Path:
    """logs/CONFIG/4GPU/RUN; model-parallel lessons name every size ('4GPU_tp2_cp1_dp2'), so runs
    at different layouts never share a directory."""
    layout = mesh.layout_name() if model_parallel else f"{mesh.world_size}GPU"
    if cfg.layout.expert_parallel > 1:
        layout += f"_ep{cfg.layout.expert_parallel}"
    if cfg.layout.engine == "deepspeed":  # '2GPU_ds2', '2GPU_ds3_offload': never a native run's folder
        layout += f"_ds{cfg.layout.zero_stage}" + ("_offload" if cfg.memory.cpu_offload else "")
    return cfg.exp_path / config_name / layout / str(run_num)


def write_resolved_config(cfg: Config, run_dir: Path, name: str) -> None:
    from ruamel.yaml import YAML

    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "config.yaml", "w") as f:
        YAML().dump({name: cfg.to_dict()}, f)


def _check_lesson(cfg: Config, config_name: str, model_parallel: bool) -> None:
    split = meshes.model_parallel_sizes(cfg.layout)
    if split and not model_parallel:
        sizes = ", ".join(f"{meshes.DIMENSIONS[n]}={s}" for n, s in split.items())
        raise ValueError(f"config {config_name!r} sets {sizes}: model parallel runs use train_mp.py")
    if cfg.layout.engine == "deepspeed" and model_parallel:
        raise ValueError("--engine deepspeed runs train.py's data parallelism (ZeRO stages); use "
                         "train.py --engine deepspeed")
    if cfg.layout.expert_parallel > 1 and not model_parallel:
        raise ValueError(f"--expert_parallel {cfg.layout.expert_parallel} splits the experts over ranks: "
                         f"expert parallel runs use train_mp.py")


def check_backend(cfg: ParallelConfig, device: torch.device) -> None:
    """What the chosen process-group backend cannot do on this device, as a ValueError."""
    if cfg.dist_backend == "nccl" and device.type != "cuda":
        raise ValueError("--dist_backend nccl needs GPUs with CUDA and this machine has none; use "
                         "--dist_backend gloo (or auto) on CPUs")
    if cfg.dist_backend == "gloo" and device.type == "cuda" and cfg.pipeline_parallel > 1:
        # torch's backend table: gloo's send and recv take CPU tensors only
        raise ValueError("pipeline stages pass activations with send and recv, which gloo does not do "
                         "for GPU tensors; use --dist_backend nccl (one rank per GPU) for pipelines")


def precision_warning(cfg: OptimizerConfig, device: torch.device) -> str | None:
    """One line when this CPU computes the run's low-precision matmuls far slower than fp32 ones
    (no bf16/fp16 arithmetic): the learner who turns on mixed precision should know at once."""
    slowdown = dev.low_precision_slowdown(device, cfg.amp_mode)
    if slowdown < 2:
        return None
    amp = cfg.amp_mode
    return (f"{amp} matmuls take {slowdown:.0f} times as long as fp32 ones on this CPU (it has "
            f"no {amp} arithmetic, so torch computes them in generic code): autocast makes this "
            f"run slower, not faster. Mixed precision pays on GPUs and on CPUs with AVX-512 BF16 or AMX; "
            f"--amp_mode none trains in fp32")


def check_layout(cfg: Config, config_name: str, model_parallel: bool, world_size: int,
                 ranks_per_node: int, step: type[EagerStep] = EagerStep) -> tuple[dict[str, int], int]:
    """Everything a run checks of its flags against its ranks before it starts a process group
    (a pure function: tests/test_perlmutter_commands.py runs it on the pages' Slurm commands),
    the step variant's own refusals included (``step``: the script's). Returns every dimension's
    size (dp included) and the local batch; ValueError otherwise."""
    _check_lesson(cfg, config_name, model_parallel)
    full = meshes.check_sizes(world_size, meshes.requested_sizes(cfg.layout), cfg.layout.parallel_order)
    meshes.check_expert_parallel(full[meshes.DATA], cfg.layout.expert_parallel)
    meshes.check_model(cfg.model, cfg.layout)
    meshes.check_takes_effect(cfg.layout, cfg.memory, full, ranks_per_node)
    local_batch = local_batch_size(cfg.optim.global_batch_size, full[meshes.DATA], cfg.optim.local_batch_size)
    step_for(cfg, step).check(cfg, None, local_batch)
    return full, local_batch


def set_up(args: argparse.Namespace, model_parallel: bool,
           step: type[EagerStep] = EagerStep) -> tuple[Config, RunContext, int]:
    """Config, process group, mesh and run directory; raises ValueError for user mistakes."""
    env = parse_env()
    cfg = resolve_config(args)
    sizes = meshes.requested_sizes(cfg.layout)
    _, local_batch = check_layout(cfg, args.config, model_parallel, env.world_size, env.local_world_size,
                                  step)
    dev.set_cpu_threads(env.local_world_size)
    lay = cfg.layout
    device = dev.pick_device(env.local_rank, env.local_world_size, share_gpus=lay.dist_backend == "gloo")
    check_backend(cfg.layout, device)
    init_distributed(env, device, lay.collective_timeout_s, lay.rendezvous_timeout_s, lay.dist_backend)
    mesh = meshes.build_mesh(sizes, lay.parallel_order, device.type)
    run_dir = run_dir_for(cfg, args.config, args.run_num or DEFAULT_RUN_NUM, mesh, model_parallel)
    ctx = RunContext(device=device, run_dir=run_dir, rank=env.rank, world_size=env.world_size,
                     local_rank=env.local_rank, mesh=mesh)
    return cfg, ctx, local_batch


def step_for(cfg: Config, script_step: type[EagerStep]) -> type[EagerStep]:
    """The step variant this run needs, chosen once: freezing's (training/freezing.py, eager or with
    pipeline stages) when the configuration freezes layers, else a script's own (train_graph.py's,
    whose checks refuse what it cannot run), else pipeline stages or DeepSpeed's engine when the
    configuration asks for them (each imported only then), else the eager step."""
    if cfg.freeze.freeze_schedule != "none":
        if script_step is not EagerStep:
            raise ValueError(f"--freeze_schedule {cfg.freeze.freeze_schedule} changes which layers train as "
                             f"the run goes, which this script's step does not follow; use train.py or "
                             f"train_mp.py")
        if cfg.layout.pipeline_parallel > 1:
            from training.repipelining import FreezingPipelineStep

            return FreezingPipelineStep
        from training.freezing import FreezingStep

        return FreezingStep
    if script_step is not EagerStep:
        return script_step
    if cfg.layout.pipeline_parallel > 1 and cfg.layout.pipeline_schedule == "async_1f1b":
        from training.async_pipeline import AsyncPipelineStep

        return AsyncPipelineStep
    if cfg.layout.pipeline_parallel > 1:
        from training.pipelined import PipelineStep

        return PipelineStep
    if cfg.layout.engine == "deepspeed":
        from training.deepspeed_engine import DeepSpeedStep

        return DeepSpeedStep
    return script_step


def main(step: type[EagerStep] = EagerStep, argv: list[str] | None = None, description: str = "",
         model_parallel: bool = False, callbacks: Sequence[Callback] = ()) -> int:
    """Parse flags, set up ranks and logging, train; one-line errors for user mistakes.

    ``step``: the script's step variant (train_graph.py's CUDA graphs; pipelines and DeepSpeed
    are chosen by the configuration). ``model_parallel``: whether the lesson allows dimensions
    other than dp larger than 1 (train_mp.py); its run directories then name every parallel
    size. ``callbacks``: hooks of a script that measures the run, or of a test. Nothing is
    written to the run directory before the run is sure to start (see training/run_dir.py).
    """
    args = arg_parser(description).parse_args(argv)
    setup_logging(parse_env().rank if _env_ok() else 0)
    lock = None
    try:
        if args.run_num is not None:
            rundir.check_run_num(args.run_num)
        cfg, ctx, local_batch = set_up(args, model_parallel, step)
        rundir.check_can_create(ctx.run_dir)
        if args.run_num is None:  # a learner who named no run: never refused for other settings
            free = rundir.free_run_dir(ctx.run_dir, cfg)
            if free != ctx.run_dir:
                log.info("%s holds a run with other settings; this run goes to %s (choose the folder "
                         "with --run_num)", ctx.run_dir, free)
                ctx = dataclasses.replace(ctx, run_dir=free)
        previous = rundir.previous_run(ctx.run_dir)
        if previous is not None:
            rundir.check_same_run(previous, cfg, ctx.run_dir)
            if previous["step"] >= cfg.optim.num_iters:
                log.info("%s already took all %d steps; nothing to do, nothing changed. To train again "
                         "pass another --run_num, or --num_iters N (above %d) to train it further",
                         ctx.run_dir, cfg.optim.num_iters, previous["step"])
                return exit_now(0)
        log.info("%s", dev.environment_summary(ctx.device))
        slow = precision_warning(cfg.optim, ctx.device)
        if slow:
            log.warning("%s", slow)
        log.info("config %s on %s, %d rank(s); run directory %s", args.config, ctx.device,
                 ctx.world_size, ctx.run_dir)
        trainer = Trainer(cfg, ctx, local_batch, step=step_for(cfg, step), callbacks=callbacks)
        lock = lock_run_dir(ctx)
        if ctx.is_main:
            write_resolved_config(cfg, ctx.run_dir, args.config)
        setup_logging(ctx.rank, ctx.run_dir / "out.log")
    except ValueError as err:  # a user mistake: config, flags, data, environment
        # one write per line: print() writes the text and the newline separately, and the
        # ranks' identical messages would interleave on a shared stderr
        sys.stderr.write(f"error: {err}\n")
        sys.stderr.flush()
        return exit_now(2)
    try:
        code = train(trainer, cfg, ctx, step)
    finally:
        if lock is not None:
            lock.release()
    return exit_now(code)


def lock_run_dir(ctx: RunContext) -> rundir.RunLock | None:
    """Rank 0 locks the run directory; every rank learns whether it could."""
    lock, problem = None, None
    if ctx.is_main:
        lock = rundir.RunLock(ctx.run_dir)
        try:
            lock.acquire()
        except ValueError as err:
            lock, problem = None, err
    if any_rank(problem is not None, ctx.device):
        raise problem or ValueError(f"{ctx.run_dir} is in use by another run (rank 0 names it)")
    return lock


def train(trainer: Trainer, cfg: Config, ctx: RunContext, script_step: type[EagerStep] = EagerStep) -> int:
    """Fit (in each layout the run asks for); the exit status (0, 1 for a failure, 75 for a stop
    signal after the checkpoint)."""
    signals.install_handlers()
    try:
        trainer.fit()
        while trainer.next_layout is not None:
            trainer = in_next_layout(trainer, script_step)
            gc.collect()  # the previous Trainer's model, optimizer and loaders (they refer to each other)
            trainer.fit()
        if trainer.stopped_early:  # every rank waits until rank 0 has written the checkpoint
            if dist.is_initialized():
                dist.barrier()
            # by now a signal sent to every task (Slurm's scancel --signal) has reached this rank
            # too, even where another rank's reached the stop agreement first
            log.warning("stopped with the checkpoint of step %d; the stop signal reached this rank: %s",
                        trainer.step, signals.received() or "no")
            marker = os.environ.get("TRAINING_STOPPED_FILE")  # scripts/slurm_common.sh's
            if marker and ctx.is_main:  # every rank has stopped: the batch script may requeue
                Path(marker).write_text(f"step {trainer.step}\n")
    except TrainingError as err:
        log.error("rank %d: %s", ctx.rank, err)
        return 1
    except Exception:
        log.error("rank %d failed:\n%s", ctx.rank, traceback.format_exc())
        beat = heartbeat()
        if beat is not None:  # a collective that gave up: say who did not arrive (distributed/health.py)
            log.error("%s", beat.diagnosis())
        return 1
    finally:
        signals.restore_handlers()
    if trainer.stopped_early:
        return signals.EXIT_STOPPED
    if ctx.is_main:
        log.info("TensorBoard logs are in %s; view them with: %s --logdir %s",
                 ctx.run_dir, tensorboard_command(), cfg.exp_path)
    return 0


def in_next_layout(trainer: Trainer, script_step: type[EagerStep]) -> Trainer:
    """The Trainer that continues ``trainer``'s run in the layout it asked for (training/freezing.py:
    half the pipeline stages, twice the data-parallel ranks): new process groups over the same
    ranks, the same run folder, resumed from the checkpoint the other one has just written."""
    log.info("step %d: the run continues with %s, from a checkpoint", trainer.step,
             ", ".join(f"{k} {v}" for k, v in trainer.next_layout.items()))
    cfg = with_overrides(trainer.cfg, **trainer.next_layout)
    mesh = meshes.next_mesh(trainer.ctx.mesh, meshes.requested_sizes(cfg.layout), cfg.layout.parallel_order,
                            trainer.device.type)
    ctx = dataclasses.replace(trainer.ctx, mesh=mesh)
    local_batch = local_batch_size(cfg.optim.global_batch_size, ctx.dp_size, cfg.optim.local_batch_size)
    return Trainer(cfg, ctx, local_batch, step=step_for(cfg, script_step), callbacks=trainer.callbacks)


def tensorboard_command(root: Path = REPO_ROOT) -> str:
    """How to start TensorBoard here, as printed: the repository's venv one if there is one
    (a fresh clone after `make train` has not activated it), else the one on PATH (a container)."""
    return ".venv/bin/tensorboard" if (root / ".venv" / "bin" / "tensorboard").exists() else "tensorboard"


def _env_ok() -> bool:
    try:
        parse_env()
    except ValueError:
        return False
    return True


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
