#!/bin/bash
# Build the CPU kernels' extension (_qmm) beside this script, for the Python given
# as $1 (a venv's). Only where MLX runs on the CPU (the mlx-cpu build); a failed
# build is reported and leaves the backend on its float32 path.
set -uo pipefail

kernels_dir="$(cd "$(dirname "$0")" && pwd)"
python="${1:-python3}"

if [ "$(uname -s)" != Linux ] || ! "$python" -m pip show --quiet mlx-cpu >/dev/null 2>&1; then
    exit 0
fi
bin_dir="$(dirname "$("$python" -c 'import sys; print(sys.executable)')")"
build_dir="$kernels_dir/build"
if PATH="$bin_dir:$PATH" cmake -S "$kernels_dir" -B "$build_dir" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$python" >"$build_dir.log" 2>&1 \
    && PATH="$bin_dir:$PATH" cmake --build "$build_dir" >>"$build_dir.log" 2>&1; then
    echo "CPU kernels built: $(ls "$kernels_dir"/_qmm*.so)"
else
    echo "warning: the CPU kernels did not build (log: $build_dir.log); quantized" \
        "models run dequantized to float32 instead" >&2
fi
exit 0
