# LocalAI MLX backend. `make` (or `make install`) installs, `make run` serves the
# embedded default model, `make test` runs the suite. `make wheelhouse` collects the
# wheels for an install with no network (WHEELHOUSE=folder make install).
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
# WHEELHOUSE=folder: every pip install takes that folder alone (no index, no pip.conf,
# whose index or find-links would hide a wheel the folder lacks). Also where `make
# wheelhouse` writes (default: wheelhouse/).
WHEELHOUSE ?=
# Distributions (comma-separated names or patterns) the wheelhouse leaves to the
# target's own Python; install.sh then makes the venv with --system-site-packages.
WHEELHOUSE_SKIP ?=
# The target's Python for `make wheelhouse`: $(PYTHON)'s version unless set.
PYTHON_VERSION ?= $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
PIP_ENV := $(if $(WHEELHOUSE),PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 \
  PIP_FIND_LINKS="$(abspath $(WHEELHOUSE))")

STUBS := backend_pb2.py backend_pb2_grpc.py
KERNELS := mlx_backend/cpu/kernels/build/.built
# What install.sh depends on; the tools, test and bench files have sentinels of their own.
INSTALL_INPUTS := install.sh backend.proto $(filter-out requirements-tools.txt \
  requirements-test.txt requirements-bench.txt,$(wildcard requirements*.txt))

.PHONY: install run test test-quick test-deps bench protogen clean soak e2e-localai wheelhouse

install: $(VENV)/.installed $(STUBS) $(KERNELS) $(VENV)/.tools-installed

# install.sh makes the venv, installs the requirements and the default model's
# package, generates the stubs and (Linux CPU) tries to apt-install OpenBLAS.
# Inside LocalAI it hands those to LocalAI's libbackend.sh.
$(VENV)/.installed: $(INSTALL_INPUTS)
	BUILD_TYPE="$(BUILD_TYPE)" PYTHON="$(PYTHON)" WHEELHOUSE="$(WHEELHOUSE)" \
	  WHEELHOUSE_SKIP="$(WHEELHOUSE_SKIP)" bash install.sh
	mkdir -p $(VENV) && touch $@

# grpcurl, for the README's commands right after `make run` (LocalAI's install.sh
# leaves it out: its images don't need it).
$(VENV)/.tools-installed: $(VENV)/.installed requirements-tools.txt
	$(PIP_ENV) $(PY) -m pip install --quiet -r requirements-tools.txt
	touch $@

$(VENV)/.test-installed: $(VENV)/.installed requirements-test.txt
	$(PIP_ENV) $(PY) -m pip install --quiet -r requirements-test.txt
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
	$(PIP_ENV) $(PY) -m pip install --quiet -r requirements-bench.txt
	touch $@

# All fifteen parts; the tables are appended to bench/RESULTS.md.
bench: test-deps $(VENV)/.bench-installed
	$(PY) -m bench.bench

# The wheels one build needs, for a machine that reaches no index: BUILD_TYPE's
# requirements (install.sh's mapping; resolved for PYTHON_VERSION and this machine's
# manylinux tags, so the target needs the same architecture and a glibc no older),
# the model's package, the tools and test requirements, and pip (install.sh upgrades
# it). The set is resolved first and then downloaded by name==version, so that
# WHEELHOUSE_SKIP's distributions never land in the folder. The resolver is the newest
# pip, in a venv of its own: an older one (23.2) checks Requires-Python against the
# Python it runs on, not PYTHON_VERSION (pypa/pip#12216). Markers such as python_version
# are still evaluated for that Python: for another version, PYTHON=python3.X is exact.
WHEELHOUSE_DIR = $(or $(WHEELHOUSE),wheelhouse)
WHEELHOUSE_PIP = $(WHEELHOUSE_DIR)/.resolve/venv/bin/python -m pip
WHEELHOUSE_BUILD = $(strip $(if $(filter cublas l4t,$(BUILD_TYPE)),$(BUILD_TYPE)$(or $(CUDA_MAJOR_VERSION),12),\
  $(or $(BUILD_TYPE),$(if $(filter Darwin,$(shell uname -s)),mps,\
  $(if $(shell command -v nvidia-smi),cublas12,cpu)))))
# This machine's platform tags, less plain linux_* (wheels built here, not portable).
WHEELHOUSE_PLATFORMS ?= $(shell $(PYTHON) -c 'from pip._vendor.packaging.tags import \
  platform_tags; print(" ".join(t for t in platform_tags() if not t.startswith("linux_")))')
WHEELHOUSE_TAGS = --python-version $(PYTHON_VERSION) $(addprefix --platform ,$(WHEELHOUSE_PLATFORMS))

# The resolved set as name==version lines, less WHEELHOUSE_SKIP's names (or patterns
# such as nvidia-*), then the lines of the files installed without their dependencies
# (the model's package; grpcurl's wrapper, an sdist with none, which pip builds on the
# target with setuptools from the folder). What is left out goes to skipped.txt, which
# install.sh reads.
define WHEELHOUSE_PINS_PY
import fnmatch, json, re, sys
folder, skip, files = sys.argv[1], sys.argv[2], sys.argv[3:]
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
name = lambda pin: norm(re.match(r"[A-Za-z0-9._-]+", pin).group())
skip = [norm(s.strip()) for s in skip.split(",") if s.strip()]
pins = ["%s==%s" % (i["metadata"]["name"], i["metadata"]["version"])
        for i in json.load(open(folder + "/.resolve/report.json"))["install"]]
pins += [line.split("#")[0].strip() for f in files for line in open(f)]
pins = [pin for pin in pins if pin]
left_out = [pin for pin in pins if any(fnmatch.fnmatch(name(pin), s) for s in skip)]
for s in skip:
    if not fnmatch.filter([name(pin) for pin in pins], s):
        print("wheelhouse: WHEELHOUSE_SKIP's %s is not in this build's set" % s, file=sys.stderr)
open(folder + "/.resolve/pins.txt", "w").write("".join(p + "\n" for p in pins if p not in left_out))
open(folder + "/skipped.txt", "w").write("".join(p + "\n" for p in left_out))
endef
# Exported to this recipe alone: in every recipe's environment (make test's too) its
# text would reach the processes under test.
wheelhouse: export WHEELHOUSE_PINS = $(WHEELHOUSE_PINS_PY)

wheelhouse:
	@test -f requirements-$(WHEELHOUSE_BUILD).txt || { echo "no requirements-$(WHEELHOUSE_BUILD).txt;" \
	  "BUILD_TYPE is one of: cpu, mps, cublas12, cublas13, l4t12, l4t13 (or cublas, l4t)" >&2; exit 1; }
	@echo "wheelhouse: MLX build $(WHEELHOUSE_BUILD), Python $(PYTHON_VERSION), into $(WHEELHOUSE_DIR)/"
	rm -rf $(WHEELHOUSE_DIR)/.resolve && $(PYTHON) -m venv $(WHEELHOUSE_DIR)/.resolve/venv
	$(WHEELHOUSE_PIP) install --quiet --upgrade pip
	$(WHEELHOUSE_PIP) install --quiet --dry-run --ignore-installed --only-binary=:all: \
	  $(WHEELHOUSE_TAGS) --target $(WHEELHOUSE_DIR)/.resolve/target \
	  --report $(WHEELHOUSE_DIR)/.resolve/report.json -r requirements.txt \
	  -r requirements-$(WHEELHOUSE_BUILD).txt -r requirements-test.txt pip setuptools wheel
	$(PYTHON) -c "$$WHEELHOUSE_PINS" $(WHEELHOUSE_DIR) "$(WHEELHOUSE_SKIP)" \
	  requirements-model.txt requirements-tools.txt
	$(WHEELHOUSE_PIP) download --quiet --no-deps $(WHEELHOUSE_TAGS) -d $(WHEELHOUSE_DIR) \
	  -r $(WHEELHOUSE_DIR)/.resolve/pins.txt
	rm -rf $(WHEELHOUSE_DIR)/.resolve
	@echo "wheelhouse: $$(ls $(WHEELHOUSE_DIR) | grep -c -v '^skipped.txt$$') files," \
	  "$$(du -sh $(WHEELHOUSE_DIR) | cut -f1)"

clean:
	rm -rf $(VENV) $(STUBS) __pycache__ .pytest_cache mlx_backend/cpu/kernels/build \
	  mlx_backend/cpu/kernels/build.log mlx_backend/cpu/kernels/_qmm*.so
