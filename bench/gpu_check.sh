#!/bin/bash
# One run on a lent GPU machine (the device tool: one CUDA GPU, no package index,
# 64 MiB carried a call): install from a wheelhouse carried in parts, then the suite
# with a per-test timeout, bench parts 1 and 4, and a soak, all into $OUT.
#
# Here:   make wheelhouse BUILD_TYPE=cublas13 PYTHON_VERSION=3.12 WHEELHOUSE=.dev/wheels \
#           WHEELHOUSE_SKIP='nvidia-*'      # the image has the CUDA 13 libraries
#         bash bench/gpu_check.sh pack .dev/wheels   # .dev/p1 ... .dev/pN, 60 MB each
#         (.dev/ in .git/info/exclude)
# Device: for each part but the last, at once one after another (a machine stays warm
#         30 s): run "bash bench/gpu_check.sh keep" carrying [".dev/pK"]; then
#         run "END=570 bash bench/gpu_check.sh run" carrying [".dev/pN"], timeout_s 600.
#
# The image's python3 (a venv with PyTorch's CUDA libraries) makes a venv that sees its
# packages; the wheels go in without their dependencies, MLX finds the CUDA libraries
# through site-packages/nvidia. END: the seconds the run may take in all.
set -uo pipefail
PARTS=/root/parts

pack() {
    local folder=$1
    rm -rf .dev/p[0-9]*
    tar cf - -C "$folder" . | split -b 60000000 -d -a 1 - .dev/part.
    local n=0
    for part in .dev/part.*; do
        n=$((n + 1))
        mkdir -p ".dev/p$n" && mv "$part" ".dev/p$n/"
    done
    echo "gpu_check: $n parts in .dev/p1 ... .dev/p$n"
}

keep() {
    mkdir -p $PARTS && mv .dev/p*/part.* $PARTS/ && ls -la $PARTS
}

run() {
    T0=$(date +%s)
    END=${END:-570}
    left() { echo $((END - ($(date +%s) - T0))); }
    cap() { local l=$(($(left) - $2)); if [ "$l" -lt "$1" ]; then echo "$l"; else echo "$1"; fi; }
    log() { echo "== $(date +%T) +$(($(date +%s) - T0))s $*" | tee -a "$OUT/steps.log"; }
    export PYTHONUNBUFFERED=1
    local root wheels site image
    root=$(pwd)
    keep >>"$OUT/steps.log" 2>&1
    nvidia-smi -L >>"$OUT/steps.log" 2>&1
    wheels=/root/wheels
    mkdir -p $wheels
    cat $PARTS/part.* | tar xf - -C $wheels || { log "the parts are incomplete"; return 3; }
    python3 -m venv --without-pip --system-site-packages venv || { log "no venv"; return 4; }
    site=$(venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    image=$(python3 -c 'import site; print(site.getsitepackages()[0])')
    python3 -c 'import site; print("\n".join(site.getsitepackages()))' >"$site/zz_image.pth"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" $wheels/*.whl 2>&1 | tail -3
    # Scripts (mlx.launch) run with this venv's Python, and MLX's library finds the
    # CUDA libraries beside it.
    sed -i "1s|^#!.*python.*|#!$root/venv/bin/python|" "$site"/bin/* 2>/dev/null
    ln -sf "$site"/bin/* venv/bin/ 2>/dev/null
    [ -e "$site/nvidia" ] || ln -s "$image/nvidia" "$site/nvidia"
    venv/bin/python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. backend.proto
    export PATH=$root/venv/bin:$PATH
    log "installed"
    venv/bin/python -c 'import mlx.core as mx; print(mx.__version__, mx.default_device(), mx.device_info())' \
        2>&1 | tee -a "$OUT/steps.log"
    log "suite"
    timeout -k 20 -s INT "$(cap 300 250)" venv/bin/python -m pytest -p no:cacheprovider -n 12 \
        --timeout 240 -q -rfE --tb=short --durations=30 --junitxml="$OUT/junit.xml" \
        >"$OUT/suite.log" 2>&1
    log "suite rc $?"
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/suite.log" | tail -80
    log "bench 1,4"
    timeout -k 15 -s INT "$(cap 170 90)" venv/bin/python -m bench.bench --parts 1,4 --rounds 3 \
        --batch-rounds 1 --no-results --out "$OUT/bench.json" >"$OUT/bench.log" 2>&1
    log "bench rc $?"
    grep -v "^INFO" "$OUT/bench.log" | tail -45
    log "soak"
    timeout -k 10 "$(cap 100 0)" venv/bin/python -m bench.soak --minutes 1.0 >"$OUT/soak.log" 2>&1
    log "soak rc $?"
    tail -25 "$OUT/soak.log"
}

case "${1:-}" in
    pack) pack "$2" ;;
    keep) keep ;;
    run) run ;;
    *) echo "usage: gpu_check.sh pack WHEELHOUSE | keep | run" >&2; exit 2 ;;
esac
