# Two entry points: `make demo` and `make test`. Each creates/refreshes .venv itself.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.harts-installed
TORCH_VERSION ?= 2.13.0
# Where torch comes from: empty = pip's own configuration (here a local CPU wheel); on a machine
# whose pip would take PyPI's CUDA build, TORCH_INDEX=https://download.pytorch.org/whl/cpu.
TORCH_INDEX ?=
TORCH_FROM := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
EXTRAS ?= dev,bench,verl,rollout

# fla's real Triton kernels on the CPU (Triton interpreter), in a venv of their own: fla must not
# be importable in .venv (transformers would route to its kernels). fla-core needs only einops.
FLA_VENV ?= .venv-fla
FLA_PY := $(FLA_VENV)/bin/python
FLA_STAMP := $(FLA_VENV)/.harts-installed
FLA_PINS ?= triton==3.6.0 fla-core==0.6.0

# transformers' own Kimi-Linear and Ling 3 (>= 5.23) are the oracles of their conversions, but veRL
# pins transformers < 5.11: it goes, without dependencies, into a folder that only the oracle's
# subprocess puts on PYTHONPATH (tests/_source_oracle.py).
ORACLE_DIR ?= .oracles/transformers
ORACLE_STAMP := $(ORACLE_DIR)/.harts-installed
ORACLE_PINS ?= transformers==5.24.0 tokenizers==0.23.3

.PHONY: venv oracles test test-fla-cpu demo lint format bench clean

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# The pinned torch first (CPU: see TORCH_INDEX), so no dependency pulls another build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_FROM) "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	@touch $(STAMP)

venv: $(STAMP)

$(ORACLE_STAMP): Makefile $(STAMP)
	rm -rf $(ORACLE_DIR)
	$(PY) -m pip install -q --no-deps --target $(ORACLE_DIR) $(ORACLE_PINS)
	@touch $(ORACLE_STAMP)

oracles: $(ORACLE_STAMP)

lint: venv
	$(VENV)/bin/ruff format --check harts_verl tests benchmarks
	$(VENV)/bin/ruff check harts_verl tests benchmarks
	$(VENV)/bin/lint-imports

format: venv
	$(VENV)/bin/ruff format harts_verl tests benchmarks
	$(VENV)/bin/ruff check --fix harts_verl tests benchmarks

$(FLA_STAMP): pyproject.toml Makefile
	@test -x $(FLA_PY) || $(PYTHON) -m venv $(FLA_VENV)
	$(FLA_PY) -m pip install -q --upgrade pip
	$(FLA_PY) -c "import torch" 2>/dev/null || $(FLA_PY) -m pip install -q $(TORCH_FROM) "torch==$(TORCH_VERSION)"
	$(FLA_PY) -m pip install -q --no-deps $(FLA_PINS)
	$(FLA_PY) -m pip install -q einops numpy omegaconf pytest hypothesis
	$(FLA_PY) -m pip install -q --no-deps -e .
	@touch $(FLA_STAMP)

# pytest exit code 5 = no tests collected: that is a failure for us, say so. The main suite's
# tiny shapes keep about one core busy; fla's interpreted kernels (one thread) run beside it,
# their output follows the main suite's, and either one failing fails the target. The main
# suite lists its 15 slowest tests (the suite's time is kept under ~15 minutes on 2 cores).
# Its torch ops use the cores fla's single thread leaves (TEST_THREADS, 1 on 2 cores): two
# threads beside a busy core made a bench test 28x slower (157 s instead of 5.6 s).
TEST_THREADS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n > 2 ? n - 1 : 1 )))
test: venv lint oracles $(FLA_STAMP)
	@log=$$(mktemp); \
	$(MAKE) --no-print-directory test-fla-cpu >"$$log" 2>&1 & fla=$$!; \
	OMP_NUM_THREADS=$(TEST_THREADS) \
	HARTS_ORACLE_TRANSFORMERS=$(abspath $(ORACLE_DIR)) HARTS_REQUIRE_ORACLES=1 \
	$(PY) -m pytest tests --ignore=tests/fla_cpu --durations=15; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; rc=1; fi; \
	wait $$fla; frc=$$?; \
	echo "== tests/fla_cpu (make test-fla-cpu, ran beside the main suite): exit $$frc"; \
	cat "$$log"; rm -f "$$log"; \
	if [ $$rc -ne 0 ]; then exit $$rc; fi; exit $$frc

test-fla-cpu: $(FLA_STAMP)
	OMP_NUM_THREADS=1 TRITON_INTERPRET=1 HARTS_REQUIRE_FLA=1 $(FLA_PY) -m pytest tests/fla_cpu; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

# Local CPU recipe: 1 stock-path baseline step, then 3 online HARTS steps (reward, compression,
# update time per step). The old tree-vs-expanded benchmark demo: `$(VENV)/bin/harts-verl demo`.
demo: venv
	PY=$(abspath $(PY)) bash recipes/local_cpu/demo.sh 3

bench: venv
	$(VENV)/bin/harts-verl bench

clean:
	rm -rf $(VENV) $(FLA_VENV) .oracles build *.egg-info
