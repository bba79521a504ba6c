"""scripts/dry_run.py: one step of a many-GPU job on fake tensors over a fake process group.

Every Perlmutter training command on the pages is played at its real world size (rank 0, and
the last pipeline stage's rank where there is one). Checked against the cost model
(scripts/cost_model.py):

* parameters, gradients and optimizer state: equal, byte for byte;
* the bytes of every collective, by kind and mesh dimension: equal;
* activations and temporaries: within ACTIVATION_MARGIN of the cost model's activations plus
  what it does not check (activation checkpointing's recomputed block, FSDP's buffers). Not
  equal: the dry run counts every temporary (a GELU's gradient, backward's matmul outputs,
  FSDP's padded gather buffers), the cost model what autograd keeps; sequence parallelism's
  activations it counts as plain tensor parallelism's;
* the peak fits the GPUs the command asks for (tests/test_perlmutter_commands.py's share).
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts import cost_model as cm
from scripts import dry_run as dr
from tests.conftest import REPO, subprocess_env
from tests.test_perlmutter_commands import COMMANDS, MEMORY_SHARE, TRAIN_SCRIPTS, Job, job, resolve

NEW_ENOUGH = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= dr.MIN_TORCH
needs_new_torch = pytest.mark.skipif(not NEW_ENOUGH, reason="the dry run needs torch 2.11+ (its refusal: "
                                                            "tested below)")
ACTIVATION_MARGIN = (0.6, 1.5)
CANNOT_PLAY = ("DeepSpeed's engine",)  # refused in one line
# the asynchronous pipeline's first step (the dry run plays the first): its first stage receives
# fewer micro-batches' gradients (the pipeline fills) and steps no optimizer yet; the cost
# model counts a step of the steady flow
FIRST_STEP_ONLY = ("async_1f1b",)


def dry_job(job: Job) -> dr.Job:
    return dr.Job(Path(job.entry).name, job.args, job.ranks, job.per_node)


def check_fits(job: Job, report: dr.RankReport) -> None:
    limit = MEMORY_SHARE * job.gpu_bytes
    assert report.peak["total"] <= limit, (
        f"rank {report.rank} peaks at {report.peak['total'] / 1e9:.1f} GB in the dry run, more than "
        f"{MEMORY_SHARE:.0%} of the {job.gpu_bytes / 1e9:.0f} GB GPU")


def check_against_cost_model(report: dr.RankReport, args: list[str]) -> None:
    first_step = any(a in " ".join(args) for a in FIRST_STEP_ONLY)
    predicted = report.predicted
    kinds = ("parameters",) if first_step else ("parameters", "gradients", "optimizer_state")
    if "--pipeline_parallel=4" in args and any(a.startswith("--freeze_schedule") for a in args):
        kinds = ()  # freezing balances its stages by the formula's costs; the cost model splits evenly
    for kind in kinds:
        assert report.peak[kind] == predicted[kind], (f"{kind}: dry run {report.peak[kind]}, "
                                                      f"cost model {predicted[kind]}")
    for key, nbytes in dr.collective_sums(report).items():
        want = report.predicted_collectives.get(key, 0)
        if key[0] in ("send", "recv") and first_step:
            continue
        if key[0] == "all_to_all":  # balanced routing: a rank's share of an uneven split differs
            assert abs(nbytes - want) <= 1e-3 * want, f"{key}: dry run {nbytes}, cost model {want}"
        else:
            assert nbytes == want, f"{key[0]} over {key[1]}: dry run {nbytes} bytes, cost model {want}"
    expected = predicted["activations"] + sum(v for k, v in predicted.items() if "not checked" in k)
    low, high = ACTIVATION_MARGIN
    assert low * expected <= report.peak["activations"] <= high * expected, (
        f"activations: dry run {report.peak['activations']}, cost model {expected}")


TRAINING = [c for c in COMMANDS if Path(resolve(c).entry).name in TRAIN_SCRIPTS - {"train_graph.py"}]
# keys a step does not read (the data loader's, the run's length and name): commands that differ
# only in them are one dry run
NOT_PLAYED = {"num_data_workers", "data_loader_config", "profile_epoch", "num_iters", "limit_nsamples",
              "limit_nsamples_val", "checkpoint_every", "lr", "enable_jit"}


def played(cmd) -> tuple:
    job_ = resolve(cmd)
    cfg = dr_config_of(job_.args)
    return (job_.entry, job_.ranks, job_.per_node, job_.gpu_bytes,
            tuple(sorted((k, str(v)) for k, v in cfg.to_dict().items() if k not in NOT_PLAYED)))


def dr_config_of(args: list[str]):
    from training.launcher import arg_parser, resolve_config

    return resolve_config(arg_parser().parse_known_args(args)[0])


def distinct(commands: list) -> list[list]:
    """The commands grouped by what a dry run of them plays."""
    groups: dict[tuple, list] = {}
    for cmd in commands:
        groups.setdefault(played(cmd), []).append(cmd)
    return list(groups.values())


# pipelines whose first stage is played too: one of torch's schedules, the asynchronous one
BOTH_STAGES = [c for c in TRAINING if ("--pipeline_parallel=2" in c.text and "interleaved" not in c.text
                                       or "async_1f1b" in c.text and "stash" in c.text)][:2]


@needs_new_torch
@pytest.mark.parametrize("cmds", distinct(TRAINING),
                         ids=lambda cs: "+".join(f"{Path(c.page).stem[:2]}:{c.line}" for c in cs))
def test_a_page_command_dry_runs_at_its_size(cmds):
    page_job = resolve(cmds[0])
    job_ = dry_job(page_job)
    try:
        ranks = dr.default_ranks(job_)  # rank 0 and the last pipeline stage's
        if len(ranks) > 1 and cmds[0] not in BOTH_STAGES:
            ranks = ranks[-1:]  # the stage with the head and the loss (rank 0's side: BOTH_STAGES)
        reports = [dr.play(job_, r, checkpoint=False) for r in ranks]  # (the gather: played below)
    except ValueError as err:
        assert str(err).startswith(CANNOT_PLAY) and "\n" not in str(err), str(err)
        return
    for report in reports:
        check_fits(page_job, report)
        check_against_cost_model(report, job_.args)


def test_every_page_command_is_played_or_refused_for_a_reason():
    assert len(TRAINING) >= 25 and sum(map(len, distinct(TRAINING))) == len(TRAINING)
    assert len(BOTH_STAGES) == 2, [c.text for c in BOTH_STAGES]


def play(text: str, rank: int = 0) -> dr.RankReport:
    return dr.play(dry_job(job(text)), rank)


@needs_new_torch
def test_the_memory_report_follows_the_layout():
    """FSDP keeps 1/N of the parameters; activations grow with the local batch; tensor
    parallelism halves the split layers' weights."""
    ddp = play("sbatch --nodes 1 submit_pm_dp.sh --config=tiny")
    fsdp = play("sbatch --nodes 1 submit_pm_dp.sh --config=tiny --data_parallel=fsdp", rank=3)
    whole = ddp.peak["parameters"]
    assert 0.9 * whole / 4 <= fsdp.peak["parameters"] <= 1.1 * whole / 4  # (shards of uneven rows)
    # a checkpoint gathers every weight whole (shards padded to equal rows)
    gathered = sum(c.nbytes for c in fsdp.checkpoint if c.kind == "all_gather" and c.group == "dp")
    assert whole <= gathered <= 1.1 * whole
    small = play("sbatch --nodes 1 submit_pm_dp.sh --config=tiny --local_batch_size=2")
    large = play("sbatch --nodes 1 submit_pm_dp.sh --config=tiny --local_batch_size=4")
    assert 1.8 < large.peak["activations"] / small.peak["activations"] <= 2.0
    tp = play("sbatch --nodes 1 submit_pm_mp.sh --config=tiny --tensor_parallel=2")
    m = cm.Model.from_config(dr_config("tiny"))
    split = [(name, s) for name, s in cm.parameter_shapes(m) if cm.tp_shape(m, name, s, 2) != s]
    assert split and all(math.prod(cm.tp_shape(m, name, s, 2)) * 2 == math.prod(s) for name, s in split)
    split = [shape for _, shape in split]
    assert whole - tp.peak["parameters"] == cm.E * sum(math.prod(s) for s in split) // 2


def dr_config(name: str):
    return dr_config_of([f"--config={name}"])


@needs_new_torch
def test_a_layout_that_does_not_fit_fails():
    """SC23's flag at one node: tp 4 x dp 1 of `mp`, local batch 64, on 40 GB A100s."""
    one = job("sbatch --nodes 1 submit_pm_mp.sh --config=mp_short --row_parallel_size=4")
    report = dr.play(dry_job(one), 0)
    with pytest.raises(AssertionError, match=r"peaks at \d+\.\d GB in the dry run, more than 55% of the 40"):
        check_fits(one, report)


def test_an_older_torch_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.8.0")
    with pytest.raises(ValueError, match=r"^the dry run needs torch 2\.11 or newer \(this is 2\.8\.0"):
        dr.play(dr.Job("train.py", ["--config=tiny"], 2), 0)


@needs_new_torch
def test_the_command_line_prints_the_table_and_refuses_in_one_line():
    run = subprocess.run([sys.executable, "scripts/dry_run.py", "sbatch", "--nodes", "1", "submit_pm_mp.sh",
                          "--config=tiny", "--tensor_parallel=2"], cwd=REPO, env=subprocess_env(),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "rank 0 (tp 0, cp 0, dp 0, pp 0)" in run.stdout and "all_reduce over tp" in run.stdout
    bad = subprocess.run([sys.executable, "scripts/dry_run.py", "--ranks", "4", "--rank", "9", "train.py",
                          "--config=tiny"], cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and bad.stderr == "error: --rank 9: the job has ranks 0 to 3\n"
    for words, ranks, said in ((["train.py"], -3, "--ranks N: the job's world size, at least 1"),
                               (["sbatch", "--nodes", "0", "submit_pm_dp.sh"], None, "--nodes 0: a job has"),
                               (["ls"], None, "give the job as the page does")):
        with pytest.raises(ValueError, match="^" + re.escape(said)):
            dr.job_from(words, ranks)
