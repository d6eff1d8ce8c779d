#!/bin/bash
# Start the MLX backend from the project's virtualenv: run.sh --addr HOST:PORT [--model REF]
set -e
DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "$DIR/venv/bin/python" "$DIR/backend.py" "$@"
