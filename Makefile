# Two entry points: `make demo` and `make test`. Each creates/refreshes .venv itself.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.harts-installed
TORCH_VERSION ?= 2.13.0
EXTRAS ?= dev,bench,verl,rollout

.PHONY: venv test demo lint format bench clean

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# CPU torch first, so no dependency can pull a CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	@touch $(STAMP)

venv: $(STAMP)

lint: venv
	$(VENV)/bin/ruff format --check harts_verl tests benchmarks
	$(VENV)/bin/ruff check harts_verl tests benchmarks
	$(VENV)/bin/lint-imports

format: venv
	$(VENV)/bin/ruff format harts_verl tests benchmarks
	$(VENV)/bin/ruff check --fix harts_verl tests benchmarks

test: venv lint
	@# pytest exit code 5 = no tests collected: that is a failure for us, say so.
	$(PY) -m pytest tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

# Local CPU recipe: 1 stock-path baseline step, then 3 online HARTS steps (reward, compression,
# update time per step). The old tree-vs-expanded benchmark demo: `$(VENV)/bin/harts-verl demo`.
demo: venv
	PY=$(abspath $(PY)) bash recipes/local_cpu/demo.sh 3

bench: venv
	$(VENV)/bin/harts-verl bench

clean:
	rm -rf $(VENV) build *.egg-info
