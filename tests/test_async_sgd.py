"""Asynchronous SGD (training/async_sgd.py, distributed/param_server.py) through its script,
scripts/async_sgd.py, against train.py's serial SGD on the same test model and data.

A parameter server with one trainer, and Hogwild's locked variant with one worker, are serial
SGD to the bit (the same gradients, applied by the same optimizer, only in another process). With
two trainers the server's updates are 1 version stale on average, and replaying its log of
(trainer, version) in this process gives its final weights to the bit: what makes an
asynchronous run testable. Synchronous DDP on 2 ranks is the serial run with the global batch.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, make_cfg, subprocess_env
from tests.ddp_helpers import metrics, run, run_dir, train_args, write_test_yaml
from tests.test_sharded import ok
from utils.checkpoint import CHECKPOINT_NAME

pytestmark = pytest.mark.timeout(300)

STEPS, BATCH = 12, 8
SGD = {"optimizer_type": "SGD", "lr": 0.5, "limit_nsamples": 40, "limit_nsamples_val": 8}
SCRIPT = str(REPO / "scripts" / "async_sgd.py")


def async_sgd(ranks: int, yaml: Path, data_dir: Path, expdir: Path,
              *flags: str) -> subprocess.CompletedProcess:
    args = train_args(yaml, data_dir, expdir, num_iters=STEPS, global_batch_size=BATCH, **SGD)
    args = [a for a in args if not a.startswith("--checkpoint_every")] + ["--log_every=4", *flags]
    launch = [sys.executable] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    return subprocess.run(launch + [SCRIPT, *args], cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=240)


def weights(folder: Path, name: str = "weights.pt") -> dict[str, torch.Tensor]:
    return torch.load(folder / name, weights_only=False)["model"]


@pytest.fixture(scope="module")
def yaml(tmp_path_factory) -> Path:
    return write_test_yaml(tmp_path_factory.mktemp("async_sgd") / "ViT.yaml")


@pytest.fixture(scope="module")
def serial(yaml, data_dir, tmp_path_factory) -> dict[str, torch.Tensor]:
    """train.py: 12 steps of SGD (momentum 0.9) on batches of 8, the learning rate's cosine."""
    expdir = tmp_path_factory.mktemp("serial_sgd")
    ok(run(1, train_args(yaml, data_dir, expdir, num_iters=STEPS, global_batch_size=BATCH, **SGD)))
    return weights(run_dir(expdir, 1), CHECKPOINT_NAME)


@pytest.mark.parametrize("ranks, mode", [(2, "server"), (1, "locked")])
def test_one_worker_is_serial_sgd_to_the_bit(ranks, mode, serial, yaml, data_dir, tmp_path):
    flags = ["--mode", mode] + (["--workers", "1"] if mode == "locked" else [])
    ok(async_sgd(ranks, yaml, data_dir, tmp_path, *flags))
    folder = tmp_path / "tiny" / f"{mode}_1w" / "00"
    got = weights(folder)
    assert all(torch.equal(got[n], serial[n]) for n in serial)
    assert [m["step"] for m in metrics(folder)] == [4, 8, 12] and "val_loss" in metrics(folder)[-1]


def test_two_trainers_are_one_version_stale_and_replay_exactly(yaml, data_dir, tmp_path):
    """Each update finds the other trainer busy with weights it has just made older, one version
    more: the staleness of the 12 updates and what the gradient still in flight at the end had
    gathered (12 - its version; the trainer of the last update is told to stop instead) add up
    to exactly (2 - 1) x 12, a mean of 1 less that end's share, whatever the two trainers' speeds
    (the operating system's, here). The log, replayed in this process: the server's weights to
    the bit."""
    from training.async_sgd import replay

    ok(async_sgd(3, yaml, data_dir, tmp_path, "--mode", "server"))
    folder = tmp_path / "tiny" / "server_2w" / "00"
    log = json.loads((folder / "updates.json").read_text())
    applied = [(t, v, s) for t, v, s, used in log if used]
    dropped = [(t, v, s) for t, v, s, used in log if not used]
    assert len(applied) == STEPS and sorted([applied[-1][0]] + [t for t, _, _ in dropped]) == [1, 2]
    assert [s for _, _, s in applied] == [i - v for i, (_, v, _) in enumerate(applied)]
    assert sum(s for _, _, s in applied) + sum(STEPS - v for _, v, _ in dropped) == (2 - 1) * STEPS
    assert metrics(folder)[-1]["staleness_mean"] == pytest.approx(
        sum(s for _, _, s in applied[-4:]) / 4)  # the metrics' last record: the last 4 updates
    cfg = make_cfg(data_dir, tmp_path, global_batch_size=BATCH, num_iters=STEPS, warmup=0,
                   **{k: v for k, v in SGD.items() if k != "limit_nsamples_val"})
    model, _ = replay(cfg, [(t, v) for t, v, _ in applied], trainers=2)
    got = weights(folder)
    assert all(torch.equal(p.detach(), got[n]) for n, p in model.named_parameters())


def test_replay_without_staleness_is_serial_sgd(serial, data_dir, tmp_path):
    """``--mode delayed``'s rule with staleness 0, in this process: train.py's weights to the bit;
    with staleness 3 it is another optimizer."""
    from training.async_sgd import replay

    cfg = make_cfg(data_dir, tmp_path, global_batch_size=BATCH, num_iters=STEPS, warmup=0,
                   **{k: v for k, v in SGD.items() if k != "limit_nsamples_val"})
    fresh, _ = replay(cfg, [(1, t) for t in range(STEPS)], trainers=1)
    assert all(torch.equal(p.detach(), serial[n]) for n, p in fresh.named_parameters())
    stale, _ = replay(cfg, [(1, max(0, t - 3)) for t in range(STEPS)], trainers=1)
    assert any(not torch.allclose(p.detach(), serial[n], atol=1e-4) for n, p in stale.named_parameters())


def test_ddp_is_serial_sgd_with_the_global_batch(serial, yaml, data_dir, tmp_path):
    """2 ranks of 4 samples, gradients averaged: the serial run's batches of 8, within fp32
    rounding (the average of two half-batch means is summed in another order)."""
    ok(async_sgd(2, yaml, data_dir, tmp_path, "--mode", "ddp"))
    got = weights(tmp_path / "tiny" / "ddp_2w" / "00")
    for name in serial:
        torch.testing.assert_close(got[name], serial[name], rtol=1e-4, atol=1e-6)


def test_hogwild_workers_update_one_shared_model(yaml, data_dir, tmp_path):
    """Two processes, no lock: every update of both lands in the parent's model (12 in all), and
    the model trains (its validation loss ends below the first updates' training loss)."""
    ok(async_sgd(1, yaml, data_dir, tmp_path, "--mode", "hogwild", "--workers", "2"))
    logged = metrics(tmp_path / "tiny" / "hogwild_2w" / "00")
    assert logged[-1]["step"] == STEPS and weights(tmp_path / "tiny" / "hogwild_2w" / "00")
    assert logged[-1]["val_loss"] < logged[0]["train_loss"]


@pytest.mark.parametrize("ranks, flags, message", [
    (1, ["--mode", "server"], "--mode server runs on ranks: start it with torchrun"),
    (1, ["--mode", "hogwild", "--workers", "3"], "does not split over 3 worker"),
    (1, ["--mode", "delayed", "--staleness", "-1"], "--staleness and --slow_ms must be 0 or more"),
    # flags a mode does not read: refused, not ignored (nor named in the run's folder)
    (1, ["--mode", "hogwild", "--staleness", "2"], "--staleness sets the delayed mode's fixed staleness"),
    (1, ["--mode", "delayed", "--staleness", "1000"], "--staleness 1000 is not below the run's 12 updates"),
    (1, ["--mode", "hogwild", "--slow_rank", "7", "--slow_ms", "5"],
     "--slow_rank 7 is no worker of --mode hogwild (its workers: 0 .. 1)"),
    (1, ["--mode", "hogwild", "--slow_rank", "1"], "--slow_rank and --slow_ms make one worker a straggler"),
    (1, ["--mode", "delayed", "--freeze_schedule", "steps", "--freeze_steps", "2"],
     "--freeze_schedule would be ignored"),
    (1, ["--mode", "delayed", "--pipeline_parallel", "2"], "--pipeline_parallel would be ignored"),
    (1, ["--mode", "delayed", "--checkpoint_every", "4"], "--mode delayed keeps no checkpoint"),
    (1, ["--mode", "delayed", "--data_dir", "/no/such/era5"],
     "/no/such/era5/train does not exist: pass --data_dir"),
])
def test_mistakes_are_one_line(ranks, flags, message, yaml, data_dir, tmp_path):
    result = async_sgd(ranks, yaml, data_dir, tmp_path, *flags)
    assert result.returncode == 2 and result.stderr.startswith("error: ") and message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "tiny").exists()  # no run folder left behind


def test_a_finish_cut_short_leaves_no_finished_run(monkeypatch, tmp_path):
    """metrics.jsonl says a run is finished: it is written last and whole, after weights.pt, so a
    run killed in between can be run again instead of being refused as finished without weights."""
    from types import SimpleNamespace

    from training import async_checkpoint as saves

    monkeypatch.setattr(saves, "get_data_loader", lambda *a, **k: ([], None, None))
    monkeypatch.setattr(saves.validation, "evaluate", lambda *a, **k: {"loss": 1.0, "rmse": {}})

    def killed(state, path):
        raise RuntimeError("killed while writing weights.pt")

    monkeypatch.setattr(saves.ckpt, "save_atomic", killed)
    cfg = SimpleNamespace(optim=SimpleNamespace(global_batch_size=2),
                          model=SimpleNamespace(n_in_channels=1, n_out_channels=1, img_size=(4, 8)),
                          data=SimpleNamespace(data_dir=str(tmp_path / "no data")))
    args = SimpleNamespace(log_every=1, mode="server")
    updates = [{"trainer": 1, "loss": 0.5, "seconds": 1.0}]
    with pytest.raises(RuntimeError, match="killed"):
        saves.finish(cfg, args, tmp_path, torch.nn.Linear(2, 2), updates, 2)
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("how", ["SIGSTOP", "SIGKILL"])
def test_a_stopped_or_killed_hogwild_worker_is_named_and_the_run_ends(how, yaml, data_dir, tmp_path):
    """A worker frozen (SIGSTOP) or killed (kill -9) mid-run: the run names it in one line and ends,
    every worker with it, within the collective timeout and a margin; no metrics.jsonl is written."""
    import os
    import re
    import signal
    import time

    args = train_args(yaml, data_dir, tmp_path, num_iters=2000, global_batch_size=BATCH, **SGD)
    args = [a for a in args if not a.startswith("--checkpoint_every")]
    command = [sys.executable, SCRIPT, *args, "--mode", "hogwild", "--workers", "2",
               "--collective_timeout_s", "5"]
    proc = subprocess.Popen(command, cwd=REPO, env=subprocess_env(PYTHONUNBUFFERED="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, pids = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            found = re.search(r"hogwild workers' pids: (\d+) (\d+)", line)
            if found:
                pids = [int(found.group(1)), int(found.group(2))]
                break
        assert pids, "".join(lines)
        time.sleep(2.0)  # training under way
        os.kill(pids[1], getattr(signal, how))
        sent = time.monotonic()
        out, _ = proc.communicate(timeout=5 + 30)
        took = time.monotonic() - sent
    finally:
        proc.kill()
        for pid in pids or []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    text = "".join(lines) + out
    assert proc.returncode == 1 and "Traceback" not in text, text[-3000:]
    what = "is stopped" if how == "SIGSTOP" else "was killed by signal 9"  # named first: the cause
    named = rf"hogwild gave up after \d+ updates: worker 1 \(pid {pids[1]}\) {what}"
    assert re.search(named, text), text[-3000:]
    assert took < 5 + 30, took
    for pid in pids:  # every worker ended: gone, or a zombie its parent's end leaves to init
        with contextlib.suppress(ProcessLookupError):
            state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}").exists() else "X"
            assert state in ("Z", "X"), (pid, state)
    assert not list(tmp_path.glob("tiny/hogwild_2w/*/metrics.jsonl"))


def _rank_pid(marker: str, rank: int) -> int | None:
    """The pid of the torchrun rank ``rank`` whose command line contains ``marker``."""
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if proc.name.isdigit() and marker in (proc / "cmdline").read_text() and \
                    f"\0RANK={rank}\0" in "\0" + (proc / "environ").read_text():
                return int(proc.name)
    return None


def _stop_a_rank(role: int, yaml: Path, data_dir: Path, folder: Path) -> tuple[int, str, float]:
    """A server with one trainer over torchrun; SIGSTOP of rank ``role`` once updates run. The exit
    status and output of the job, and the seconds until the other rank ended. (torchrun kills the
    stopped rank 30 s after its SIGTERM; here it is killed once the other has ended.)"""
    import os
    import signal
    import time

    args = train_args(yaml, data_dir, folder, num_iters=4000, global_batch_size=BATCH, **SGD)
    args = [a for a in args if not a.startswith("--checkpoint_every")]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", SCRIPT,
               *args, "--mode", "server", "--collective_timeout_s", "5"]
    env = subprocess_env(fast_start=False, PYTHONUNBUFFERED="1")  # the ranks are torchrun's own processes
    proc = subprocess.Popen(command, cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pids: list[int | None] = [None, None]
    try:
        deadline = time.monotonic() + 60
        while None in pids and time.monotonic() < deadline:
            time.sleep(0.5)
            pids = [_rank_pid(str(folder), r) for r in (0, 1)]
        assert None not in pids, "the ranks did not start"
        while time.monotonic() < deadline and not any(  # the process group up (rank 0 logs after it)
                "process(es)" in log.read_text() for log in folder.glob("tiny/*/*/out.log")):
            time.sleep(0.5)
        time.sleep(2.0)  # updates under way
        os.kill(pids[role], signal.SIGSTOP)
        sent, other = time.monotonic(), pids[1 - role]
        while Path(f"/proc/{other}").exists() and "Z" not in _state(other) and time.monotonic() - sent < 60:
            time.sleep(0.2)
        took = time.monotonic() - sent
        os.kill(pids[role], signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(pid, signal.SIGKILL)
    return proc.returncode, out, took


def test_a_stopped_server_or_trainer_is_named_and_the_job_ends(yaml, data_dir, tmp_path):
    """SIGSTOP of the server (rank 0), and in another job at the same time of a trainer (rank 1):
    the other rank's collective gives up at --collective_timeout_s, names the stopped one in a line
    (the heartbeat), without a traceback, and ends."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(_stop_a_rank, role, yaml, data_dir, tmp_path / f"stop{role}") for role in (0, 1)]
        results = [job.result() for job in jobs]
    # no traceback of the project's code (torchrun prints its own summary of the failed ranks)
    ours = [f'File "{REPO / part}' for part in ("training", "distributed", "scripts", "utils")]
    for role, (code, out, took) in enumerate(results):
        assert code != 0 and not any(o in out for o in ours), out[-3000:]
        named = f"rank {1 - role} gave up at step" in out and f"rank {role} stopped responding" in out
        assert named, out[-3000:]
        assert took < 5 + 30, took  # the timeout, then the diagnosis (a few heartbeats)


def _state(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[0]
    return "X"


def _killed_then_resumed(ranks: int, mode: str, yaml: Path, data_dir: Path, expdir: Path, *flags: str,
                         steps: int = STEPS, within: float = 0.5) -> tuple[Path, str]:
    """The run with a checkpoint every 4 updates, one worker slowed (100 ms a batch), killed with
    SIGKILL (every process of it) at a random moment up to ``within`` seconds after its first
    checkpoint, then run again with the same command to its end. The run folder and what the
    second run printed."""
    import os
    import random
    import re
    import signal
    import time

    args = train_args(yaml, data_dir, expdir, num_iters=steps, global_batch_size=BATCH, **SGD)
    args = [a for a in args if not a.startswith("--checkpoint_every")]
    args += ["--log_every=4", "--checkpoint_every=4", "--mode", mode, "--slow_ms", "100", *flags]
    launch = [sys.executable] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    env = subprocess_env(fast_start=ranks == 1, PYTHONUNBUFFERED="1")  # torchrun's ranks: its own
    proc = subprocess.Popen(launch + [SCRIPT, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    folder, pids = None, []
    try:
        deadline = time.monotonic() + 120
        while folder is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
            folder = next((c.parent for c in expdir.glob(f"tiny/{mode}_*/00/checkpoint.pt")), None)
        assert folder is not None, proc.communicate()[0][-3000:]
        time.sleep(random.uniform(0.0, within))
        if ranks == 1:  # Hogwild: the parent and its workers (it logged their pids)
            pids = [proc.pid] + [int(p) for p in re.findall(r"\d+", re.search(
                r"workers' pids: ([\d ]+)", (folder / "out.log").read_text()).group(1))]
        else:
            pids = [proc.pid] + [p for r in range(ranks) if (p := _rank_pid(str(expdir), r))]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        assert not (folder / "metrics.jsonl").exists(), "the run ended before it was killed"
    finally:
        proc.kill()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    again = subprocess.run(launch + [SCRIPT, *args], cwd=REPO, env=subprocess_env(), capture_output=True,
                           text=True, timeout=240)
    ok(again)
    printed = again.stdout + again.stderr
    assert re.search(r"resuming from .*checkpoint\.pt after \d+ updates", printed), printed[-3000:]
    return folder, printed


@pytest.mark.parametrize("ranks, mode, flags", [(2, "server", ["--slow_rank", "1"]),
                                                (1, "locked", ["--workers", "1", "--slow_rank", "0"])])
def test_one_worker_killed_and_resumed_is_serial_sgd_to_the_bit(ranks, mode, flags, serial, yaml, data_dir,
                                                                 tmp_path):
    """A parameter server with one trainer, and Hogwild with one worker, killed with kill -9 at a
    random moment after a checkpoint and run again: train.py's serial weights to the bit (the
    weights, the optimizer, the schedule and the trainer's place in its data came back)."""
    folder, _ = _killed_then_resumed(ranks, mode, yaml, data_dir, tmp_path, *flags)
    got = weights(folder)
    assert all(torch.equal(got[n], serial[n]) for n in serial)
    assert [m["step"] for m in metrics(folder)] == [4, 8, 12]


@pytest.mark.parametrize("ranks, mode, flags", [(3, "server", ["--slow_rank", "1"]),
                                                (1, "hogwild", ["--workers", "2", "--slow_rank", "0"])])
def test_two_workers_killed_and_resumed_continue_the_saved_log(ranks, mode, flags, yaml, data_dir, tmp_path):
    """Two trainers (two Hogwild workers), kill -9 at a random moment after a checkpoint, run again:
    the run ends with its 48 updates (the unslowed worker makes most, fast), the checkpoint's log
    continued; the server's whole log, replayed in this process, gives its weights to the bit."""
    from training.async_sgd import replay

    steps = 48
    folder, _ = _killed_then_resumed(ranks, mode, yaml, data_dir, tmp_path, *flags, steps=steps, within=0.1)
    saved = torch.load(folder / CHECKPOINT_NAME, weights_only=False)
    assert sum(metrics(folder)[-1]["updates_by_worker"].values()) == steps
    if mode != "server":
        return
    log = json.loads((folder / "updates.json").read_text())
    assert [[u["trainer"], u["version"]] for u in saved["log"]] == [u[:2] for u in log[:len(saved["log"])]]
    cfg = make_cfg(data_dir, tmp_path, global_batch_size=BATCH, num_iters=steps, warmup=0,
                   **{k: v for k, v in SGD.items() if k != "limit_nsamples_val"})
    model, _ = replay(cfg, [(t, v) for t, v, _, used in log if used], trainers=2)
    got = weights(folder)
    assert all(torch.equal(p.detach(), got[n]) for n, p in model.named_parameters())
