"""How ``snapshot_interval`` was chosen: on part 10's hybrid (a random qwen3_5 of
the default model's size), a 3000-token prompt's prefill time and the prompt
cache's entries and bytes after it, then the reuse and time to first token of the
same prompt edited at token 2000 (as an agent rewrites an earlier message), for
each interval. In-process, one engine per interval, with the fast BLAS:

    venv/bin/python -m bench.snapshot_interval [INTERVAL ...]
"""

import argparse
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

from mlx_lm.tokenizer_utils import load as load_tokenizer

from bench.model_families import make_hybrid_folder, varied_text
from mlx_backend.cpu.preload import maybe_reexec_with_preloads
from mlx_backend.engine.engine import Engine
from mlx_backend.models.loading import LoadPlan
from mlx_backend.request_parsing import GenerationRequest
from python_utils import parse_options
from tests.engine_helpers import run, stats_after

logger = logging.getLogger(__name__)

PROMPT_TOKENS = 3000
EDIT_AT = 2000


def measure(folder: Path, prompt: list[int], edited: list[int], interval: int) -> str:
    engine = Engine()
    options = [f"snapshot_interval:{interval}", "speculative:off"]
    # Room for every snapshot of one prompt, so the bytes are the interval's own.
    options.append("max_cache_entries:64")
    plan = LoadPlan(
        identity="hybrid", model=str(folder), options=parse_options(options)
    )
    engine.load(plan).result()
    try:

        def ask(tokens: list[int]) -> float:
            request = GenerationRequest(tuple(tokens), 1, load_id=engine.info.load_id)
            start = time.perf_counter()
            run(engine, request)
            return time.perf_counter() - start

        ask(prompt[:64])  # warm up
        engine.call(engine.served.store.cache.clear).result()
        prefill = ask(prompt)
        before = stats_after(engine)
        edit = ask(edited)
        after = stats_after(engine)
    finally:
        engine.shutdown()
    reused = after["prompt_cache_reused_tokens"] - before["prompt_cache_reused_tokens"]
    return (
        f"| {interval} | {prefill:.2f} | {before['prompt_cache_entries']} "
        f"| {before['prompt_cache_bytes'] / 1e6:.1f} | {reused} | {edit:.2f} |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("intervals", nargs="*", type=int, default=[0, 512, 1024, 2048])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as folder:
        model = make_hybrid_folder(Path(folder) / "hybrid")
        tokenizer = load_tokenizer(model)
        text = varied_text(random.Random(1), tokenizer, PROMPT_TOKENS + 200)
        prompt = tokenizer.encode(text)[:PROMPT_TOKENS]
        other = varied_text(random.Random(2), tokenizer, PROMPT_TOKENS)
        edited = prompt[:EDIT_AT] + tokenizer.encode(other)[: PROMPT_TOKENS - EDIT_AT]
        lines = [
            f"{PROMPT_TOKENS}-token prompt, then the same edited at token {EDIT_AT}",
            "",
            "| interval | prefill s | entries | MB | edit: reused | edit: TTFT s |",
            "|---|---|---|---|---|---|",
        ]
        lines += [measure(model, prompt, edited, n) for n in args.intervals]
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    maybe_reexec_with_preloads()
    main()
