# Two commands on a fresh machine with Python 3.11-3.13 and pip:  `make lab`  and  `make test`.
# Both create .venv when it is missing and (re)install when pyproject.toml or constraints.txt
# changed; nothing else needs to be installed by hand.

# The interpreter for .venv: 3.11 (tested: make test), else 3.12, 3.13, else python3 (README);
# choose one with `make PYTHON=python3.12 lab`.
PYTHON ?= $(shell command -v python3.11 || command -v python3.12 || command -v python3.13 \
                  || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST := $(BIN)/python -m pytest -p no:cacheprovider
# Executed copies of the notebooks: nbmake writes them, the docs site renders them (no
# second execution), and instructors can read them.
EXECUTED := build/notebooks
# Every run that executes notebooks starts from fresh copies of tutorials/.
FRESH_COPIES = rm -rf $(EXECUTED) && mkdir -p $(EXECUTED) && cp -r tutorials/. $(EXECUTED)/
# JupyterLab refuses to run as root (containers, CI boxes) unless told it is deliberate.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)
# DeepSpeed without a GPU uses its CPU accelerator.
export DS_ACCELERATOR ?= cpu
# DeepSpeed's C++ ops are built once into the course's environment, not into ~/.cache, which
# every environment of the user shares (each would rebuild over the others); importing gas_lab
# picks the same folder (gas_lab/runtime/build_lock.py), for what make does not start.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch_extensions

.PHONY: install ops lab test unit notebooks lint course docs bench costs gpu-check clean normalize

install: $(STAMP)

# DeepSpeed's C++ ops (the CPU comm op, fused Adam), built once for this environment before
# anything waits on them: one line per op with its seconds; an op built already only loads (about
# 5 s in all). It also makes every spelling of this environment's path (a symlinked .venv or
# home) reach the same build (gas_lab/runtime/ops.py says why).
ops: $(STAMP)  ## DeepSpeed's C++ ops, built once for this environment
	$(BIN)/python -m gas_lab.runtime.ops

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# constraints.txt pins torch 2.13.0; the course machines hold its CPU build, so no multi-GB
	# CUDA wheel is pulled (elsewhere, README: what a Linux laptop downloads).
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev,docs,hf]'
	touch $(STAMP)

# The course's JupyterLab settings: lab/overrides.json turns off the "official Jupyter news?"
# toast (and the update check) that would greet every learner; lab/page_config.json turns off
# ipyparallel's "IP" cluster panel (its clusters are not the course's ranks); with
# lab/jupyter_lab_config.py a notebook opens unmodified on any Python 3.11.x.
# JupyterLab serves the learner's own copy, my_tutorials/ (git-ignored): running the course saves
# outputs into the notebooks, and tutorials/ stays as pulled (tools/learner_copy.py says why).
lab: ops  ## the course: JupyterLab on your own copy of tutorials/ (my_tutorials/)
	$(BIN)/python tools/learner_copy.py tutorials my_tutorials
	$(BIN)/jupyter lab --ip 127.0.0.1 --notebook-dir my_tutorials \
	  --LabApp.app_settings_dir=$(CURDIR)/lab --config=$(CURDIR)/lab/jupyter_lab_config.py $(ROOT_FLAG)

# Test workers (pytest-xdist): the suite is mostly process start-up and waiting on other processes.
# Measured on 2026-12-07 (2 cores, `make bench` 11.5 ms per step, DeepSpeed's ops built first):
# 3 workers, pytest 731 s (a fresh clone's .ci/run; 26 CPU-minutes in 15.8 wall, 83% of 2 cores);
# 2 workers, pytest 769 s (warm; 21 CPU-minutes in 13.0 wall, 81%). Earlier: one worker kept 2
# cores 65% busy; two, 84%; three, 87-93%: the third fills the time the others wait. Each worker
# takes whole files (module fixtures start once) in the order tests/conftest.py sets: the slowest
# files, the notebooks, the docs site, the files that start ranks, the rest. With
# GAS_LAB_BUILD_SITE=1 the docs-site tests wait for the executed notebooks, then build the site
# (`make docs`) and open it, while the other workers run test files.
TEST_WORKERS ?= 3
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: lint ops  ## every test: unit + 2-rank, every notebook (nbmake), ruff, the docs site
	$(FRESH_COPIES)
	GAS_LAB_BUILD_SITE=1 $(PYTEST) $(XDIST) tests $(EXECUTED) --nbmake --nbmake-timeout=600 --overwrite --durations=12

# What each claim costs: every file of `make test` alone (the docs site last, on the executed
# notebooks), its wall seconds and the CPU-seconds the machine spent meanwhile; about 30 minutes
# on 2 cores. Run it idle, beside `make bench`, before deciding what the suite keeps.
costs: ops  ## each test file and notebook alone: wall and CPU seconds, most CPU first
	$(FRESH_COPIES)
	$(BIN)/python tools/file_costs.py --json build/costs.json $(filter-out tests/test_docs_site.py,$(wildcard tests/test_*.py)) $(patsubst tutorials/%,$(EXECUTED)/%,$(wildcard tutorials/*.ipynb)) tests/test_docs_site.py

unit: ops
	$(PYTEST) -m "not docs" tests

notebooks: ops  ## execute every notebook under nbmake, keeping the executed copies
	$(FRESH_COPIES)
	$(PYTEST) $(EXECUTED) --nbmake --nbmake-timeout=600 --overwrite

normalize: $(STAMP)  ## rewrite every notebook in the form JupyterLab saves (else it opens modified)
	$(BIN)/python tools/normalize_notebooks.py $(shell find tutorials -name '*.ipynb' -not -path '*/.ipynb_checkpoints/*')

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

course: ops  ## run every notebook headless into build/course, print seconds per notebook
	$(BIN)/python tools/run_course.py tutorials build/course

bench: ops  ## time gas_lab vs DeepSpeed vs torch DDP per optimizer step (2 ranks; noisy when shared)
	OMP_NUM_THREADS=1 $(BIN)/python -m torch.distributed.run --standalone --nproc_per_node=2 tools/bench_step_time.py

docs: $(STAMP)  ## the docs site in build/html, from the executed notebooks, warnings are errors
	test -f $(EXECUTED)/00_setup.ipynb || $(MAKE) --no-print-directory notebooks
	rm -rf build/html docs/lessons && mkdir -p docs/lessons && cp $(EXECUTED)/[0-9][0-9]_*.ipynb $(EXECUTED)/A[0-9]_*.ipynb docs/lessons/
	$(BIN)/sphinx-build -W --keep-going -q -j auto -b html docs build/html
	@echo "docs: open build/html/index.html"

gpu-check:  ## on a CUDA machine: scripts under torchrun/deepspeed, gpu tests, lessons 00/07 (nccl)
	bash tools/gpu_check.sh

clean:
	rm -rf build docs/lessons docs/_generated .pytest_cache .ruff_cache .venv-gpu
