# Two commands on a fresh machine with Python 3.11 and pip:  `make lab`  and  `make test`.
# Both create .venv when it is missing and (re)install when pyproject.toml or constraints.txt
# changed; nothing else needs to be installed by hand.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# DeepSpeed without a GPU: CPU accelerator, and its ops JIT-build into this cache.
export DS_ACCELERATOR ?= cpu

.PHONY: install lab test unit notebooks lint course clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# constraints.txt pins the CPU build of torch here, so no multi-GB CUDA wheel is pulled.
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

lab: $(STAMP)  ## the course: JupyterLab on tutorials/
	$(BIN)/jupyter lab --ip 127.0.0.1 --notebook-dir tutorials

test: $(STAMP)  ## every test: unit + 2-rank tests, every notebook under nbmake, ruff
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest tests tutorials --nbmake --nbmake-timeout=600 -p no:cacheprovider

unit: $(STAMP)
	$(BIN)/python -m pytest tests -p no:cacheprovider

notebooks: $(STAMP)
	$(BIN)/python -m pytest tutorials --nbmake --nbmake-timeout=600 -p no:cacheprovider

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

course: $(STAMP)  ## run every notebook headless into build/, print seconds per notebook
	$(BIN)/python tools/run_course.py tutorials build

clean:
	rm -rf build .pytest_cache .ruff_cache
