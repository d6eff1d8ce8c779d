"""The fixed costs of the suite, for docs/testing.md: a backend process's start
(with and without the BLAS restart), its first and later loads of the default model,
an in-process engine's loads, the tiny-model folders, the chat folders and their
tokenizers, and make's check that the kernels are built. Run it on an idle machine
the way make test runs pytest:

    env $(venv/bin/python -m mlx_backend.cpu.preload) venv/bin/python -m tests.costs
"""

import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from mlx_lm.tokenizer_utils import load as load_tokenizer

import backend_pb2 as pb
from mlx_backend.cpu.pacing import CPU_PACING_ENV
from tests.chat_models import make_chat_folders
from tests.engine_helpers import load_engine
from tests.family_models import FAMILIES, make_family_folder
from tests.support import ROOT, Server
from tests.tiny_models import make_tiny_draft


def seconds(fn: Callable) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main() -> None:
    # As conftest.py pins it for the suite.
    os.environ.setdefault(CPU_PACING_ENV, "off")
    rows: list[tuple[str, float]] = []
    for fresh in (True, False):
        took, server = seconds(lambda: Server(fresh_blas=fresh))
        rows.append((f"backend start, fresh_blas={fresh}", took))
        first, _ = seconds(
            lambda: server.stub.LoadModel(pb.ModelOptions(Model="default"))
        )
        later, _ = seconds(
            lambda: server.stub.LoadModel(pb.ModelOptions(Model="default"))
        )
        server.stop()
        rows.append(("  its first LoadModel of the default model", first))
        rows.append(("  a later LoadModel of the default model", later))
    for name in ("first", "later"):
        took, engine = seconds(load_engine)
        engine.shutdown()
        rows.append((f"in-process engine load, default model ({name})", took))
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        tiny = make_family_folder(root / "llama", "llama")
        took, engine = seconds(lambda: load_engine(model=str(tiny)))
        engine.shutdown()
        rows.append(("in-process engine load, tiny llama (conftest's)", took))
        for name in FAMILIES:
            took, _ = seconds(lambda: make_family_folder(root / name, name))
            rows.append((f"family folder {name}", took))
        took, folders = seconds(lambda: make_chat_folders(root / "chat"))
        took_tiny, _ = seconds(lambda: make_tiny_draft(root / "plain", layers=2))
        rows.append(
            ("a random tiny llama's folder (the chat folders' base)", took_tiny)
        )
        rows.append((f"chat folders ({len(folders)})", took))
        took, _ = seconds(lambda: [load_tokenizer(f) for f in folders.values()])
        rows.append(("their tokenizers, each", took / len(folders)))
    took, _ = seconds(
        lambda: subprocess.run(
            ["make", "-q", "mlx_backend/cpu/kernels/build/.built"], cwd=ROOT
        )
    )
    rows.append(("make's check that the kernels are built", took))
    for what, took in rows:
        print(f"| {what} | {took:.2f} s |")


if __name__ == "__main__":
    main()
