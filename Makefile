# Two commands do all the set-up: `make train` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
DATA   := data/synthetic
CONFIG ?= tiny

.PHONY: venv data train test test-compat test-newest compat-env lint clean-logs exercise gpu-check gpu-wheels \
	gpu-check-deps deepspeed

venv: $(STAMP)

$(STAMP): requirements.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	@touch $(STAMP)

# the demo data set (343 MB: three year files): 730 six-hourly samples per split on a 32 x 64 grid
data: $(DATA)/stats/global_stds.npy

# regenerated when the generator is newer than the data (after a pull that changed it), so
# the demo always trains on what the course pages' numbers were measured on
$(DATA)/stats/global_stds.npy: scripts/make_synthetic_era5.py utils/synthetic_era5.py utils/era5.py | $(STAMP)
	$(BIN)/python scripts/make_synthetic_era5.py --output_dir $(DATA) --img_size 32 64 --samples_per_year 730

train: venv data
	$(BIN)/python train.py --config $(CONFIG)

# optional: DeepSpeed's engine (train.py --engine deepspeed, docs/10-deepspeed.md), pinned, into
# .venv; then its one compiled part is built (cached in ~/.cache/torch_extensions, or in
# $$TORCH_EXTENSIONS_DIR), so that no run waits for the compiler
DS_STAMP := $(VENV)/.deepspeed-stamp
deepspeed: $(DS_STAMP)

$(DS_STAMP): requirements-deepspeed.txt | $(STAMP)
	$(BIN)/python -m pip install --quiet -r requirements-deepspeed.txt
	$(BIN)/python -c "from training.deepspeed_engine import build_ops; build_ops()"
	@touch $@

lint: venv
	$(BIN)/ruff check .

# two pytest workers (pytest-xdist): most tests wait on subprocesses, so two share 2 cores well;
# files whose module fixtures start ranks or a Slurm cluster stay on one worker (xdist_group)
test: venv lint
	$(BIN)/python -m pytest -n 2 --dist loadgroup

# the suite again on other supported torch versions, each in an environment of its own
# (.venv-compat-VERSION, the CUDA build from the package index, 7.8 GB installed for 2.8.0; it
# runs on a CPU): the oldest (2.8.0, what NERSC's containers carry) with `make test-compat`, the
# newest (requirements-newest.txt) with `make test-newest`; COMPAT_TORCH=2.11.0 make test-compat
# tries another. These runs leave out the walk through the course's pages (marker `course`: it
# checks commands and pages, which the pinned torch of `make test` covers) and the Slurm tests
# (marker `slurm`: the submit scripts and the cluster's nodes, signals and requeue, which do not
# depend on torch's version); `make compat-env` only builds the environment.
COMPAT_TORCH ?= 2.8.0
NEWEST_TORCH := $(shell sed -n 's/^torch==//p' requirements-newest.txt)
COMPAT_VENV  := .venv-compat-$(COMPAT_TORCH)
COMPAT_STAMP := $(COMPAT_VENV)/.installed

$(COMPAT_STAMP): requirements.txt requirements-newest.txt
	@test -x $(COMPAT_VENV)/bin/python || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install --quiet --upgrade pip
	grep -v '^torch==' requirements.txt > $(COMPAT_VENV)/requirements-no-torch.txt
	$(COMPAT_VENV)/bin/python -m pip install --quiet torch==$(COMPAT_TORCH) -r $(COMPAT_VENV)/requirements-no-torch.txt
	@touch $@

compat-env: $(COMPAT_STAMP)

test-compat: $(COMPAT_STAMP)
	$(COMPAT_VENV)/bin/python -m pytest -n 2 --dist loadgroup -m "not course and not deepspeed and not slurm"

test-newest:
	$(MAKE) test-compat COMPAT_TORCH=$(NEWEST_TORCH)

# on a CUDA machine, within 10 minutes: the cuda tests by part (tests/gpu_parts.py), train.py against
# train_graph.py, DALI against the PyTorch loader, the optimization ladder; report in
# logs/gpu_check/report.md (flags: ARGS="--skip ladder"). It installs nothing and runs the python
# that is there: the container's on a GPU node (make gpu-check PYTHON=python), .venv's once activated
gpu-check:
	$(PYTHON) scripts/gpu_check.py $(ARGS)

# a GPU machine without a package index: `make gpu-wheels` on a machine with one downloads the check's
# pure-Python packages (requirements-gpu-check.txt) into logs/gpu-wheels/; copy the clone over, then
# `make gpu-check-deps PYTHON=python3` there installs them from that folder (PIP_FLAGS=--user if the
# python's own folders are read-only)
GPU_WHEELS := logs/gpu-wheels
gpu-wheels:
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --implementation py --abi none \
		--platform any --python-version 3.10 --dest $(GPU_WHEELS) -r requirements-gpu-check.txt

gpu-check-deps:
	$(PYTHON) -m pip install --no-index --no-deps --find-links $(GPU_WHEELS) $(PIP_FLAGS) -r requirements-gpu-check.txt

clean-logs:
	rm -rf logs

# check your solution of an exercise: make exercise NAME=sample_index (see exercises/README.md)
exercise: venv
	@test -n "$(NAME)" || { echo "usage: make exercise NAME=<name from exercises/README.md>"; exit 2; }
	EXERCISE_VARIANT=exercise $(BIN)/python -m pytest tests/test_exercises.py -k "$(NAME)" -p no:cacheprovider
