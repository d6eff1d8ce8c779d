# LocalAI MLX backend. `make` (or `make install`) installs, `make run` serves the
# embedded default model, `make test` runs the suite.
PYTHON ?= python3
VENV := venv
PY := $(VENV)/bin/python
ADDR ?= 127.0.0.1:50051
MODEL ?= default
SOAK_MINUTES ?= 3
# Which MLX build install.sh installs: cpu, mps, cublas12, cublas13, l4t12, l4t13, or
# LocalAI's cublas / l4t with CUDA_MAJOR_VERSION. Empty: install.sh picks mps on
# macOS, cublas12 where nvidia-smi is, else cpu.
BUILD_TYPE ?=

STUBS := backend_pb2.py backend_pb2_grpc.py
KERNELS := mlx_backend/cpu/kernels/build/.built
# What install.sh depends on; the tools, test and bench files have sentinels of their own.
INSTALL_INPUTS := install.sh backend.proto $(filter-out requirements-tools.txt \
  requirements-test.txt requirements-bench.txt,$(wildcard requirements*.txt))

.PHONY: install run test test-quick test-deps bench protogen clean soak e2e-localai

install: $(VENV)/.installed $(STUBS) $(KERNELS) $(VENV)/.tools-installed

# install.sh makes the venv, installs the requirements and the default model's
# package, generates the stubs and (Linux CPU) tries to apt-install OpenBLAS.
# Inside LocalAI it hands those to LocalAI's libbackend.sh.
$(VENV)/.installed: $(INSTALL_INPUTS)
	BUILD_TYPE="$(BUILD_TYPE)" PYTHON="$(PYTHON)" bash install.sh
	mkdir -p $(VENV) && touch $@

# grpcurl, for the README's commands right after `make run` (LocalAI's install.sh
# leaves it out: its images don't need it).
$(VENV)/.tools-installed: $(VENV)/.installed requirements-tools.txt
	$(PY) -m pip install --quiet -r requirements-tools.txt
	touch $@

$(VENV)/.test-installed: $(VENV)/.installed requirements-test.txt
	$(PY) -m pip install --quiet -r requirements-test.txt
	touch $@

# The CPU kernels (Linux CPU): install.sh builds them; rebuilt when their sources
# change (build.sh does nothing where MLX is not the mlx-cpu build).
$(KERNELS): $(wildcard mlx_backend/cpu/kernels/*.cpp mlx_backend/cpu/kernels/*.h) \
  mlx_backend/cpu/kernels/CMakeLists.txt mlx_backend/cpu/kernels/build.sh | $(VENV)/.installed
	bash mlx_backend/cpu/kernels/build.sh $(PY)
	mkdir -p $(dir $@) && touch $@

# The stubs are never committed: install.sh writes them; remade when missing or
# older than backend.proto.
protogen: $(STUBS)

$(STUBS): backend.proto | $(VENV)/.installed
	$(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. backend.proto

run: install
	./run.sh --addr $(ADDR) --model $(MODEL)

test-deps: install $(VENV)/.test-installed

# test.py runs the whole pytest suite (pyproject.toml) in xdist workers, on the fast BLAS
# the backend preloads; LocalAI's test.sh runs the same `python -m unittest test.py`.
# PYTEST_ADDOPTS="-m unit" (or -m engine, -m e2e, -k ...) narrows it.
test: test-deps
	$(PY) -m unittest test.py

# The quick loop for contributors: the unit layer and the engine layer's faster half.
test-quick: test-deps
	PYTEST_ADDOPTS='-m "unit or (engine and not slow)"' $(PY) -m unittest test.py

# LocalAI's backend e2e specs (tests/e2e-backends), as LocalAI runs them, against the run.sh
# and model its variables name: BACKEND_BINARY, BACKEND_TEST_MODEL_FILE, BACKEND_TEST_CAPS,
# BACKEND_TEST_OPTIONS (default: this run.sh and the embedded GGUF as model.bin).
e2e-localai: test-deps
	$(PY) -m pytest -v tests/e2e/test_localai_suite.py

# Mixed concurrent load against a real backend for SOAK_MINUTES: errors, latency, RSS.
soak: test-deps
	$(PY) -m bench.soak --minutes $(SOAK_MINUTES)

$(VENV)/.bench-installed: $(VENV)/.installed requirements-bench.txt
	$(PY) -m pip install --quiet -r requirements-bench.txt
	touch $@

# All thirteen parts; the tables are appended to bench/RESULTS.md.
bench: test-deps $(VENV)/.bench-installed
	$(PY) -m bench.bench

clean:
	rm -rf $(VENV) $(STUBS) __pycache__ .pytest_cache mlx_backend/cpu/kernels/build \
	  mlx_backend/cpu/kernels/build.log mlx_backend/cpu/kernels/_qmm*.so
