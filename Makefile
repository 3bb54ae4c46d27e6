# recserve: `make serve` and `make test` set up everything on a fresh Debian machine.
PYTHON ?= python3
VENV ?= .venv
# SPEC=avazu (or a path to a spec .toml) builds and serves another model, in its own repository
SPEC ?= ctr
REPOSITORY ?= model_repository$(if $(filter-out ctr,$(SPEC)),_$(basename $(notdir $(SPEC))))
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
BIN := $(VENV)/bin
APT_PACKAGES := libb64-0d redis-server gcc libc6-dev

.PHONY: install system-packages build serve access canary test lint typecheck unit integration clean gpu-check

# Debian packages: libb64 for perf_analyzer, redis-server (and redis-cli) for the L3 tier tests,
# gcc for the compiled loops (python_backends/store/_kernels.c, features/_hex.c and _keys.c,
# request_log/_histories.c; built by pip install).
system-packages:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

$(VENV)/.installed: pyproject.toml python_backends/store/_kernels.c python_backends/features/_hex.c python_backends/features/_keys.c python_backends/request_log/_histories.c
	$(MAKE) system-packages
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU build of torch first, so that nothing pulls the CUDA wheels
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[test,lint]"
	$(BIN)/python -c "from recserve.server import prepare_runtime; print('tritonserver runtime in', prepare_runtime())"
	touch $@

install: $(VENV)/.installed

build: install
	$(BIN)/recserve --spec $(SPEC) build --if-missing --repository $(REPOSITORY)

serve: build
	$(BIN)/recserve --spec $(SPEC) serve --repository $(REPOSITORY) --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT)

# Envoy in front of tritonservers (docs/access.md): the public ports and the split come from the
# spec's [access]; CANARY=<repository> adds the canary variant (the new version to roll out).
access: build
	$(BIN)/recserve --spec $(SPEC) access --repository $(REPOSITORY) $(if $(CANARY),--canary $(CANARY)) $(if $(WORKDIR),--workdir $(WORKDIR))

# Roll the canary variant out through `make access CANARY=... WORKDIR=...` running beside it.
canary: install
	$(BIN)/recserve --spec $(SPEC) canary --workdir $(WORKDIR)

test: lint
	$(MAKE) build SPEC=ctr
	$(BIN)/pytest -ra tests/unit tests/integration

# ruff (rules and format) and mypy; the tree is kept clean of both.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(MAKE) typecheck

# mypy sees the folders as the installed package through a tree of links (python_backends/ is
# recserve.backends, build/ recserve.build, ...), made afresh for each run in a folder of its own
# (so two runs side by side do not remove each other's links).
typecheck: install
	@tree=$$(mktemp -d .typecheck/run-XXXXXX 2>/dev/null || { mkdir -p .typecheck && mktemp -d .typecheck/run-XXXXXX; }) && \
	mkdir -p $$tree/recserve && \
	for f in recserve/*.py recserve/commands recserve/core recserve/server recserve/access recserve/loop; do ln -s $(CURDIR)/$$f $$tree/recserve/; done && \
	ln -s $(CURDIR)/python_backends $$tree/recserve/backends && \
	for d in build clients perf; do ln -s $(CURDIR)/$$d $$tree/recserve/$$d; done && \
	cd $$tree && $(CURDIR)/$(BIN)/mypy --config-file $(CURDIR)/pyproject.toml --cache-dir $(CURDIR)/.mypy_cache -p recserve; \
	status=$$?; rm -rf $(CURDIR)/$$tree; exit $$status

unit: install
	$(BIN)/pytest -ra tests/unit

integration: build
	$(BIN)/pytest -ra tests/integration

# The GPU check (docs/gpu-check.md): builds the offline kit .gpu-kit/ for the lent GPU machine and
# prints the calls to make there; DRY_RUN=1 also checks the kit and walks the steps without a GPU.
gpu-check: install
	$(BIN)/python -m recserve.perf.gpu_check $(if $(DRY_RUN),dry-run,prepare)

clean:
	rm -rf $(REPOSITORY)/*/[0-9]*/ .pytest_cache .mypy_cache .typecheck
