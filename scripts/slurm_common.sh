# Shared by the submit_pm*.sh batch scripts (sourced, not run). Provides run_training:
#
#   run_training ENTRY_SCRIPT [ARGS...]
#
# starts one srun step with one training process per Slurm task. Settings, all
# overridable from the environment at submission (sbatch exports it to the job):
#   DATADIR   ERA5 folder (train/, valid/, stats/)       default: the newest tutorial's (SC25) copy on
#             Perlmutter; scratch is purged: elsewhere, download it (docs/01-single-device.md)
#   LOGDIR    root of the run directories                 default: $SCRATCH/era5-vit/logs or ./logs
#   IMAGE     Shifter image, used when `shifter` exists   default: nersc/pytorch:25.06.01 (torch 2.8)
#   SHIFTER_MODULES  shifter modules                       default: gpu,nccl-plugin (Slingshot NCCL)
#   NATIVE=1  run with PYTHON (a venv) even where shifter exists
#   ENABLE_PROFILING=1 PROFILE_OUTPUT=name   run under `nsys profile` (output in $LOGDIR)
#   REQUEUE=1  when training stops on a signal with its checkpoint (status 75, or rank 0's word in
#             $LOGDIR/.stopped-JOB_ID where srun reports another rank's kill) the job is put back in
#             the queue (the submit scripts ask for --requeue, which scontrol requeue needs)
#   PYTHON    interpreter outside a container             default: REPO/.venv/bin/python, else python3
#   TORCH_NCCL_TRACE_BUFFER_SIZE  NCCL's Flight Recorder: collectives kept per rank (default 2000;
#             0 turns it off); dumped on a collective timeout to $LOGDIR/flight_recorder/JOB_ID/

: "${DATADIR:=/pscratch/sd/s/shas1693/data/sc25_tutorial_data}"
if [ -n "${SCRATCH:-}" ]; then : "${LOGDIR:=$SCRATCH/era5-vit/logs}"; else : "${LOGDIR:=$REPO/logs}"; fi
# A current NERSC PyTorch image (SC25's): its torch (2.8) is in the supported range; SC23's
# ngc-23.07-v0 is far older than the APIs this code calls.
: "${IMAGE:=nersc/pytorch:25.06.01}"
: "${SHIFTER_MODULES:=gpu,nccl-plugin}"
EXIT_STOPPED=75  # utils/signals.py: stopped on a signal after writing the checkpoint

# HDF5's file locks fail or serialise reads on Lustre and DVS mounts; the data is read-only.
export HDF5_USE_FILE_LOCKING=FALSE
# Rendezvous: rank 0 runs on the job's first node, named as the node list names it (as
# export_DDP_vars.sh and distributed/env.py name it without this); a port derived from the job
# ID lets several jobs share a node.
export MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "${SLURM_JOB_NODELIST:-}" 2>/dev/null | head -n 1)}
export MASTER_ADDR=${MASTER_ADDR:-$(hostname)}   # no node list (not inside a job)
export MASTER_PORT=${MASTER_PORT:-$((29500 + ${SLURM_JOB_ID:-0} % 20000))}
if [ "${NERSC_HOST:-}" = perlmutter ]; then
  export FI_MR_CACHE_MONITOR=userfaultfd  # libfabric memory registration cache on Slingshot
fi

# How srun binds each task's CPUs. A rank takes the GPU of its local rank (utils/device.py), so
# the CPUs follow the GPUs, not the other way round: renumbering the GPUs with an exported
# CUDA_VISIBLE_DEVICES does not survive srun, which sets that variable for every step itself
# (tests/test_slurm.py shows it on a real Slurm). On a whole Perlmutter GPU node (4 GPUs, a task
# each) GPU i is attached to NUMA domain 3 - i: task i is bound to that domain. Elsewhere each
# task gets cores of its own.
cpu_binding() {
  if [ "${NERSC_HOST:-}" = perlmutter ] && [ "${SLURM_GPUS_ON_NODE:-0}" = 4 ] \
      && [ "${SLURM_NTASKS_PER_NODE:-0}" = 4 ]; then
    echo map_ldom:3,2,1,0
  else
    echo cores
  fi
}

run_training() {
  local entry=$1; shift
  local launcher=(srun --kill-on-bad-exit=1 -u)
  # From Slurm 22.05 on, srun does not take --cpus-per-task from the batch allocation: each
  # task would get one CPU, and DataLoader workers and DALI threads would share it. Pass the
  # allocation's CPUs per task on, each task bound to its own CPUs (next to its GPU on
  # Perlmutter: cpu_binding above).
  if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
    export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK
    launcher+=(-c "$SLURM_CPUS_PER_TASK" --cpu-bind="$(cpu_binding)")
  fi
  local profile=() cmd=() rc=0
  if ! mkdir -p "$LOGDIR" 2>/dev/null; then
    echo "error: cannot create LOGDIR=$LOGDIR; set LOGDIR to a folder you can write" >&2
    return 2
  fi
  local arg given_data=0
  for arg in "$@"; do case $arg in --data_dir|--data_dir=*) given_data=1 ;; esac; done
  case $entry in
    train*.py) if [ "$given_data" = 0 ] && [ ! -d "$DATADIR/train" ]; then
        echo "error: DATADIR=$DATADIR has no train/ folder; set DATADIR to your ERA5 folder (sbatch passes your environment on: DATADIR=/path sbatch ...)" >&2
        return 2
      fi ;;
  esac
  if [ "${ENABLE_PROFILING:-0}" = 1 ]; then
    local out="$LOGDIR/${PROFILE_OUTPUT:-profile}"
    [ "${SLURM_NTASKS:-1}" -gt 1 ] && out="${out}_rank%q{SLURM_PROCID}"  # one report per rank
    profile=(nsys profile --trace=cuda,cublas,nvtx --kill none -c cudaProfilerApi -f true -o "$out")
    # a graph replay is one launch: show the kernels inside it
    [ "$entry" = train_graph.py ] && profile+=(--cuda-graph-trace=node)
  fi
  local runner=() traces=flight_recorder/${SLURM_JOB_ID:-local} in_logs
  in_logs=$(cd "$LOGDIR" && pwd)
  if [ "${NATIVE:-0}" != 1 ] && command -v shifter >/dev/null 2>&1; then
    in_logs=/logs  # where the container sees LOGDIR
  fi
  # NCCL's Flight Recorder: every rank keeps its last collectives (kind, sizes, state); when NCCL's
  # watchdog times one out, each rank writes them to $traces/rank_N before NCCL ends the process
  # (python -m torch.distributed.flight_recorder.fr_trace FOLDER names the rank that did not
  # enter; docs/04-communication.md). torch 2.8 reads the older name of the file prefix.
  mkdir -p "$LOGDIR/$traces"
  export TORCH_NCCL_TRACE_BUFFER_SIZE=${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}
  export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
  export TORCH_FR_DUMP_TEMP_FILE=$in_logs/$traces/rank_
  export TORCH_NCCL_DEBUG_INFO_TEMP_FILE=$TORCH_FR_DUMP_TEMP_FILE
  # rank 0 writes this once every rank has stopped on a signal after the checkpoint (training/
  # launcher.py): with --kill-on-bad-exit, srun may end the others before they exit 75 themselves
  # and report their kill (137), yet the run is safe to continue
  local stopped=.stopped-${SLURM_JOB_ID:-local}
  rm -f "$LOGDIR/$stopped"
  export TRAINING_STOPPED_FILE=$in_logs/$stopped
  if [ "$in_logs" = /logs ]; then
    # pip install --user inside this image goes to its own folder, not the host's ~/.local
    export PYTHONUSERBASE="$HOME/.local/perlmutter/${IMAGE//[:\/]/_}"
    runner=(shifter --image="$IMAGE" --module="$SHIFTER_MODULES" --volume="$DATADIR:/data;$LOGDIR:/logs")
    cmd=("${runner[@]}" bash -c 'source ./export_DDP_vars.sh && exec "$@"' rank "${profile[@]}" python "$entry" "$@")
    runner+=(python)
  else
    local python=${PYTHON:-}
    if [ -z "$python" ]; then
      if [ -x "$REPO/.venv/bin/python" ]; then python=$REPO/.venv/bin/python; else python=python3; fi
    fi
    if [ ${#profile[@]} -gt 0 ] && ! command -v nsys >/dev/null 2>&1; then
      echo "error: ENABLE_PROFILING=1 needs Nsight Systems (nsys) on PATH; load it or unset ENABLE_PROFILING" >&2
      return 2
    fi
    # outside the container /data and /logs do not exist: point the flags at the folders
    # (flags given to this script come later and win)
    cmd=(bash -c 'source ./export_DDP_vars.sh && exec "$@"' rank "${profile[@]}" "$python" "$entry"
         --data_dir "$DATADIR" --expdir "$LOGDIR" "$@")
    runner=("$python")
  fi
  cd "$REPO" || return 1
  # once, on the job's first node: what the job runs on, before anything can fail
  "${runner[@]}" scripts/versions.py || return 2
  set -x
  "${launcher[@]}" "${cmd[@]}"
  rc=$?
  { set +x; } 2>/dev/null
  if [ "$rc" != "$EXIT_STOPPED" ] && [ -f "$LOGDIR/$stopped" ]; then
    echo "srun returned $rc, but training stopped on a signal with a checkpoint ($(cat "$LOGDIR/$stopped"))"
    rc=$EXIT_STOPPED
  fi
  rm -f "$LOGDIR/$stopped"
  if [ "$rc" = "$EXIT_STOPPED" ] && [ "${REQUEUE:-0}" = 1 ] && [ -n "${SLURM_JOB_ID:-}" ]; then
    echo "training stopped on a signal with a checkpoint: requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID" && return 0
  fi
  return "$rc"
}
