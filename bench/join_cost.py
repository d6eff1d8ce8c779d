"""The cost of a join, in-process (issue 68): the step in which a sequence joins
15 others decoding 2,000 tokens deep, against the plain steps around it, on the
paged decoder and on the batch decoder.

    venv/bin/python -m bench.join_cost [--rounds 3]

The 15 rows share one 2,000-token prompt, prefilled once and handed to each as a
prompt-cache hit (so neither decoder prefills 30,000 tokens); the sixteenth joins
the same way, its last prompt token left to run. Each decoder gets the hit in the
form its own kept states take in the prompt cache: the batch decoder's is mlx-lm's
caches, whose KV it merges into the batch's; the paged decoder's holds pages, whose
full pages it shares (copying the one it writes next). A step's time is the wall
time of ``Decoder.step`` (steps overlap the host, so it is the device's pace).
"""

import argparse
import random
import statistics
import time
from copy import deepcopy
from dataclasses import replace

import mlx.core as mx
from mlx_lm.models.cache import trim_prompt_cache

from mlx_backend.caches.kinds import cache_length
from mlx_backend.decoders.base import NewSequence
from mlx_backend.decoders.batch import BatchDecoder
from mlx_backend.decoders.paged import PagedDecoder, paged_layers
from mlx_utils import make_kv_cache
from tests.engine_helpers import load_engine, new_sequence, on_engine_thread

ROWS = 15
DEPTH = 2000
PLAIN_STEPS = 9


def cached(model, options, shared, cache, max_tokens=10_000) -> NewSequence:
    """A sequence whose prompt a copy of ``cache`` holds but for its last token,
    as the prompt cache hands it out."""
    kv_cache = deepcopy(cache)
    trim_prompt_cache(kv_cache, cache_length(kv_cache) - (len(shared) - 1))
    return replace(
        new_sequence(model, options, shared, max_tokens),
        kv_cache=kv_cache,
        rest=shared[-1:],
    )


def kept(decoder, model, options, shared, cache) -> list:
    """``shared``'s KV state as the decoder keeps it for the prompt cache."""
    key = decoder.add(cached(model, options, shared, cache, max_tokens=1))
    while not any(r.key == key and r.done for r in decoder.step()):
        pass
    return decoder.remove(key).cache


def join_ratio(decoder, model, options, shared, cache) -> tuple[float, float]:
    """(the join step's seconds, the plain steps' median)."""
    for _ in range(ROWS):
        decoder.add(cached(model, options, shared, cache))
    while True:
        results = decoder.step()
        if sum(1 for r in results if r.tokens) == ROWS:
            break
    for _ in range(3):
        decoder.step()

    def timed() -> float:
        tic = time.perf_counter()
        decoder.step()
        return time.perf_counter() - tic

    plain = [timed() for _ in range(PLAIN_STEPS)]
    decoder.add(cached(model, options, shared, cache))
    joined = [timed() for _ in range(3)]
    plain += [timed() for _ in range(PLAIN_STEPS)]
    return max(joined), statistics.median(plain)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    engine = load_engine()

    def measure(model, options):
        rng = random.Random(39)
        shared = tuple(rng.randrange(100, 40000) for _ in range(DEPTH))
        cache = make_kv_cache(model, options)
        for i in range(0, DEPTH - 1, 256):
            model(mx.array([shared[i : min(i + 256, DEPTH - 1)]]), cache=cache)
            mx.eval([c.state for c in cache])
        out = {"paged": [], "batch": []}
        for round_ in range(args.rounds):
            for name in ("paged", "batch") if round_ % 2 == 0 else ("batch", "paged"):
                if name == "paged":
                    decoder = PagedDecoder(model, options, paged_layers(model, options))
                    hit = kept(decoder, model, options, shared, cache)
                else:
                    decoder = BatchDecoder(model, options, True)
                    hit = cache
                out[name].append(join_ratio(decoder, model, options, shared, hit))
                del hit
                decoder.close()
        return out

    out = on_engine_thread(engine, measure)
    engine.shutdown()
    for name, runs in out.items():
        cells = ", ".join(
            f"{j * 1e3:.0f}/{p * 1e3:.0f} ms = {j / p:.2f}x" for j, p in runs
        )
        print(
            f"{name}: join step / plain step, per round: {cells}; worst {max(j / p for j, p in runs):.2f}x"
        )


if __name__ == "__main__":
    main()
