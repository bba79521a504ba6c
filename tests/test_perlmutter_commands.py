"""Every Perlmutter command on the pages (README.md and docs/*.md), checked here before anyone
runs it: each `sbatch`, and each command run by hand inside a `salloc` allocation (`srun ...`,
`bash srun_pm.sh ...`, with the allocation named in a comment above it in its block).

A command is resolved as its job would be: its ranks (one task per GPU: `submit_pm_dp.sh` and
`submit_pm_mp.sh` give nodes x 4, `submit_pm.sh` one; salloc's -N/-n), its entry script (the
submit script's, or the one named), and the named configuration of config/ViT.yaml with the
command's flags. Then:

(a) the run's own start-up checks accept it: the config checks and `check_layout` in
    training/launcher.py (sizes, model split, experts, batch split), run without a process
    (train_graph.py's own refusals, training/graphs.py's GraphStep.check, included);
(b) nothing it asks for is silently off: a layout flag its ranks would switch off is refused
    by those same checks (distributed/mesh.py `check_takes_effect`), so a learner sees it too;
(c) the memory per GPU that the cost model (scripts/cost_model.py `memory`, in the run's
    precision) counts stays within MEMORY_SHARE of the node's GPU: 40 GB A100s, 80 GB where the
    command asks for `-C "gpu&hbm80g"`;
(d) a command run by hand uses the submit scripts' container and mounts (`srun_pm.sh`), so
    /data and /logs exist for it;
(e) paths are Perlmutter's: $SCRATCH, the tutorial's data folder, or the container's mounts;
(f) what the page says about where ranks sit matches the mesh (distributed/mesh.py's groups;
    rank r runs on node r // 4), and a command's comment ("# 16 GPUs", "local batch 16",
    "M=4, D=4") matches its layout.

Pure parsing and the cost model's arithmetic: no process starts, no training.
"""

from __future__ import annotations

import functools
import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from distributed import mesh as meshes
from scripts import cost_model as cm
from tests.conftest import REPO
from tests.test_readme import PAGES, SUBMIT_SCRIPTS, TRAIN_SCRIPTS, Command, course_commands
from training.launcher import arg_parser, check_layout, resolve_config
from utils.config import Config

GPUS_PER_NODE = 4  # Perlmutter's GPU nodes: 4 A100s each
GPU_BYTES = {"gpu": 40e9, "hbm80g": 80e9}  # the A100's memory, as NVIDIA and NERSC give it (GB)
# The cost model counts the tensors a rank holds (weights, gradients, optimizer state, what
# autograd saves, FSDP's buffers). A run also holds the CUDA context, cuBLAS, cuDNN and NCCL
# workspaces, the data loader's device buffers, the caching allocator's reserve and backward's
# short-lived tensors. The SC23 and SC25 tutorials' pages (the same ViT, in their own code) show
# logs of 40.1 and 44.9 GB after the forward pass of `mp` (bf16, local batch 16) at data parallel
# 4 on 80 GB A100s, where this model counts 32.4 GB, and SC25's of 33.2 GB at tensor parallel 4 x
# data parallel 4, counted 16.0 GB: 8 to 17 GB beyond the count. A command passes when the count leaves 45 %
# of the GPU free: at most 22 GB of a 40 GB A100 (18 GB left), 44 GB of an 80 GB one.
MEMORY_SHARE = 0.55
HAND_RUN = "srun_pm.sh"  # runs a script in an allocation as the submit scripts do
SLURM_COMMON = (REPO / "scripts" / "slurm_common.sh").read_text()
TUTORIAL_DATA = re.search(r'DATADIR:=([^}"]+)', SLURM_COMMON).group(1)  # the submit scripts' default
CONTAINER_PATHS = ("/data", "/logs")  # the container's mounts of DATADIR and LOGDIR


@dataclass
class Job:
    """A Perlmutter command, resolved."""

    cmd: Command
    entry: str  # train.py, train_mp.py, train_graph.py or scripts/....py
    args: list[str]  # the entry's arguments
    ranks: int
    per_node: int  # ranks on each node
    slurm: dict[str, str]  # the job's Slurm options (the submit script's, then the command's)
    by_hand: bool  # run inside salloc, not submitted

    @property
    def gpu_bytes(self) -> float:
        return GPU_BYTES["hbm80g" if "hbm80g" in self.slurm.get("constraint", "") else "gpu"]

    @property
    def gpus_per_node(self) -> int:
        """The GPUs the job's ranks on one node have (one each, or the node's)."""
        if "gpus-per-task" in self.slurm:
            return int(self.slurm["gpus-per-task"]) * self.per_node
        if "gpus-per-node" in self.slurm:
            return int(self.slurm["gpus-per-node"])
        return int(self.slurm.get("gpus", 0)) // max(1, self.ranks // self.per_node)


# ------------------------------------------------------------------ reading the pages ---
SLURM_OPTIONS = {  # option -> name, for the options with a value
    "nodes": ("-N", "--nodes"), "ntasks": ("-n", "--ntasks"), "ntasks-per-node": ("--ntasks-per-node",),
    "constraint": ("-C", "--constraint"), "cpus-per-task": ("-c", "--cpus-per-task"),
    "gpus-per-task": ("--gpus-per-task",), "gpus-per-node": ("--gpus-per-node",), "gpus": ("-G", "--gpus"),
    "qos": ("-q", "--qos"), "time": ("-t", "--time"), "account": ("-A", "--account"),
    "job-name": ("-J", "--job-name"), "output": ("-o", "--output"), "signal": ("--signal",),
    "open-mode": ("--open-mode",)}
SLURM_VALUE_OPTIONS = {option: name for name, options in SLURM_OPTIONS.items() for option in options}
SLURM_SWITCHES = ("--requeue", "--exclusive", "-u", "--unbuffered", "--kill-on-bad-exit")


def slurm_options(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """Slurm's options at the start of ``words`` (by their names in SLURM_OPTIONS), and the rest."""
    options, words = {}, list(words)
    while words and words[0].startswith("-"):
        word = words.pop(0)
        name, _, value = word.partition("=")
        if name in SLURM_SWITCHES:
            continue
        assert name in SLURM_VALUE_OPTIONS, f"unknown Slurm option {word}"
        options[SLURM_VALUE_OPTIONS[name]] = value or words.pop(0)
    return options, words


def script_options(script: str) -> dict[str, str]:
    """A submit script's #SBATCH options."""
    lines = (REPO / script).read_text().splitlines()
    words = [w for line in lines if line.startswith("#SBATCH ") for w in shlex.split(line[len("#SBATCH "):])]
    return slurm_options(words)[0]


def allocation_before(cmd: Command) -> str | None:
    """The `salloc ...` a comment names above a hand-run command, in the same code block."""
    lines = (REPO / cmd.page).read_text().splitlines()
    for raw in reversed(lines[:max(cmd.line - 1, 0)]):
        if raw.strip().startswith("```"):
            return None
        found = re.search(r"\bsalloc\s+([^)]*)", raw)
        if found:
            return found.group(1).replace("<your project>", "PROJECT").rstrip(":, ")
    return None


def resolve(cmd: Command) -> Job:
    env, words = cmd.env_and_words
    if words[0] == "sbatch":
        given, rest = slurm_options(words[1:])
        script, args = rest[0], rest[1:]
        options = {**script_options(script), **given}
        entry, by_hand = SUBMIT_SCRIPTS[script], False
    else:
        salloc = allocation_before(cmd)
        assert salloc, f"{cmd.where}: name the allocation this runs in (a comment: salloc ...) above it"
        options = slurm_options(shlex.split(salloc))[0]
        if words[0] == "srun":
            options.update(slurm_options(words[1:])[0])
        index = next(i for i, w in enumerate(words) if w.endswith(".py"))
        entry, args, by_hand = words[index], words[index + 1:], True
    nodes = int(options.get("nodes", 1))
    ranks = int(options.get("ntasks", nodes * int(options.get("ntasks-per-node", 1))))
    per_node = min(ranks, int(options.get("ntasks-per-node", math.ceil(ranks / nodes))))
    return Job(cmd, entry, args, ranks, per_node, options, by_hand)


def perlmutter_commands() -> list[Command]:
    def on_perlmutter(cmd: Command) -> bool:
        words = cmd.env_and_words[1]
        return words[0] in ("sbatch", "srun") or words[:2] == ["bash", HAND_RUN]
    return [c for c in course_commands() if on_perlmutter(c)]


COMMANDS = perlmutter_commands()


# ------------------------------------------------------------------ the checks ---
@functools.cache
def resolved(args: tuple[str, ...], strict: bool = True) -> tuple[Config, str]:
    """The Config and configuration name of a training script's arguments, as the launcher
    resolves them (the configuration checks run here: a refused combination raises ValueError).
    Not ``strict``: another script's arguments, of which the configuration's are read."""
    parser = arg_parser()
    if strict:
        try:
            parsed = parser.parse_args(list(args))
        except SystemExit:
            raise AssertionError(f"the training script rejects the flags {' '.join(args)}") from None
    else:
        parsed = parser.parse_known_args(list(args))[0]
    return resolve_config(parsed), parsed.config


def configuration(job: Job) -> tuple[Config, str]:
    return resolved(tuple(job.args), Path(job.entry).name in TRAIN_SCRIPTS)


def layout_of(job: Job) -> tuple[Config, dict[str, int], int]:
    """(a) and (b): the configuration and the launcher's checks of the layout."""
    cfg, name = configuration(job)
    model_parallel = Path(job.entry).name == "train_mp.py"
    from training.graphs import GraphStep
    from training.trainer import EagerStep

    step = GraphStep if Path(job.entry).name == "train_graph.py" else EagerStep  # its own refusals
    sizes, local_batch = check_layout(cfg, name, model_parallel, job.ranks, job.per_node, step)
    return cfg, sizes, local_batch


def cost_layout(cfg: Config, sizes: dict[str, int], local_batch: int, per_node: int) -> cm.Layout:
    """The cost model's Layout of this run. DeepSpeed's stages as the closest native mode: 1 and
    2 as zero1 (stage 2's sharded gradients counted whole), 3 as fsdp. Sequence parallelism is
    counted as plain tensor parallelism (more activations than it keeps)."""
    mode = cfg.data_parallel
    if cfg.engine == "deepspeed":
        mode = {0: "ddp", 1: "zero1", 2: "zero1", 3: "fsdp"}[cfg.zero_stage]
    dp = sizes[meshes.DATA]
    shard = meshes.hsdp_shard(cfg.layout, dp, per_node) if mode == "hsdp" else 0
    return cm.Layout(math.prod(sizes.values()), mode, sizes["tp"], sizes["cp"],
                     sizes["pp"], cfg.expert_parallel, cfg.pipeline_schedule, cfg.num_microbatches,
                     cfg.stages_per_rank, cfg.activation_checkpointing, local_batch * dp, shard)


def on_host(cfg: Config) -> tuple[str, ...]:
    """What offloading keeps in host memory: FSDP2's CPUOffloadPolicy the shards, their gradients
    and Adam's state; ZeRO-Offload the optimizer state, and at stage 3 the parameters and
    gradients too."""
    if not cfg.cpu_offload:
        return ()
    if cfg.engine == "deepspeed" and cfg.zero_stage < 3:
        return ("optimizer_state",)
    return ("parameters", "gradients", "optimizer_state")


def gpu_memory(cfg: Config, sizes: dict[str, int], local_batch: int, per_node: int) -> int:
    """(c) Bytes on the fullest GPU: the cost model's count in the run's precision, what it does
    not check included, what offloading keeps in host memory left out."""
    lay = cost_layout(cfg, sizes, local_batch, per_node)
    m = cm.Model.from_config(cfg)
    dtype = "float32" if cfg.amp_mode == "none" else "bfloat16"
    host = on_host(cfg)
    worst = 0
    for pp_rank in range(lay.pp):
        mem = cm.memory(m, lay, pp_rank, dtype=dtype)
        worst = max(worst, sum(v for k, v in mem.items() if k != "total" and k not in host))
    return worst


def check_memory(job: Job, cfg: Config, sizes: dict[str, int], local_batch: int) -> None:
    need, limit = gpu_memory(cfg, sizes, local_batch, job.per_node), MEMORY_SHARE * job.gpu_bytes
    assert need <= limit, (
        f"the cost model counts {need / 1e9:.1f} GB per GPU, more than {MEMORY_SHARE:.0%} of the "
        f"{job.gpu_bytes / 1e9:.0f} GB GPU ({limit / 1e9:.0f} GB; the rest is for what it does not "
        f"count): use more ranks, --activation_checkpointing, bf16, or 80 GB nodes (-C \"gpu&hbm80g\")")


def check_container(job: Job, cfg: Config) -> None:
    """(d) By hand inside salloc: the container with /data and /logs, as the submit scripts."""
    words = job.cmd.env_and_words[1]
    if words[:2] == ["bash", HAND_RUN]:
        wrapper = (REPO / HAND_RUN).read_text()
        assert "slurm_common.sh" in wrapper and re.search(r"^run_training ", wrapper, re.M)
        return
    used = (cfg.data_dir, cfg.expdir)
    needed = [m for m in CONTAINER_PATHS if any((p + "/").startswith(m + "/") for p in used)]
    container = next((i for i, w in enumerate(words) if w in ("shifter", "podman-hpc")), None)
    if container is not None:  # an explicit container: it must mount what the run reads and writes
        mounted = " ".join(words[container:]).replace(";", " ")
        needed = [m for m in needed if f":{m} " not in mounted + " " and f":{m}:" not in mounted]
    assert not needed, (f"runs outside the container, where {' and '.join(needed)} do not exist "
                        f"(the submit scripts mount them): run it with bash {HAND_RUN} SCRIPT ...")


PATH_FLAGS = ("--data_dir", "--expdir", "--out", "--out_dir", "--yaml_config")


def check_paths(job: Job) -> None:
    """(e) A path a command names is Perlmutter's."""
    env, words = job.cmd.env_and_words
    paths = list(env.values()) + [v for f, v in zip(words, words[1:]) if f in PATH_FLAGS]
    paths += [w.split("=", 1)[1] for w in words if w.split("=", 1)[0] in PATH_FLAGS and "=" in w]
    for path in paths:
        if "/" not in path:
            continue
        ok = (not path.startswith("/") and "$" not in path.split("/")[0]  # in the repository
              or path.startswith(("$SCRATCH/", "${SCRATCH}/", TUTORIAL_DATA, *CONTAINER_PATHS)))
        assert ok, (f"{path} is not a Perlmutter path: use $SCRATCH/..., the tutorial's data folder or "
                    f"one inside the repository")


def check_resources(job: Job, cfg: Config) -> None:
    """GPU nodes, a GPU for every rank (NCCL refuses two ranks on one), CPUs for the data workers."""
    constraint = job.slurm.get("constraint", "")
    assert constraint.strip('"').split("&")[0] == "gpu", f"-C {constraint or '(none)'}: not the GPU nodes"
    assert job.per_node <= min(GPUS_PER_NODE, job.gpus_per_node), (
        f"{job.per_node} rank(s) on a node where the job has {job.gpus_per_node} GPU(s): one rank per GPU")
    cpus = int(job.slurm.get("cpus-per-task", 1))
    assert cfg.num_data_workers < cpus, (f"{cfg.num_data_workers} data workers on {cpus} CPU(s) per task: "
                                         f"give the allocation -c 32, as the submit scripts have")


def check_comment(job: Job, sizes: dict[str, int], local_batch: int) -> None:
    """(f) The command's own comment: '# 16 GPUs', 'local batch 16', 'M=4, D=4'."""
    raw = (REPO / job.cmd.page).read_text().splitlines()[job.cmd.line - 1] if job.cmd.line else ""
    comment = raw.split(" # ", 1)[1] if " # " in raw else ""
    model = math.prod(s for n, s in sizes.items() if n != meshes.DATA)
    for pattern, actual in ((r"(\d+) GPUs", job.ranks), (r"local batch (\d+)", local_batch),
                            (r"M=(\d+)", model), (r"D=(\d+)", sizes[meshes.DATA])):
        said = re.search(pattern, comment)
        assert not said or int(said.group(1)) == actual, (f"the comment says '{said.group(0)}', the run "
                                                          f"has {actual}")


def prose(page: Path) -> list[tuple[int, str]]:
    """(line, paragraph) of the text outside code blocks."""
    paragraphs, current, start, in_code = [], [], 0, False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.strip().startswith("```"):
            in_code = not in_code
            line = ""
        if in_code or not line.strip():
            if current:
                paragraphs.append((start, " ".join(current)))
            current = []
            continue
        if not current:
            start = number
        current.append(line.strip())
    return paragraphs + ([(start, " ".join(current))] if current else [])


def needs_container(span: str) -> bool:
    """Whether an inline command (`python X.py --config NAME`, `srun python train.py`) runs one of
    the repository's scripts on a configuration that reads /data or writes /logs."""
    words = span.split()
    script = next((w for w in words if w.endswith(".py")), None)
    if not script or not re.match(r"(srun )?(\S*/)?python3? ", span) or not (REPO / script).is_file():
        return False
    config = next((w.split("=", 1)[1] for w in words if w.startswith("--config=")),
                  words[words.index("--config") + 1] if "--config" in words[:-1] else None)
    if config is None:  # a train script's default is `base`; only srun says it is meant to run so
        if words[0] != "srun" or Path(script).name not in ("train.py", "train_mp.py", "train_graph.py"):
            return False
        config = "base"
    cfg = resolved(("--config", config))[0]
    return any((p + "/").startswith(m + "/") for p in (cfg.data_dir, cfg.expdir) for m in CONTAINER_PATHS)


def check_hand_runs_in_prose(page: Path) -> list[str]:
    """(d) A command the text tells a learner to run on Perlmutter's data is a checked command of
    a bash block, not a phrase: as a phrase (`srun python train.py`, `python scripts/x.py
    --config short`) it reads like something to run as written, outside the container."""
    problems = []
    for line, text in prose(page):
        for span in re.findall(r"`([^`]+)`", text):
            if needs_container(span):
                problems.append(f"line {line}: `{span}` reads /data or writes /logs, which exist in the "
                                f"container: put it in a ```bash block under its salloc, as bash {HAND_RUN} "
                                f"SCRIPT ...")
    return problems


def check_page_paths(page: Path) -> list[str]:
    """(e) on the whole page: scratch is $SCRATCH (/pscratch/sd/<initial>/<user>), never
    /pscratch/$USER; the one other /pscratch path is the tutorial's data folder."""
    problems = []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        wrong = [p for p in re.findall(r"/pscratch/[^\s`'\")]*", line) if not p.startswith(TUTORIAL_DATA)]
        wrong += re.findall(r"/global/cscratch\S*", line)  # Cori's scratch, gone with Cori
        problems += [f"line {number}: {p} is not a Perlmutter path (scratch is $SCRATCH)" for p in wrong]
    return problems


def check_job(job: Job) -> None:
    """Every check of one command; AssertionError naming each problem found, or the run's own
    ValueError when it would refuse to start."""
    cfg, sizes, local_batch = layout_of(job)
    checks = [lambda: check_resources(job, cfg), lambda: check_memory(job, cfg, sizes, local_batch),
              lambda: check_paths(job), lambda: check_comment(job, sizes, local_batch)]
    if job.by_hand:
        checks.insert(0, lambda: check_container(job, cfg))
    problems = []
    for check in checks:
        try:
            check()
        except AssertionError as err:
            problems.append(str(err).split("\nassert ")[0])
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------ where ranks sit ---
def groups_of(job: Job) -> dict[str, list[list[int]]]:
    """Every group of the run's mesh as rank lists: tp, cp, dp, pp, the expert groups (ep,
    ep_replicas) and HSDP's (dp_shard, dp_replicate)."""
    cfg, sizes, _ = layout_of(job)
    requested = meshes.requested_sizes(cfg.layout)
    groups = meshes.group_layouts(job.ranks, requested, cfg.parallel_order)
    if cfg.expert_parallel > 1:
        groups.update(meshes.expert_layouts(job.ranks, sizes, "-".join(sizes), cfg.expert_parallel))
    if cfg.data_parallel == "hsdp":
        shard = meshes.hsdp_shard(cfg.layout, sizes["dp"], job.per_node)
        groups.update(meshes.hsdp_layouts(job.ranks, shard))
    return groups


def nodes_of(group: list[int]) -> set[int]:
    return {rank // GPUS_PER_NODE for rank in group}


@dataclass(frozen=True)
class Placement:
    """What a page says about where one command's ranks sit: the words must be on the page, and
    every group of ``dimension`` is ``inside`` one node or spread ``across`` nodes (one rank per
    node)."""

    page: str
    words: str
    command: str  # a part of the command's text that picks it out on its page
    dimension: str
    where: str  # "inside" or "across"

    def problem(self, job: Job) -> str | None:
        groups = groups_of(job)[self.dimension]
        if self.where == "inside":
            bad = [g for g in groups if len(nodes_of(g)) > 1]
        else:
            bad = [g for g in groups if len(nodes_of(g)) < len(g)]
        return f"{self.dimension} groups {bad[:3]} are not {self.where} nodes" if bad else None


PLACEMENTS = (
    Placement("docs/09-experts.md", "experts over the 4 GPUs of each node", "--num_experts", "ep", "inside"),
    Placement("docs/09-experts.md", "data parallel over\n4 nodes", "--num_experts", "ep_replicas", "across"),
    Placement("docs/06-sharding.md", "shard within each node", "--data_parallel=hsdp", "dp_shard", "inside"),
    Placement("docs/06-sharding.md", "replicate across the 4 nodes", "--data_parallel=hsdp", "dp_replicate",
              "across"),
    Placement("docs/07-pipeline-parallel.md", "keeps tensor parallelism, which communicates in every\nlayer, "
              "inside a node", "--tensor_parallel=4 --pipeline_parallel=2\n", "tp", "inside"),
    Placement("docs/07-pipeline-parallel.md", "sends only the stage boundary's tokens between the\nnodes",
              "--tensor_parallel=4 --pipeline_parallel=2\n", "pp", "across"),
    Placement("docs/05-model-parallel.md", "a tensor-parallel group is\nconsecutive ranks, GPUs of one "
              "node", "--config=mp --tensor_parallel=4\n", "tp", "inside"),
    Placement("docs/05-model-parallel.md", "data parallelism, which communicates once per step, goes\nacross "
              "nodes", "--config=mp --tensor_parallel=4\n", "dp", "across"),
)


def placement_job(claim: Placement) -> Job:
    chosen = [c for c in COMMANDS if c.page == claim.page and claim.command in c.text + "\n"]
    assert len(chosen) == 1, f"{claim.page}: {len(chosen)} commands contain {claim.command!r}"
    return resolve(chosen[0])


# ------------------------------------------------------------------ tests ---
def test_the_pages_have_perlmutter_commands():
    assert len(COMMANDS) >= 25 and any(c.env_and_words[1][:2] == ["bash", HAND_RUN] for c in COMMANDS)


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: f"{Path(c.page).stem}:{c.line}")
def test_a_perlmutter_command(cmd):
    try:
        check_job(resolve(cmd))
    except (AssertionError, ValueError) as err:  # ValueError: the run's own one-line refusal
        raise AssertionError(f"{cmd.where}: {cmd.text}\n{err}") from None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_scratch_paths_are_perlmutters(page):
    problems = check_page_paths(page)
    assert not problems, f"{page.name}:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_hand_runs_are_commands_not_phrases(page):
    problems = check_hand_runs_in_prose(page)
    assert not problems, f"{page.name}:\n" + "\n".join(problems)


@pytest.mark.parametrize("claim", PLACEMENTS, ids=lambda c: f"{Path(c.page).stem}:{c.dimension}")
def test_what_a_page_says_about_where_ranks_sit(claim):
    text = " ".join((REPO / claim.page).read_text().split())  # line breaks read as spaces
    words = " ".join(claim.words.split())
    assert words in text, f"{claim.page} no longer says {claim.words!r}: update PLACEMENTS"
    problem = claim.problem(placement_job(claim))
    assert problem is None, f"{claim.page} says {claim.words!r}, but {problem}"


# ------------------------------------------------ the checks find what they look for ---
def job(text: str) -> Job:
    """A command that is on no page (line 0: no comment, no allocation above it)."""
    return resolve(Command(0, text, "README.md"))


@pytest.mark.parametrize("text, message", [
    ("sbatch --nodes 4 submit_pm_mp.sh --config=large --tensor_parallel=4 --pipeline_parallel=4 "
     "--data_parallel=fsdp", "--data_parallel fsdp shards over the data-parallel ranks, but 16 ranks at "
                             "tensor_parallel 4 x pipeline_parallel 4 leave 1 data-parallel rank: start 32"),
    ("sbatch submit_pm.sh --config=short --data_parallel=zero1", "--data_parallel zero1 shards over"),
    ("sbatch submit_pm.sh --config=short --grad_compression=bf16", "--grad_compression bf16 compresses"),
    ("sbatch --nodes 1 submit_pm_dp.sh --config=large --data_parallel=hsdp", "one sharding group of all 4"),
    ("sbatch --nodes 1 submit_pm_dp.sh --config=short --dp_shard=2", "--dp_shard 2 sizes hsdp's"),
    ("sbatch --nodes 1 submit_pm_dp.sh --config=short --no-reshard_after_forward", "keeps FSDP's gathered"),
    ("sbatch --nodes 1 submit_pm_mp.sh --config=mp --pipeline_schedule=gpipe", "orders a pipeline's"),
    ("sbatch --nodes 1 submit_pm_dp.sh --config=short --sequence_parallel", "with --tensor_parallel 2"),
    ("sbatch --nodes 1 submit_pm_dp.sh --config=short --cpu_offload", "use it with --data_parallel fsdp"),
    ("sbatch --nodes 1 submit_pm_mp.sh --config=mp --tensor_parallel=3", "world size 4 is not divisible"),
    ("sbatch --nodes 3 submit_pm_dp.sh --config=bs64_opt", "global_batch_size 64 is not divisible by the 12"),
    ("sbatch --nodes 2 submit_pm_mp.sh --config=mp --tensor_parallel=4 --pipeline_parallel=2 "
     "--num_microbatches=3", "does not split into --num_microbatches 3"),
])
def test_the_runs_own_checks_refuse_in_one_line(text, message):
    """(a), (b): what the run would refuse at start, or switch off without a word before these
    checks (fsdp, zero1 or compression with one data-parallel rank), is one ValueError."""
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        check_job(job(text))
    assert "\n" not in str(err.value)


def test_memory_beyond_the_gpu_is_found():
    """(c) SC23's flag name at one node: tp 4 x dp 1, local batch 64 (the cost model: about 57 GB
    in bf16, more than a 40 GB A100 holds); on 4 nodes, 16 GB; offloading leaves the states out."""
    one = job("sbatch --nodes 1 submit_pm_mp.sh --config=mp_short --row_parallel_size=4")
    with pytest.raises(AssertionError, match=r"counts 6\d\.\d GB per GPU, more than 55% of the 40 GB GPU"):
        check_job(one)
    four = layout_of(job("sbatch --nodes 4 submit_pm_mp.sh --config=mp_short --row_parallel_size=4"))
    assert 15e9 < gpu_memory(*four, 4) < 17e9
    cfg, sizes, local = layout_of(job("sbatch --nodes 2 submit_pm_dp.sh --config=xl --data_parallel=fsdp"))
    kept = layout_of(job("sbatch --nodes 2 submit_pm_dp.sh --config=xl --data_parallel=fsdp --cpu_offload"))
    lay = cost_layout(cfg, sizes, local, 4)
    states = sum(cm.memory(cm.Model.from_config(cfg), lay)[k] for k in ("parameters", "gradients",
                                                                         "optimizer_state"))
    assert gpu_memory(cfg, sizes, local, 4) - gpu_memory(*kept, 4) == states > 0
    big = job('sbatch --nodes 1 -C "gpu&hbm80g" submit_pm_mp.sh --config=mp_short --row_parallel_size=4')
    assert big.gpu_bytes == 80e9 and one.gpu_bytes == 40e9


def test_a_hand_run_without_the_container_is_found():
    """(d) `srun python ... --config short` in salloc: `short` reads /data and writes /logs."""
    page = "docs/02-optimizations.md"
    lines = (REPO / page).read_text().splitlines()
    line = next(i for i, raw in enumerate(lines, 1) if "salloc" in raw and raw.lstrip().startswith("#")) + 1
    bare = resolve(Command(line, "srun python train_graph.py --config short --amp_mode bf16", page))
    assert bare.by_hand and bare.ranks == 1
    with pytest.raises(AssertionError, match="outside the container, where /data and /logs do not exist"):
        check_job(bare)
    check_job(resolve(Command(line, f"bash {HAND_RUN} train_graph.py --config short --amp_mode bf16", page)))
    mounted = ('srun shifter --image=nersc/pytorch:25.06.01 --volume="$DATADIR:/data;$SCRATCH/logs:/logs" '
               'python train_graph.py --config short')
    check_job(resolve(Command(line, mounted, page)))
    with pytest.raises(AssertionError, match="where /logs do not exist"):
        check_job(resolve(Command(line, mounted.replace(";$SCRATCH/logs:/logs", ""), page)))
    with pytest.raises(AssertionError, match="name the allocation"):
        job(f"bash {HAND_RUN} train_graph.py --config short")


def test_paths_that_are_not_perlmutters_are_found(tmp_path):
    """(e) /pscratch/$USER on a page, or as a command's folder."""
    page = tmp_path / "page.md"
    page.write_text(f"FR=/pscratch/$USER/fr_\ndata: {TUTORIAL_DATA}\nLOGDIR=$SCRATCH/x /global/cscratch1\n")
    assert [p.split(" is ")[0] for p in check_page_paths(page)] == ["line 1: /pscratch/$USER/fr_",
                                                                    "line 3: /global/cscratch1"]
    with pytest.raises(AssertionError, match="not a Perlmutter path"):
        check_paths(job("LOGDIR=/pscratch/$USER/logs sbatch submit_pm.sh --config=short"))
    check_paths(job("LOGDIR=$SCRATCH/my-logs sbatch submit_pm.sh --config=short"))


def test_a_placement_that_the_mesh_does_not_give_is_found():
    """(f) Expert groups cut from dp under `mp`'s tensor parallel 4 span the nodes; with tp 1 they
    are a node's 4 GPUs. A comment's sizes are checked too."""
    inside = Placement("docs/09-experts.md", "", "", "ep", "inside")
    spanning = job("sbatch --nodes 4 submit_pm_mp.sh --config=mp --num_experts=16 --expert_parallel=4")
    assert groups_of(spanning)["ep"][0] == [0, 4, 8, 12]
    assert inside.problem(spanning) == ("ep groups [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14]] are not "
                                        "inside nodes")
    assert inside.problem(job("sbatch --nodes 4 submit_pm_mp.sh --config=mp --tensor_parallel=1 "
                              "--num_experts=16 --expert_parallel=4")) is None
    page = "docs/03-data-parallel.md"
    line = next(c.line for c in COMMANDS if c.page == page and "bs64_opt " in c.text + " ")
    wrong = resolve(Command(line, "sbatch -N 2 submit_pm_dp.sh --config=bs64_opt", page))
    with pytest.raises(AssertionError, match="the comment says '4 GPUs', the run has 8"):
        check_job(wrong)
