# recserve: `make serve` and `make test` set up everything on a fresh Debian machine.
PYTHON ?= python3
VENV ?= .venv
REPOSITORY ?= model_repository
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
BIN := $(VENV)/bin
APT_PACKAGES := libb64-0d redis-server gcc libc6-dev

.PHONY: install system-packages build serve test unit integration clean

# Debian packages: libb64 for perf_analyzer, redis-server (and redis-cli) for the L3 tier tests,
# gcc for the store's compiled probe loops (python_backends/store/_kernels.c, built by pip install).
system-packages:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

$(VENV)/.installed: pyproject.toml python_backends/store/_kernels.c
	$(MAKE) system-packages
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU build of torch first, so that nothing pulls the CUDA wheels
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/python -c "from recserve.server import prepare_runtime; print('tritonserver runtime in', prepare_runtime())"
	touch $@

install: $(VENV)/.installed

build: install
	$(BIN)/recserve build --if-missing --repository $(REPOSITORY)

serve: build
	$(BIN)/recserve serve --repository $(REPOSITORY) --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT)

test: build
	$(BIN)/pytest -ra tests/unit tests/integration

unit: install
	$(BIN)/pytest -ra tests/unit

integration: build
	$(BIN)/pytest -ra tests/integration

clean:
	rm -rf $(REPOSITORY)/*/[0-9]*/ .pytest_cache
