#!/bin/bash
# Run the test suite: `python -m unittest test.py`, which runs pytest (see test.py;
# PYTEST_ADDOPTS="-m unit" picks a layer). Exits with the tests' status.
#
# Inside LocalAI (backend/python/mlx, with ../common/libbackend.sh): the venv that
# install.sh made, the tools and test requirements, then LocalAI's runUnittests.
# Standalone: `make test-deps` (install.sh and the requirements, when out of date)
# first.
set -euo pipefail

backend_dir="$(cd "$(dirname "$0")" && pwd)"

# WHEELHOUSE=folder (`make wheelhouse`): pip installs from that folder alone.
if [ -n "${WHEELHOUSE:-}" ]; then
    export PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1
    PIP_FIND_LINKS="$(cd "$WHEELHOUSE" && pwd)"
    export PIP_FIND_LINKS
fi

# LocalAI's library: beside this script (common/) or one level up (../common/).
libbackend=$(ls "$backend_dir"/{,../}common/libbackend.sh 2>/dev/null | head -n 1 || true)
if [ -n "$libbackend" ]; then
    USE_PIP=true
    source "$libbackend"
    ensureVenv
    python -m pip install --requirement "$backend_dir/requirements-tools.txt" \
        --requirement "$backend_dir/requirements-test.txt"
    runUnittests
    exit 0  # runUnittests fails the script (set -e) when a test fails
fi

cd "$backend_dir"
if command -v make >/dev/null 2>&1; then
    make --no-print-directory test-deps
else
    [ -x venv/bin/python ] || bash install.sh
    venv/bin/python -m pip install --quiet -r requirements-tools.txt \
        -r requirements-test.txt
fi
exec venv/bin/python -m unittest test.py
