"""Data-parallel training on CPU with gloo, launched by torchrun exactly as users do.

Every multi-rank run is a torchrun subprocess with a timeout: a rank that fails makes
torchrun stop the others and exit non-zero, and a hang fails the test at the timeout.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distributed.env import first_host, parse_env
from tests.conftest import REPO, subprocess_env
from tests.ddp_helpers import WORKER, metrics, run, run_dir, train_args, write_test_yaml
from utils.checkpoint import CHECKPOINT_NAME
from utils.config import DEFAULT_YAML, load_config
from utils.data_loader import ERA5Dataset, ShardedSampler, get_data_loader
from utils.signals import EXIT_STOPPED

pytestmark = pytest.mark.xdist_group("ddp")  # with make test's -n 2: the module fixtures run once

@pytest.fixture(scope="module")
def test_yaml(tmp_path_factory) -> Path:
    return write_test_yaml(tmp_path_factory.mktemp("ddp_yaml") / "ViT.yaml")


@pytest.fixture
def args_for(data_dir, test_yaml):
    def make(expdir: Path, **extra) -> list[str]:
        return train_args(test_yaml, data_dir, expdir, **extra)

    return make


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory, test_yaml) -> dict[int, Path]:
    """The same 6 steps of global batch 8 on 1 rank and on 2 ranks (local batch 4). DDP's buckets
    are small (10 kB: about 20 all-reduces per step, each started as soon as backward has filled
    it); the default size is in every other DDP test. Ranks other than 0 fail if they open any
    file under the log folder for writing."""
    expdir = tmp_path_factory.mktemp("ddp_runs")
    out = {}
    for ranks in (1, 2):
        result = run(ranks, train_args(test_yaml, data_dir, expdir, bucket_cap_mb=0.01),
                     DDP_TEST_READONLY=str(expdir))
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        out[ranks] = run_dir(expdir, ranks)
    return out


@pytest.mark.timeout(300)
def test_two_ranks_match_one_rank_with_the_global_batch(runs):
    """DDP averages the gradients of the two half batches, which is the gradient of the mean
    loss over the full batch: after 6 Adam steps the weights agree. They are not bit-equal:
    the sums run in a different order (per-rank halves, then the all-reduce), so each
    gradient differs in the last float32 bits (~1e-7 relative); Adam divides by sqrt(v), which
    keeps the update size near lr = 1e-3 whatever the gradient's scale, so the weights
    differ by at most a few lr x 1e-4 after 6 steps. 1e-5 absolute leaves a 10x margin,
    while one missing gradient average (or a different sample split) moves weights by ~lr."""
    one = torch.load(runs[1] / CHECKPOINT_NAME, weights_only=False)
    two = torch.load(runs[2] / CHECKPOINT_NAME, weights_only=False)
    assert one["step"] == two["step"] == 6
    for name, w1 in one["model"].items():
        torch.testing.assert_close(two["model"][name], w1, rtol=0, atol=1e-5, msg=name)
    # validation: 39 samples split 20 / 19 over the ranks, averaged by sample count
    v1, v2 = metrics(runs[1])[-1], metrics(runs[2])[-1]
    assert v2["val_loss"] == pytest.approx(v1["val_loss"], rel=1e-5)
    assert v2["rmse"]["t2m"] == pytest.approx(v1["rmse"]["t2m"], rel=1e-5)
    assert v2["train_loss"] == pytest.approx(v1["train_loss"], rel=1e-5)


@pytest.mark.timeout(300)
def test_compressed_gradients_and_a_frozen_rank(runs, args_for, tmp_path):
    """Two lessons of part 4, run side by side so that the compressed runs fill the frozen job's
    wait.

    Compression: the uncompressed run sends every fp32 gradient once per step; bf16 sends exactly
    half, powersgd less still (its first two steps are sent whole). Compression changes the
    gradients, so the runs are not the serial model's; they must still train: after the 6 steps
    their validation loss is within 1% (bf16) and 5% (powersgd) of the uncompressed run's.

    A frozen rank: rank 1 stops itself (SIGSTOP) in its step 3's backward, while DDP all-reduces.
    Rank 0's all-reduce gives up after --collective_timeout_s (on torch 2.8, where it waits for
    ever, the heartbeat's watchdog gives up 4 s later), and rank 0 names rank 1 in one line (its
    heartbeat stopped: distributed/health.py); torchrun then stops the job (it gives the frozen
    rank 30 s to exit before killing it; the test kills the rank that rank 0 named, by the pid in
    the line, so the job ends without that wait). The job ends within the timeout plus 45 s."""
    timeout_s = 6
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
           *args_for(tmp_path / "frozen", num_iters=5000, collective_timeout_s=timeout_s)]
    frozen = subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(DDP_TEST_FREEZE_AT="1:3"), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    start = time.monotonic()
    try:
        plain = metrics(runs[2])[-1]
        state = torch.load(runs[2] / CHECKPOINT_NAME, weights_only=False)["model"]
        n_params = sum(t.numel() for t in state.values())
        assert plain["grad_comm_bytes_per_step"] == 4 * n_params
        assert "grad_comm_bytes_per_step" not in metrics(runs[1])[-1]  # one process: no all-reduce
        sent = {}
        for name in ("bf16", "powersgd"):
            result = run(2, args_for(tmp_path, grad_compression=name, run_num=name))
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
            m = metrics(run_dir(tmp_path, 2, name))[-1]
            sent[name] = m["grad_comm_bytes_per_step"]
            margin = 0.01 if name == "bf16" else 0.05
            assert m["val_loss"] == pytest.approx(plain["val_loss"], rel=margin), name
            assert m["train_loss"] != plain["train_loss"]  # the hook ran: the gradients changed a little
        assert sent["bf16"] == plain["grad_comm_bytes_per_step"] / 2
        assert sent["powersgd"] < sent["bf16"]

        lines = []
        for text in frozen.stdout:  # until rank 0 names the frozen rank
            lines.append(text)
            if "gave up at step" in text:
                # end the rank it names, as its operator would: torchrun would otherwise give the
                # frozen rank 30 s to exit before killing it (torchrun's wait, not the lesson)
                os.kill(int(re.search(r"pid (\d+)", text).group(1)), signal.SIGKILL)
                break
        out = "".join(lines) + frozen.communicate(timeout=120)[0]
    finally:  # a frozen rank left behind would never end: stop the whole session
        if frozen.poll() is None:
            os.killpg(frozen.pid, signal.SIGKILL)
    elapsed = time.monotonic() - start
    assert frozen.returncode != 0
    line = next((ln for ln in out.splitlines() if "gave up at step" in ln), None)
    assert line is not None, out[-3000:]
    assert ("rank 0 gave up at step 3 in backward (DDP's gradient all-reduce): rank 1 stopped "
            "responding") in line
    assert "last seen at step" in line and "pid" in line
    # launch (~5-10 s here, slower beside the compressed runs) + 3 steps + the timeout + the
    # diagnosis (2.5 s); the test then ends the frozen rank
    assert elapsed < 20 + timeout_s + 45, elapsed


@pytest.mark.timeout(300)
def test_only_rank_zero_writes(runs):
    """The 2-rank run succeeded although rank 1 could not open files under the log
    folder for writing (see the `runs` fixture); rank 0 wrote everything, once."""
    files = sorted(p.name for p in runs[2].iterdir())
    assert [f for f in files if f.startswith("events.out.tfevents")].__len__() == 1
    assert {"config.yaml", "out.log", "metrics.jsonl", CHECKPOINT_NAME} <= set(files)
    assert "[rank 1]" not in (runs[2] / "out.log").read_text()


def test_samplers_shard_disjointly_and_cover(cfg_factory):
    cfg = cfg_factory()
    n = len(ERA5Dataset(cfg, "train"))  # 78
    for shards, batch in ((1, 4), (2, 4), (4, 3), (3, 5)):
        for epoch in (0, 1):
            parts = []
            for r in range(shards):
                s = ShardedSampler(n, shards, r, shuffle=True, seed=3, drop_last=True, batch_size=batch)
                s.set_epoch(epoch)
                parts.append(list(s))
            used = (n // (shards * batch)) * shards * batch  # whole global batches only
            assert all(len(p) == used // shards for p in parts)
            flat = [i for p in parts for i in p]
            assert len(set(flat)) == len(flat) == used  # disjoint
        # validation keeps every sample exactly once, in order, across the ranks
        val = [list(ShardedSampler(n, shards, r, batch_size=batch)) for r in range(shards)]
        assert sorted(i for p in val for i in p) == list(range(n))
    # the PyTorch loader of each rank yields exactly its shard's samples
    loaders = [get_data_loader(cfg, "train", 4, True, num_shards=2, shard_id=r) for r in range(2)]
    for _, _, sampler in loaders:
        sampler.set_epoch(1)
    seen = [torch.cat([inp for inp, _ in loader]) for loader, _, _ in loaders]
    dataset = loaders[0][1]
    for (_, _, sampler), inputs in zip(loaders, seen):
        expected = torch.stack([dataset[i][0] for i in sampler.epoch_order()])
        torch.testing.assert_close(inputs, expected, rtol=0, atol=0)
    assert not set(loaders[0][2].epoch_order()) & set(loaders[1][2].epoch_order())


@pytest.mark.timeout(150)
def test_non_divisible_batch_is_a_one_line_error(args_for, tmp_path):
    """Global batch 8 on 3 ranks: the ranks stop with the same one-line error, status 2 (once
    the first has exited, torchrun may stop the others before they print it)."""
    result = run(3, args_for(tmp_path))
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and "exitcode  : 2" in result.stderr
    assert errors and set(errors) == {
        "error: global_batch_size 8 is not divisible by the 3 data-parallel ranks; choose a batch "
        "that is a multiple of 3 or pass --local_batch_size"}


def test_parse_env_torchrun():
    env = parse_env({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2",
                     "MASTER_ADDR": "node7", "MASTER_PORT": "29400", "SLURM_PROCID": "0",
                     "SLURM_NTASKS": "1"})
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 8, 2)
    assert (env.master_addr, env.master_port, env.is_distributed) == ("node7", 29400, True)
    assert parse_env({}).world_size == 1 and not parse_env({}).is_distributed
    with pytest.raises(ValueError, match="WORLD_SIZE='four' is not an integer"):
        parse_env({"RANK": "0", "WORLD_SIZE": "four"})


def test_parse_env_srun():
    env = parse_env({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8",
                     "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "4(x2)",
                     "SLURM_NODELIST": "nid[001234-001235]", "MASTER_PORT": "29501"})
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (5, 1, 8, 4)
    assert (env.master_addr, env.master_port) == ("nid001234", 29501)
    one = parse_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_NODELIST": "nid9"})
    assert (one.world_size, one.master_addr) == (1, "127.0.0.1")
    assert first_host("nid[001-004,010],nid200") == "nid001"
    assert first_host("login12,login13") == "login12"
    assert first_host("gpu[7,9]") == "gpu7"


@pytest.mark.timeout(150)
def test_a_failing_rank_stops_the_job_promptly(args_for, tmp_path):
    start = time.monotonic()
    result = run(2, args_for(tmp_path, num_iters=5000), DDP_TEST_RAISE_AT="1:2")
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert "injected failure on rank 1 at step 2" in result.stdout + result.stderr
    # 5000 steps would take minutes: the job ended when rank 1 failed (launch ~10 s here)
    assert elapsed < 60, elapsed


@pytest.mark.timeout(150)
def test_nan_loss_on_one_rank_stops_every_rank(args_for, tmp_path):
    """Rank 1 reports NaN for one step: the epoch's loss is summed over the ranks before it is
    checked, so rank 0 sees it too and both stop with the same message."""
    result = run(2, args_for(tmp_path, num_iters=5000), DDP_TEST_NAN_AT="1:3")
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert "rank 0: training loss is nan at step 9" in out  # 9 steps per epoch: 78 // 8
    assert "rank 1: training loss is nan at step 9" in out


@pytest.mark.timeout(200)
def test_stop_signal_on_one_rank_stops_all_at_the_same_step(args_for, tmp_path):
    """SIGUSR1 reaches rank 1 only, during its step 3. The ranks agree at step 4 (checks
    every 4 steps) and read the agreement at step 5: both stop there, rank 0 writes the
    checkpoint, and the job exits with 75. (Resuming from it: test_preemption.py in one
    process, test_slurm.py through a requeued Slurm job.)"""
    result = run(2, args_for(tmp_path, num_iters=12, stop_check_every=4), DDP_TEST_SIGNAL_AT="1:3")
    out = result.stdout + result.stderr
    assert result.returncode != 0 and f"exitcode  : {EXIT_STOPPED}" in out, out[-3000:]
    assert "stop signal (received by another rank): stopping at step 5 of 12" in out  # rank 0
    assert "stop signal (SIGUSR1): stopping at step 5 of 12" in out  # rank 1, the same step
    state = torch.load(run_dir(tmp_path, 2) / CHECKPOINT_NAME, weights_only=False)
    assert state["step"] == 5


def test_plot_scaling_reads_the_runs_event_files(runs, tmp_path, capsys):
    """scripts/plot_scaling.py on the 1- and 2-rank runs above: throughput per rank count is
    the run's logged "Avg samples per sec" (one epoch, so nothing skipped), PNG written."""
    from matplotlib.image import imread

    from scripts import plot_scaling

    out = tmp_path / "scaling.png"
    means = plot_scaling.main([str(runs[1].parents[1]), "--out", str(out)])  # finds both runs
    for ranks in (1, 2):
        assert means[ranks] == pytest.approx(metrics(runs[ranks])[0]["samples_per_sec"], rel=1e-6)
    image = imread(out)
    assert image.shape[0] > 300 and image.shape[1] > 600
    printed = capsys.readouterr().out
    assert "ranks  samples/s  speed-up efficiency" in printed and f"wrote {out}" in printed
    with pytest.raises(SystemExit, match="no TensorBoard event files"):
        plot_scaling.main([str(tmp_path), "--out", str(out)])


@pytest.mark.parametrize("batch", [16, 32, 64, 128, 256, 512, 1024, 2048])
def test_scaling_configs_use_sqrt_lr_and_the_same_samples(batch):
    """bs<B>_opt: lr = 5e-4 x sqrt(B / 16) (to the 3 digits written), the same ~480k training
    samples (30000 steps of 16), and the short variant 64 steps with a shorter warmup."""
    cfg = load_config(DEFAULT_YAML, f"bs{batch}_opt")
    assert cfg.global_batch_size == batch
    assert cfg.lr == pytest.approx(5e-4 * (batch / 16) ** 0.5, rel=5e-3)
    assert 0 <= cfg.num_iters * batch - 30000 * 16 < batch
    short = load_config(DEFAULT_YAML, f"bs{batch}_opt_short")
    assert (short.num_iters, short.lr, short.global_batch_size) == (64, cfg.lr, batch)
    assert short.warmup < short.num_iters
