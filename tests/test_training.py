"""train.py end to end, exact resume, atomic checkpoints, one-line errors."""

import json
import logging
import subprocess
import sys

import pytest
import torch
from ruamel.yaml import YAML

from tests.conftest import REPO, subprocess_env
from training.context import RunContext, local_batch_size
from training.schedule import make_lr_lambda
from training.trainer import Trainer
from utils import checkpoint as ckpt


def run_train(*args, timeout=240, python_flags=()):
    return subprocess.run([sys.executable, *python_flags, str(REPO / "train.py"), *args], capture_output=True,
                          text=True, env=subprocess_env(), timeout=timeout, cwd=REPO)


# The project's modules a single-device run of train.py loads, from its first import to its
# last step (docs/01-single-device.md states the number, tests/test_spine.py holds it there).
SINGLE_DEVICE_MODULES = 25


def project_modules(importtime_stderr: str) -> set[str]:
    """Modules of the project's packages named by ``python -X importtime`` (no __init__ files)."""
    names = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name.split(".")[0] in ("utils", "networks", "distributed", "training") and "." in name:
                names.add(name)
    return names


def write_test_yaml(path, cfg, name="e2e"):
    with open(path, "w") as f:
        YAML().dump({name: cfg.to_dict()}, f)
    return path


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def scalar_tags(run_dir, kind="scalars"):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    read = acc.Scalars if kind == "scalars" else acc.Images
    return {tag: len(read(tag)) for tag in acc.Tags()[kind]}


@pytest.mark.slow
def test_train_py_beats_persistence(cfg_factory, tmp_path):
    """A short real run of train.py: the 6-hour forecast must beat persistence."""
    cfg = cfg_factory(embed_dim=64, global_batch_size=8, lr=2e-3, num_iters=150, checkpoint_every=100)
    yaml_path = write_test_yaml(tmp_path / "test.yaml", cfg)
    result = run_train("--yaml_config", str(yaml_path), "--config", "e2e", "--run_num", "r1",
                       python_flags=("-X", "importtime"))
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout
    loaded = project_modules(result.stderr)
    assert "training.trainer" in loaded and "training.pipelined" not in loaded
    assert len(loaded) == SINGLE_DEVICE_MODULES, sorted(loaded)
    run_dir = cfg.exp_path / "e2e" / "1GPU" / "r1"
    for name in ("out.log", "config.yaml", "checkpoint.pt", "metrics.jsonl"):
        assert (run_dir / name).is_file(), name
    log = (run_dir / "out.log").read_text()
    assert "Time taken for epoch 1 is" in log and "samples/sec" in log
    assert "  Avg train loss=" in log and "  Avg val loss=" in log and "  Total validation time:" in log
    assert "tensorboard --logdir" in result.stdout
    final = read_metrics(run_dir)[-1]
    assert final["step"] == 150
    for ch in ("u10m", "t2m", "z500"):
        assert final["rmse"][ch] < 0.9 * final["persistence"][ch], (ch, final)
    assert sum(final["rmse"].values()) < 0.6 * sum(final["persistence"].values())
    tags = scalar_tags(run_dir)
    epochs = len(read_metrics(run_dir))
    for tag in ("Loss/train", "Loss/valid", "RMSE(u10m)/valid", "RMSE(t2m)/valid", "RMSE(u10m)/persistence",
                "RMSE(t2m)/persistence", "Learning Rate", "Avg iters per sec", "Avg samples per sec"):
        assert tags.get(tag) == epochs, tag
    assert set(scalar_tags(run_dir, "images")) == {"Predictions/t2m"}  # (TensorBoard keeps a sample of 4)
    imported = {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:") and "|" in line}
    assert "matplotlib" not in imported  # its import and figures cost about 0.8 s of every run
    assert torch.load(run_dir / "checkpoint.pt", weights_only=False)["step"] == 150


def test_the_prediction_image_shows_target_prediction_and_error():
    from training.reporting import ERROR_STOPS, FIELD_STOPS, prediction_image
    from utils.era5 import CHANNELS

    c = CHANNELS.index("t2m")
    target = torch.zeros(len(CHANNELS), 4, 6)
    target[c] = torch.arange(24.0).view(4, 6)
    pred = target.clone()
    pred[c, 0, 0] += 5.0  # one wrong value
    img = prediction_image(pred, target, c)
    assert img.shape == (3, 4, 3 * 6 + 2) and img.min() >= 0 and img.max() <= 1
    field, error = img[:, :, :6], img[:, :, 14:]
    assert (img[:, :, 6] == 1).all() and (img[:, :, 13] == 1).all()  # white gaps
    assert torch.allclose(torch.tensor(field[:, 3, 5]), torch.tensor(FIELD_STOPS[-1]))  # the largest value
    assert torch.allclose(torch.tensor(error[:, 0, 0]), torch.tensor(ERROR_STOPS[-1]))  # the error, red
    assert torch.allclose(torch.tensor(error[:, 1, 1]), torch.tensor(ERROR_STOPS[1]))  # no error, white


def make_trainer(cfg, run_dir):
    return Trainer(cfg, RunContext(device=torch.device("cpu"), run_dir=run_dir), cfg.global_batch_size)


class KilledError(Exception):
    pass


def test_resume_gives_the_same_losses(cfg_factory, tmp_path):
    """Stop after 6 steps (mid-epoch, just after a checkpoint), resume, compare every logged loss."""
    cfg = cfg_factory(limit_nsamples=16, num_iters=10, checkpoint_every=3, dropout=0.1)
    make_trainer(cfg, tmp_path / "straight").fit()

    interrupted = make_trainer(cfg, tmp_path / "resumed")
    original_step = interrupted.train_step

    def step_then_die(inp, tar):
        if interrupted.step == 6:  # the checkpoint of step 6 has just been written
            raise KilledError
        return original_step(inp, tar)

    interrupted.train_step = step_then_die
    with pytest.raises(KilledError):
        interrupted.fit()
    assert len(read_metrics(tmp_path / "resumed")) == 1  # one epoch of 4 steps was logged
    make_trainer(cfg, tmp_path / "resumed").fit()

    straight, resumed = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [r["step"] for r in straight] == [4, 8, 10]
    for a, b in zip(straight, resumed):
        assert a["train_loss"] == b["train_loss"] and a["val_loss"] == b["val_loss"]
    ends = [torch.load(tmp_path / d / "checkpoint.pt", weights_only=False) for d in ("straight", "resumed")]
    for name, tensor in ends[0]["model"].items():
        torch.testing.assert_close(tensor, ends[1]["model"][name], rtol=0, atol=0)


@pytest.mark.parametrize("before, after", [(False, True), (True, False)])
def test_resume_keeps_the_running_optimizers_kernels(cfg_factory, tmp_path, caplog, before, after):
    """A checkpoint's param groups carry the kernel flags it ran with; resuming with another
    --enable_fused (or in train_graph.py, capturable) keeps the new run's flags, says so, and
    still trains."""
    make_trainer(cfg_factory(num_iters=2, enable_fused=before), tmp_path).fit()
    resumed = make_trainer(cfg_factory(num_iters=4, enable_fused=after), tmp_path)
    with caplog.at_level(logging.INFO, logger="training.checkpointing"):
        resumed.fit()
    group = resumed.optimizer.param_groups[0]
    assert bool(group["fused"]) == after and bool(group["foreach"]) == (not after)
    flags = {False: "None", True: "True"}  # adam_kernel sets one of the two, the other stays None
    assert (f"this run keeps its own (foreach {flags[not before]} -> {flags[not after]}, "
            f"fused {flags[before]} -> {flags[after]})") in caplog.text
    assert resumed.step == 4


def test_rerunning_a_finished_run_says_how_to_train_again(cfg_factory, tmp_path, caplog):
    cfg = cfg_factory(limit_nsamples=16, num_iters=2)
    make_trainer(cfg, tmp_path / "run").fit()
    with caplog.at_level("INFO", logger="training.trainer"):
        again = make_trainer(cfg, tmp_path / "run")
        again.fit()
    assert again.step == 2
    assert "this run already took all 2 steps; to train again, pass another --run_num" in caplog.text


def test_exactly_num_iters_when_less_than_an_epoch(cfg_factory, tmp_path):
    cfg = cfg_factory(num_iters=3)  # 80 samples / batch 4 = 20 steps per epoch
    trainer = make_trainer(cfg, tmp_path / "run")
    trainer.fit()
    assert trainer.step == 3
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [3]


def test_checkpoint_written_atomically(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    ckpt.save_atomic({"step": 1}, path)

    def dies_mid_write(obj, f):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt  # the process is killed while writing

    monkeypatch.setattr(torch, "save", dies_mid_write)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_atomic({"step": 2}, path)
    assert ckpt.load(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temporary left behind


def test_unreadable_checkpoint_says_what_to_do(tmp_path):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="cannot be read .*delete it to start over"):
        ckpt.load(path)


def test_lr_schedule_warmup_then_cosine(cfg_factory):
    f = make_lr_lambda(cfg_factory(num_iters=110, warmup=10).optim)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.5) and f(110) == pytest.approx(0.0)


def test_the_printed_tensorboard_command_runs_where_it_is_printed(tmp_path):
    from training.launcher import tensorboard_command

    assert tensorboard_command(tmp_path) == "tensorboard"  # a container: the one on PATH
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "tensorboard").touch()
    assert tensorboard_command(tmp_path) == ".venv/bin/tensorboard"  # a clone after make train


def test_local_batch_size():
    assert local_batch_size(16, 4) == 4
    assert local_batch_size(16, 3, override=5) == 5
    with pytest.raises(ValueError, match="not divisible by the 3 data-parallel ranks"):
        local_batch_size(16, 3)
    with pytest.raises(ValueError, match="at least 1"):
        local_batch_size(16, 2, override=0)


@pytest.mark.parametrize("args, message", [
    (["--config", "tinny"], "error: unknown config 'tinny' in .*available: .*tiny"),
    (["--config", "tiny", "--data_dir", "/nonexistent/era5"],
     "error: data directory /nonexistent/era5 does not exist; generate synthetic data with `make data`"),
    (["--config", "tiny", "--num_iters", "0"], "error: config key 'num_iters' must be at least 1"),
    (["--config", "mp_short"], "error: config 'mp_short' sets tensor_parallel=4: "
                               "model parallel runs use train_mp.py"),
])
def test_cli_errors_are_one_line(args, message, tmp_path):
    result = run_train(*args, "--expdir", str(tmp_path), timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert __import__("re").match(message, lines[0]), lines[0]


def test_plot_prediction_script(cfg_factory, tmp_path):
    from scripts.plot_prediction import main as plot_main
    from training.launcher import write_resolved_config

    cfg = cfg_factory(num_iters=2)
    run_dir = tmp_path / "run"
    make_trainer(cfg, run_dir).fit()
    write_resolved_config(cfg, run_dir, "tiny")
    out = tmp_path / "pred.png"
    plot_main(["--run_dir", str(run_dir), "--out", str(out), "--channel", "u10m", "--sample", "3"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):  # a folder without a finished run: an argparse error
        plot_main(["--run_dir", str(tmp_path), "--out", str(out)])


EXAMPLE_RUN = REPO / "example_logs" / "tiny" / "1GPU" / "demo"


def test_example_logs_are_a_finished_demo_run():
    """The committed baseline for the comparison lesson: every epoch in TensorBoard, better than
    persistence, and no checkpoint (it would be 10 MB)."""
    epochs = read_metrics(EXAMPLE_RUN)
    assert epochs[-1]["step"] == 320 and len(epochs) == 8
    tags = scalar_tags(EXAMPLE_RUN)
    assert tags["Loss/train"] == tags["Loss/valid"] == len(epochs)
    for ch in ("u10m", "t2m", "z500"):
        assert epochs[-1]["rmse"][ch] < epochs[-1]["persistence"][ch], ch
    assert not (EXAMPLE_RUN / "checkpoint.pt").exists()


def test_plot_training_script(tmp_path, capsys):
    from scripts.plot_training import main as plot_main

    out = tmp_path / "curves.png"
    plot_main(["--run_dir", str(EXAMPLE_RUN), "--out", str(out), "--channels", "t2m", "sp"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "RMSE(t2m)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown channel"):
        plot_main(["--run_dir", str(EXAMPLE_RUN), "--out", str(out), "--channels", "t3m"])
    with pytest.raises(SystemExit, match="metrics.jsonl not found"):
        plot_main(["--run_dir", str(tmp_path), "--out", str(out)])


def test_run_steps_goes_on_across_epochs_and_stops_when_asked(cfg_factory, tmp_path):
    """``Trainer.run_steps``: the scripts' loop (benchmark, range test, batch-scaling study): 5 steps
    over 2-step epochs, each with the rate it used, the callbacks around each; a caller that stops
    early stops the training."""
    from training.context import Callback, RunContext
    from training.trainer import Trainer

    class Count(Callback):
        starts = ends = 0

        def step_start(self, trainer):
            self.starts += 1

        def step_end(self, trainer, loss):
            self.ends += 1

    cfg = cfg_factory(num_iters=8, limit_nsamples=8, warmup=0, lr_schedule="cosine")
    count = Count()
    trainer = Trainer(cfg, RunContext(device=torch.device("cpu"), run_dir=tmp_path / "run"), 4,
                      callbacks=[count])
    assert trainer.train_data.batches_per_epoch == 2
    ran = list(trainer.run_steps(5))
    assert len(ran) == 5 and all(torch.isfinite(loss) for _, loss in ran)
    lrs = [lr for lr, _ in ran]
    assert lrs[0] == cfg.lr and all(a > b for a, b in zip(lrs, lrs[1:]))  # the cosine, step by step
    for i, _ in enumerate(trainer.run_steps(5)):
        if i == 1:
            break
    first = next(iter(trainer.model.parameters()))
    assert trainer.optimizer.state[first]["step"].item() == 7  # 2 more steps, not 5
    assert trainer.step == 7 and (count.starts, count.ends) == (7, 7)
