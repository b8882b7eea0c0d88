# Every user command is a target here; the README lists them. Targets set themselves up on first use.
#   make profile STRATEGY=padded [MODE=train|forward] [NPROC=N] [BOXES=widerface:gt.txt] [ARGS="data.batch_size=256"]
#   make shapes [BOXES=coco:instances.json|widerface:gt.txt] [ARGS="data.max_boxes=512"]
#   make bench [TARGET=losses|kernels|layers|blocks|step] [ARGS="bench.repeats=50"]
#   make compare [RUNS="runs/profile/padded/<time> ..."] | report | train EXPERIMENT=... | test | test-all | lint
#   make curves RUNS="runs/train/<experiment>/<run> ..."
#   make train EXPERIMENT=... [NPROC=N] [NNODES=M RDZV_ENDPOINT=host:port]
#   make tensorboard [ARGS="--port 6007"]
#   make export RUN=runs/train/<experiment>/<run> | predict RUN=... ARGS="0 1 2"
#   make gpu-check

# The interpreter that creates the virtualenv (Python >= 3.10).
PYTHON ?= python3
VENV ?= .venv
# PY=python3: use an environment you manage (no virtualenv, no installs).
PY ?= $(VENV)/bin/python
# The torch pinned on machines without an NVIDIA GPU.
CPU_TORCH ?= 2.13.0
# SYSTEM_TORCH=1: the virtualenv sees (and keeps) the torch already installed, e.g. a CUDA build.
SYSTEM_TORCH ?=
STRATEGY ?= padded
# the boxes (data.boxes) of profile, train and shapes: synthetic by default, or coco:<instances.json> or
# widerface:<wider_face_*_bbx_gt.txt> (an annotation file, scaled to the images); STRATEGY=my_module:my_loss
# takes a loss from my_module.py (README: a strategy of your own)
BOXES ?=
DATA_BOXES = $(if $(BOXES),'data.boxes=$(BOXES)')
MODE ?= train
EXPERIMENT ?= cpu_smoke
# bench target: losses (every strategy's loss), kernels (GPU: the custom kernels), layers (GPU: triton, layer by
# layer), blocks (GPU: the fused conv blocks' launch configurations), step (the training step against the floor)
TARGET ?= losses
# compare: profile run folders to compare (default: the latest run of each strategy and mode); curves: training runs
RUNS ?=
NPROC ?= 1
# train on several machines: on each of them the same command with NNODES=M, RDZV_ENDPOINT=<host:port of one of
# them> and RDZV_ID; c10d numbers the nodes as they join (RDZV_BACKEND=static: NODE_RANK=0..M-1, node 0 at the endpoint)
NNODES ?= 1
NODE_RANK ?= 0
RDZV_BACKEND ?= c10d
RDZV_ENDPOINT ?= localhost:29400
RDZV_ID ?= $(EXPERIMENT)
ARGS ?=
PYTEST_ARGS ?=
# WHEELS=<dir>: a machine without network installs the Python packages it lacks from wheel files in <dir>.
WHEELS ?=
PIP_OFFLINE = $(if $(WHEELS),--no-index --find-links $(WHEELS))
# train.float8's library, as pyproject.toml's `float8` extra pins it (torch >= 2.11)
TORCHAO ?= torchao>=0.18
# the lab's independent cross-check (tests/lab/measure/test_against_hta.py), as pyproject.toml's `hta` extra pins it;
# by name, not through the extra: `pip install -e .[hta]` would build the project again in an isolated environment
HTA ?= holistictraceanalysis>=0.5,<0.6

# Set-up runs only for the project's own virtualenv, and again when the build inputs change.
ifeq ($(PY),$(VENV)/bin/python)
SETUP := $(VENV)/.installed
endif

.PHONY: setup test test-all profile profile-all compare curves report tensorboard bench bench-kernels bench-step train shapes export predict lint format gpu-check clean

setup: $(SETUP)

# numpy before torch: torch imported without it (by the probe below and by setup.py) warns "Failed to initialize NumPy".
# torchvision (optional: the torchvision strategies) comes last, from the installed torch's family (minor + 15: torch 2.11
# -> 0.26), --no-deps to keep that torch, after the project (its matplotlib brings pillow, which torchvision imports);
# a build that cannot load against this torch (the registry's CUDA build beside a CPU torch) is uninstalled again.
# torchao (optional: train.float8, the project's `float8` extra) likewise, --no-deps; its CPU tests run where it loads.
$(VENV)/.installed: pyproject.toml $(wildcard setup.py) $(wildcard extensions/*)
	@echo "setting up $(VENV) (once, and again when pyproject.toml, setup.py or extensions/ change): pip, torch, the project's packages, then the detector._C extension"
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(if $(SYSTEM_TORCH),--system-site-packages) $(VENV)
	$(VENV)/bin/pip install -q $(if $(WHEELS),$(PIP_OFFLINE),--upgrade) pip setuptools wheel ninja
	$(VENV)/bin/pip install -q $(PIP_OFFLINE) numpy
	@if $(VENV)/bin/python -c "import torch" 2>/dev/null; then \
		echo "using the installed torch $$($(VENV)/bin/python -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
		echo "NVIDIA GPU found: installing the registry's CUDA build of torch"; $(VENV)/bin/pip install -q torch; \
	else \
		echo "no NVIDIA GPU: installing the CPU build torch==$(CPU_TORCH)"; $(VENV)/bin/pip install -q torch==$(CPU_TORCH); \
	fi
	@echo "installing the project and building its detector._C extension: about 1-2 minutes on 2 cores for the C++ CPU kernel, several more for the CUDA kernels where nvcc is found; pip is silent meanwhile"
	@start=$$(date +%s); $(VENV)/bin/pip install -q --no-build-isolation $(PIP_OFFLINE) -e ".[dev]" \
		&& echo "detector._C built and the project installed in $$(( $$(date +%s) - start )) s"
	@if $(VENV)/bin/python -c "import torchvision.ops" 2>/dev/null; then \
		echo "using the installed torchvision $$($(VENV)/bin/python -c 'import torchvision; print(torchvision.__version__)')"; \
	else \
		torch=$$($(VENV)/bin/python -c 'import torch; print(torch.__version__)'); \
		tv="torchvision==0.$$(( $$(echo $$torch | cut -d. -f2) + 15 )).*"; \
		if ! $(VENV)/bin/pip install -q --no-deps $(PIP_OFFLINE) "$$tv" >/dev/null 2>&1; then \
			echo "no $$tv (the family of torch $$torch) to install: the torchvision strategies are unavailable"; \
		elif ! err=$$($(VENV)/bin/python -c "import torchvision.ops" 2>&1); then \
			$(VENV)/bin/pip uninstall -q -y torchvision; \
			echo "$$tv cannot load against torch $$torch ($$(echo "$$err" | tail -n 1)): uninstalled, the torchvision strategies are unavailable"; \
		else \
			echo "installed torchvision $$($(VENV)/bin/python -c 'import torchvision; print(torchvision.__version__)') for torch $$torch"; \
		fi; \
	fi
	@if $(VENV)/bin/python -c "import torchao.float8" 2>/dev/null; then \
		echo "using the installed torchao $$($(VENV)/bin/pip show torchao | sed -n 's/^Version: //p')"; \
	elif ! $(VENV)/bin/pip install -q --no-deps $(PIP_OFFLINE) "$(TORCHAO)" >/dev/null 2>&1; then \
		echo "no $(TORCHAO) to install: train.float8 is unavailable (pip install torchao, or WHEELS=<dir> holding its wheel)"; \
	elif ! err=$$($(VENV)/bin/python -c "import torchao.float8" 2>&1); then \
		$(VENV)/bin/pip uninstall -q -y torchao; \
		echo "torchao cannot load against this torch ($$(echo "$$err" | tail -n 1)): uninstalled, train.float8 is unavailable"; \
	else \
		echo "installed torchao $$($(VENV)/bin/pip show torchao | sed -n 's/^Version: //p') for train.float8"; \
	fi
	@if $(VENV)/bin/python -c "import hta" 2>/dev/null; then \
		echo "using the installed holistictraceanalysis $$($(VENV)/bin/pip show holistictraceanalysis | sed -n 's/^Version: //p')"; \
	elif ! $(VENV)/bin/pip install -q $(PIP_OFFLINE) "$(HTA)" >/dev/null 2>&1; then \
		echo "no holistictraceanalysis to install: tests/lab/measure/test_against_hta.py is skipped (WHEELS=<dir> holding it)"; \
	else \
		echo "installed holistictraceanalysis $$($(VENV)/bin/pip show holistictraceanalysis | sed -n 's/^Version: //p') for the lab's cross-check"; \
	fi
	@touch $@

# The suite in parallel on every core (pytest-xdist): `make test` leaves the browser, multi-process, end-to-end and
# long-training tests to `make test-all` (tests/conftest.py lists them); CI runs both.
TEST_WORKERS ?= auto
# PYTHONDONTWRITEBYTECODE= : pytest keeps the test modules it rewrites (their asserts) in __pycache__, where a shell
# that sets it (some containers do) makes every worker rewrite them all again at each start, about 3 s of each
test: $(SETUP)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not slow" $(PYTEST_ARGS)

test-all: $(SETUP)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

# NPROC=N: N processes under torchrun, the step `make train NPROC=N` runs; each rank records its own run (<time>/rank<r>).
profile: $(SETUP)
ifeq ($(NPROC),1)
	$(PY) -m detector profile profile.strategy=$(STRATEGY) profile.mode=$(MODE) $(DATA_BOXES) $(ARGS)
else
	$(PY) -m detector.cli.launch --standalone --nproc_per_node=$(NPROC) \
		-m detector profile profile.strategy=$(STRATEGY) profile.mode=$(MODE) $(DATA_BOXES) $(ARGS)
endif

# The shape of a dataset's targets: box counts, padding at the slots, the strategy predicted fastest, and where
# the profiles over the same boxes disagree with it.
shapes: $(SETUP)
	$(PY) -m detector shapes $(DATA_BOXES) $(ARGS)

compare: $(SETUP)
	$(PY) -m detector compare $(RUNS)

# Training runs' loss curves side by side: the first is the baseline, the last of three or more the noise reference.
curves: $(SETUP)
	$(PY) -m detector curves $(RUNS)

# The lab's standard set on this machine -> docs/results/<device>.md (resumes where a stopped one stopped).
report: $(SETUP)
	$(PY) -m detector report $(ARGS)

tensorboard: $(SETUP)
	$(PY) -m detector tensorboard $(ARGS)

bench: $(SETUP)
	$(PY) -m detector bench $(TARGET) $(ARGS)

# The same as `make bench TARGET=kernels`.
bench-kernels: $(SETUP)
	$(PY) -m detector bench kernels $(ARGS)

# The training step against the machine's floor (GPU), speed options and data pipeline.
bench-step: $(SETUP)
	$(PY) -m detector bench step $(ARGS)

train: $(SETUP)
ifneq ($(NNODES),1)
	$(PY) -m detector.cli.launch --nnodes=$(NNODES) --node_rank=$(NODE_RANK) --rdzv-backend=$(RDZV_BACKEND) \
		--rdzv-endpoint=$(RDZV_ENDPOINT) --rdzv-id=$(RDZV_ID) --nproc_per_node=$(NPROC) \
		-m detector train --experiment $(EXPERIMENT) $(DATA_BOXES) $(ARGS)
else ifeq ($(NPROC),1)
	$(PY) -m detector train --experiment $(EXPERIMENT) $(DATA_BOXES) $(ARGS)
else
	$(PY) -m detector.cli.launch --standalone --nproc_per_node=$(NPROC) -m detector train --experiment $(EXPERIMENT) $(DATA_BOXES) $(ARGS)
endif

# The model a run trained, as FaceDetector's state_dict: RUN=runs/train/<experiment>/<run> -> <run>/export/model.pt
RUN ?=
export: $(SETUP)
	$(PY) -m detector export $(RUN) $(ARGS)

# Its predicted boxes drawn on samples by index (ARGS="0 1 2") or image files (ARGS="--images a.png --faces 3")
predict: $(SETUP)
	$(PY) -m detector predict $(RUN) $(ARGS)

lint: $(SETUP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(SETUP)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

# One call on a GPU machine that already has torch (e.g. `make gpu-check PY=python3 [WHEELS=dir]`): builds the
# extension, then runs the whole suite, CUDA rows included, on the machine's cores (12 workers share one GPU well;
# tests/conftest.py gives each its share of the CPU threads); worksteal keeps the minute-long tests from queueing
# behind one worker. The benches' figures come from `make report`.
GPU_CHECK_WORKERS ?= 12
gpu-check:
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	$(PY) -m pytest -q -rs -n $(GPU_CHECK_WORKERS) --dist worksteal $(PYTEST_ARGS)

# Profile strategies (default: every registered one) in MODES, then compare (GPU: `make profile-all PY=python3`).
STRATEGIES ?=
MODES ?= train forward
profile-all: $(SETUP)
	for s in $(or $(STRATEGIES),$$($(PY) -m detector strategies --names)); do \
		for m in $(MODES); do $(PY) -m detector profile profile.strategy=$$s profile.mode=$$m $(ARGS) || exit 1; done; \
	done
	$(PY) -m detector compare

clean:
	rm -rf runs build *.egg-info detector/*.so
