"""Asynchronous SGD on the course's model, against synchronous data parallelism.

    python scripts/async_sgd.py --config tiny --mode hogwild --workers 2
    torchrun --standalone --nproc_per_node 3 scripts/async_sgd.py --config tiny --mode server

Every mode trains the serial ViT from the seed with the configuration's optimizer and learning-
rate schedule (counted in updates), one update per batch of global_batch_size / workers samples:

- ``hogwild``: worker processes share one model in shared memory, each with its own optimizer
  and data shard and one thread, and update it with no lock (Recht et al., 2011; as
  pytorch/examples' mnist_hogwild): a gradient may be computed on weights another worker is
  writing;
- ``locked``: the same with every optimizer step under one lock: each update writes whole
  weights, its gradient may still be stale;
- ``ddp``: synchronous data parallelism (torchrun): every step waits for every rank;
- ``server``: a parameter server (torchrun: rank 0 serves, the others train;
  distributed/param_server.py);
- ``delayed``: one process; update t uses the gradient at the weights ``--staleness`` s updates
  old, W(t + 1) = W(t) - lr grad f_t(W(t - s)): asynchronous SGD's rule with a fixed staleness,
  replayed as a server's log would be (:func:`replay`).

``--slow_rank R --slow_ms MS`` makes one worker a straggler (it sleeps before each gradient).
Each run writes RUN_DIR/metrics.jsonl (a record per ``--log_every`` updates: updates so far,
training loss, samples/s, staleness; the last also the validation loss), RUN_DIR/weights.pt
(the final weights) and, for the server, RUN_DIR/updates.json (each gradient's trainer, version,
staleness and whether it was applied, in the order received: :func:`replay` reproduces the run
from it). The server and Hogwild write a checkpoint every ``--checkpoint_every`` updates and
resume from it (training/async_checkpoint.py).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import queue
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.utils import parameters_to_vector

from distributed import param_server
from distributed.env import all_reduce_sum, heartbeat, init_distributed, parse_env
from networks.backbone import Backbone, build
from training import async_checkpoint as saves
from training.async_args import check, parser, run_dir_of
from training.launcher import exit_now, resolve_config, setup_logging
from training.schedule import make_lr_lambda, optimizer_choice
from utils import attention
from utils import device as dev
from utils.config import Config
from utils.config_groups import OptimizerConfig
from utils.data_loader import get_data_loader
from utils.metrics import relative_l2_loss

log = logging.getLogger(__name__)

CPU = torch.device("cpu")


# ------------------------------------------------------------ what every mode shares ---
def build_model(cfg: Config) -> Backbone:
    """The serial model with the weights every run of the course starts from."""
    model = build(cfg.model)
    model.reset_parameters(torch.Generator().manual_seed(cfg.run.seed))
    return model


def make_optimizer(cfg: OptimizerConfig, params: Any) -> tuple[torch.optim.Optimizer, Any]:
    optimizer_class, options = optimizer_choice(cfg, dev.adam_kernel(cfg.enable_fused))
    optimizer = optimizer_class(params, **options)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, make_lr_lambda(cfg))


def batches(cfg: Config, local_batch: int, shards: int = 1, shard: int = 0, skip: int = 0) -> Iterator[Any]:
    """One worker's training batches, epoch after epoch, as train.py's data-parallel rank ``shard``
    of ``shards`` reads them; a resumed worker ``skip``s those it drew before."""
    loader, _, sampler = get_data_loader(cfg, "train", local_batch, True, num_shards=shards, shard_id=shard)

    def every_epoch() -> Iterator[Any]:
        for epoch in itertools.count():
            sampler.set_epoch(epoch)
            yield from loader

    return itertools.islice(every_epoch(), skip, None)


class Worker:
    """Computes gradients on its own batches: train.py's forward, loss and backward (its
    precision and attention kernel), into ``model``'s ``.grad``."""

    def __init__(self, cfg: Config, model: torch.nn.Module, data: Iterator[Any], slow_s: float = 0.0) -> None:
        self.cfg, self.model, self.data, self.slow_s = cfg, model, data, slow_s
        dtype = dev.AMP_DTYPES[cfg.optim.amp_mode] or torch.float32
        self.kernel = attention.choose(cfg.optim.attention_kernel, CPU, dtype,
                                       attention.call_shape(cfg.model, 1)[1])

    def gradient(self) -> float:
        inp, tar = next(self.data)
        if self.slow_s:  # a straggler, on purpose
            time.sleep(self.slow_s)
        with dev.autocast(CPU, self.cfg.optim.amp_mode), attention.kernel(self.kernel):
            pred = self.model(inp)
        loss = relative_l2_loss(pred.float(), tar)
        loss.backward()
        return loss.item()


def flat_grad(params: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in params])


@torch.no_grad()
def set_flat(params: list[torch.nn.Parameter], flat: torch.Tensor, grad: bool = False) -> None:
    """Copy a flat vector (parameters_to_vector's order) into the parameters, or their gradients."""
    offset = 0
    for p in params:
        piece = flat[offset: offset + p.numel()].view_as(p)
        if grad:
            p.grad = piece.clone()
        else:
            p.copy_(piece)
        offset += p.numel()


# ------------------------------------------------------------ Hogwild, with or without a lock ---
def hogwild_worker(cfg: Config, model: Backbone, rank: int, workers: int, lock: Any, count: Any, results: Any,
                   ready: Any, pause: saves.HogwildPause, begin: tuple[dict | None, int],
                   slow_s: float) -> None:
    """One process of a Hogwild run: its own optimizer on the shared weights, its own shard. The
    run's updates are claimed from a shared counter, first come first served (a slow worker
    makes fewer), whose number also sets the update's learning rate. ``begin``: a resumed
    worker's optimizer state and the batches it had drawn."""
    torch.set_num_threads(1)
    parent = os.getppid()
    optimizer, _ = make_optimizer(cfg.optim, model.parameters())
    if begin[0] is not None:
        optimizer.load_state_dict(begin[0])
    factor = make_lr_lambda(cfg.optim)
    data = batches(cfg, cfg.optim.global_batch_size // workers, workers, rank, begin[1])
    worker = Worker(cfg, model, data, slow_s)
    ready.wait()  # every worker set up: the clock starts
    while os.getppid() == parent:  # a worker whose parent was killed stops
        with count.get_lock():
            number = count.value
            if number >= cfg.optim.num_iters:
                break
            due = pause.due(number, cfg.optim.num_iters)
            count.value += 0 if due else 1
        if due:  # a checkpoint: every worker waits here until the parent has the weights
            pause.send(results, rank, optimizer, number)
            if not pause.wait(number):
                return
            continue
        for group in optimizer.param_groups:
            group["lr"] = cfg.optim.lr * factor(number)
        loss = worker.gradient()
        with lock or contextlib.nullcontext():
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        results.put((rank, loss, time.perf_counter()))


def run_hogwild(cfg: Config, args: argparse.Namespace, run_dir: Path) -> int:
    torch.set_num_threads(1)  # before any work: the workers are forked from this process
    model = build_model(cfg)
    state = saves.load(run_dir)
    if state is not None:
        model.load_state_dict(state.weights)
    model.share_memory()  # the workers' updates land in this process's model
    ctx = mp.get_context("fork")
    lock = ctx.Lock() if args.mode == "locked" else None
    begun = state.updates if state else 0
    count, results, ready = ctx.Value("i", begun), ctx.Queue(), ctx.Barrier(args.workers + 1)
    folder = tempfile.TemporaryDirectory()  # the workers' optimizer states at a checkpoint
    pause = saves.HogwildPause(ctx, cfg.run.checkpoint_every, args.workers, begun,
                               cfg.layout.collective_timeout_s, Path(folder.name))
    begins = [(state.optimizers[w], state.drawn(w)) if state else (None, 0) for w in range(args.workers)]
    # daemons: a worker left stopped or hung never keeps this process from ending
    procs = [ctx.Process(target=hogwild_worker, daemon=True, args=(
        cfg, model, w, args.workers, lock, count, results, ready, pause, begins[w], slow(args, w)))
        for w in range(args.workers)]
    for p in procs:
        p.start()
    log.info("hogwild workers' pids: %s", " ".join(str(p.pid) for p in procs))
    try:
        ready.wait(timeout=cfg.layout.collective_timeout_s)
    except threading.BrokenBarrierError:  # a worker did not get ready in time
        return give_up(procs, {}, cfg.layout.collective_timeout_s, "before the first update")
    start = time.perf_counter() - (state.log[-1]["seconds"] if state else 0.0)
    heard = dict.fromkeys(range(len(procs)), time.monotonic())  # each worker's last message
    done = list(state.log) if state else []  # {"trainer", "loss", "seconds"} per update, as they came
    states: dict[int, dict] = {}  # the workers' optimizers at a checkpoint
    limit = cfg.layout.collective_timeout_s
    while len(done) < cfg.optim.num_iters or any(p.is_alive() for p in procs):
        try:
            item = results.get(timeout=min(1.0, limit))
        except queue.Empty:
            item = None
        if item is not None and item[0] == "state":
            heard[item[1]], states[item[1]] = time.monotonic(), pause.received(item[1])
            if len(states) == len(procs):
                hogwild_checkpoint(cfg, run_dir, model, pause, states, done)
        elif item is not None:
            heard[item[0]] = time.monotonic()
            done.append({"trainer": item[0], "loss": item[1], "seconds": item[2] - start})
        now = time.monotonic()  # a worker that died, or has been silent for the timeout (stopped, hung)
        stuck = [w for w, p in enumerate(procs) if p.exitcode is None and now - heard[w] > limit]
        lost = item is None and len(done) < cfg.optim.num_iters and not any(p.is_alive() for p in procs)
        if stuck or lost or any(p.exitcode not in (None, 0) for p in procs):
            return give_up(procs, heard, limit, f"after {len(done)} updates")
    saves.finish(cfg, args, run_dir, model, done, cfg.optim.global_batch_size // args.workers)
    return 0


def hogwild_checkpoint(cfg: Config, run_dir: Path, model: Backbone, pause: saves.HogwildPause,
                       states: dict[int, dict], done: list[dict[str, Any]]) -> None:
    """Every worker waits with its optimizer's state sent (each sent its updates before it):
    copy the weights, let the workers go on, write the checkpoint."""
    weights = saves.weights_of(model)
    pause.release(len(done))
    saves.save(run_dir, saves.AsyncState(weights, [states[w] for w in sorted(states)], list(done)), cfg)
    states.clear()


def process_state(pid: int) -> str:
    """The process's state letter from Linux's /proc (T: stopped), or "" where it cannot be read."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def give_up(procs: list[Any], heard: dict[int, float], timeout_s: float, when: str) -> int:
    """One line naming the workers that died or stopped responding; every worker ended."""
    now, named = time.monotonic(), []
    for w, p in enumerate(procs):
        if p.exitcode is not None and p.exitcode != 0:
            how = f"was killed by signal {-p.exitcode}" if p.exitcode < 0 else f"exited with {p.exitcode}"
            named.append(f"worker {w} (pid {p.pid}) {how}")
        elif p.exitcode is None and w not in heard:
            named.append(f"worker {w} (pid {p.pid}) never got ready")
        elif p.exitcode is None and now - heard[w] > timeout_s:
            # a frozen worker may hold the update counter's lock: the others then wait for it
            frozen = process_state(p.pid) == "T"
            how = "is stopped (SIGSTOP, or a debugger)" if frozen else "stopped responding"
            named.append(f"worker {w} (pid {p.pid}) {how} (no update for {now - heard[w]:.0f} s)")
    named.sort(key=lambda line: "stopped responding" in line or "never got ready" in line)  # causes first
    log.error("hogwild gave up %s: %s", when, "; ".join(named) or "no worker made an update in time")
    for p in procs:
        if p.exitcode is None:
            p.kill()
        p.join(timeout=5)
    return 1


# ------------------------------------------------------------ synchronous: DDP ---
def run_ddp(cfg: Config, args: argparse.Namespace, run_dir: Path) -> int:
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(cfg)
    ddp = DistributedDataParallel(model)  # averages the gradients over the ranks in backward
    optimizer, scheduler = make_optimizer(cfg.optim, model.parameters())
    local = cfg.optim.global_batch_size // world
    worker = Worker(cfg, ddp, batches(cfg, local, world, rank), slow(args, rank))
    dist.barrier()  # every rank set up: the clock starts
    start, updates = time.perf_counter(), []
    for _ in range(cfg.optim.num_iters):
        loss = torch.tensor(worker.gradient())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        updates.append({"trainer": rank, "loss": all_reduce_sum(loss).item() / world,
                        "seconds": time.perf_counter() - start})
    if rank == 0:  # one update of the global batch per step
        saves.finish(cfg, args, run_dir, model, updates, cfg.optim.global_batch_size)
    return 0


# ------------------------------------------------------------ the parameter server ---
def run_server(cfg: Config, args: argparse.Namespace, run_dir: Path) -> int:
    rank, trainers = dist.get_rank(), list(range(1, dist.get_world_size()))
    model = build_model(cfg)
    state = saves.load(run_dir)  # on every rank: a trainer skips the batches it drew
    if state is not None:
        model.load_state_dict(state.weights)
    params = list(model.parameters())
    local = cfg.optim.global_batch_size // len(trainers)
    if rank != 0:
        data = batches(cfg, local, len(trainers), rank - 1, state.drawn(rank) if state else 0)
        worker = Worker(cfg, model, data, slow(args, rank))
        dist.barrier()  # every rank set up: the server's clock starts

        beat, computed = heartbeat(), itertools.count()

        def gradient(weights: torch.Tensor) -> tuple[torch.Tensor, float]:
            if beat is not None:  # where this trainer is, for a diagnosis on another rank
                beat.mark(next(computed), "a gradient for the server")
            set_flat(params, weights)
            loss = worker.gradient()
            grad = flat_grad(params)
            model.zero_grad(set_to_none=True)
            return grad, loss

        param_server.work(parameters_to_vector(params).detach(), gradient)
        return 0
    optimizer, scheduler = make_optimizer(cfg.optim, params)
    if state is not None:
        optimizer.load_state_dict(state.optimizers[0])
        scheduler.load_state_dict(state.schedule)
    dist.barrier()
    beat, applied = heartbeat(), itertools.count()

    def apply(grad: torch.Tensor) -> torch.Tensor:
        if beat is not None:
            beat.mark(next(applied), "serving updates")
        set_flat(params, grad, grad=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        return parameters_to_vector(params).detach()

    def after(updates: int, received: list[param_server.Update]) -> None:
        every = cfg.run.checkpoint_every
        if every and updates % every == 0 and updates < cfg.optim.num_iters:
            saves.save(run_dir, saves.AsyncState(saves.weights_of(model), [optimizer.state_dict()],
                                                 [asdict(u) for u in received], scheduler.state_dict()), cfg)

    done = [param_server.Update(**u) for u in state.log] if state else None
    received = param_server.serve(parameters_to_vector(params).detach(), apply, trainers, cfg.optim.num_iters,
                                  done, after)
    (run_dir / "updates.json").write_text(json.dumps(
        [[u.trainer, u.version, u.staleness, u.applied] for u in received]))
    updates = [{"trainer": u.trainer, "loss": u.loss, "seconds": u.seconds, "staleness": u.staleness}
               for u in received if u.applied]
    saves.finish(cfg, args, run_dir, model, updates, local)
    return 0


# ------------------------------------------------------------ replay, fixed staleness ---
def replay(cfg: Config, log_: list[tuple[int, int]], trainers: int) -> tuple[Backbone, list[float]]:
    """A server's run in one process, from its log: for each (trainer, version) in the order the
    server applied them, trainer's next batch's gradient at the weights of that version, applied
    to the newest weights. Trainer r (1 .. ``trainers``) reads data shard r - 1, as in the run.
    Keeps only the versions a later entry of the log still uses."""
    server, at = build_model(cfg), build_model(cfg)  # the newest weights; where gradients are computed
    params, at_params = list(server.parameters()), list(at.parameters())
    optimizer, scheduler = make_optimizer(cfg.optim, params)
    local = cfg.optim.global_batch_size // trainers
    workers = {r: Worker(cfg, at, batches(cfg, local, trainers, r - 1)) for r in {r for r, _ in log_}}
    last_use = {version: i for i, (_, version) in enumerate(log_)}
    versions = {0: parameters_to_vector(params).detach().clone()}
    losses = []
    for i, (trainer, version) in enumerate(log_):
        set_flat(at_params, versions[version])
        losses.append(workers[trainer].gradient())
        set_flat(params, flat_grad(at_params), grad=True)
        at.zero_grad(set_to_none=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        versions[i + 1] = parameters_to_vector(params).detach().clone()
        versions = {v: w for v, w in versions.items() if last_use.get(v, -1) > i}
    return server, losses


def run_delayed(cfg: Config, args: argparse.Namespace, run_dir: Path) -> int:
    torch.set_num_threads(1)
    made_up = [(1, max(0, t - args.staleness)) for t in range(cfg.optim.num_iters)]
    start = time.perf_counter()
    model, losses = replay(cfg, made_up, trainers=1)
    seconds = (time.perf_counter() - start) / len(losses)
    updates = [{"trainer": 1, "loss": loss, "seconds": (i + 1) * seconds, "staleness": min(i, args.staleness)}
               for i, loss in enumerate(losses)]
    saves.finish(cfg, args, run_dir, model, updates, cfg.optim.global_batch_size)
    return 0


# ------------------------------------------------------------ what a run writes ---
def slow(args: argparse.Namespace, worker: int) -> float:
    return args.slow_ms / 1000 if worker == args.slow_rank else 0.0


# ------------------------------------------------------------ the command line ---
RUNS = {"hogwild": run_hogwild, "locked": run_hogwild, "ddp": run_ddp, "server": run_server,
        "delayed": run_delayed}


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__.split("\n\n")[0]).parse_args(argv)
    env = parse_env()
    setup_logging(env.rank)
    try:
        cfg = resolve_config(args)
        check(cfg, args, env.world_size)
        run_dir = run_dir_of(cfg, args, env.world_size)
        if (run_dir / "metrics.jsonl").exists():
            raise ValueError(f"{run_dir} holds a finished run; pass another --run_num")
        saves.check_resumable(run_dir, cfg)
    except ValueError as err:
        sys.stderr.write(f"error: {err}\n")
        return exit_now(2)
    dev.set_cpu_threads(env.local_world_size)
    init_distributed(env, CPU, cfg.layout.collective_timeout_s, cfg.layout.rendezvous_timeout_s, "gloo")
    if env.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        setup_logging(0, run_dir / "out.log")
    processes = {"hogwild": args.workers, "locked": args.workers, "delayed": 1}.get(args.mode, env.world_size)
    log.info("%s on %d process(es): %s", args.mode, processes, run_dir)
    try:
        code = RUNS[args.mode](cfg, args, run_dir)
    except Exception as err:  # a collective that gave up (a rank stopped or died): say who, in a line
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        log.error("rank %d: --mode %s stopped: %s", env.rank, args.mode, first[:300])
        beat = heartbeat()
        if beat is not None:
            log.error("%s", beat.diagnosis())
        code = 1
    return exit_now(code)
