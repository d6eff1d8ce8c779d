"""What the in-process decoder benches share (``bench.kv_pages``,
``bench.step_anatomy``, ``bench.family_pages``, ``bench.speculating_rows``): the
command line, an engine on the embedded model with the fast BLAS preloaded as
the server has it, a decoder of either kind, a step's time and a prompt's."""

import argparse
import time

from mlx_backend.cpu.preload import maybe_reexec_with_preloads
from mlx_backend.decoders.base import Decoder
from mlx_backend.decoders.batch import BatchDecoder
from mlx_backend.decoders.paged import PagedDecoder, paged_layers
from tests.engine_helpers import load_engine, new_sequence, on_engine_thread


def run_rounds(doc: str, measure):
    """``measure(model, options, rounds)`` on the engine thread, ``--rounds``
    from the command line (``doc``'s first line describes it)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    maybe_reexec_with_preloads()
    engine = load_engine()
    try:
        return on_engine_thread(
            engine, lambda model, options: measure(model, options, args.rounds)
        )
    finally:
        engine.shutdown()


def make_decoder(paged: bool, model, options) -> Decoder:
    """The paged decoder, or the batch decoder unpaced, without a step budget."""
    if paged:
        return PagedDecoder(model, options, paged_layers(model, options))
    return BatchDecoder(model, options, True)


def step_seconds(decoder, model, options, prompts, steps: int = 60) -> float:
    """A decoder's step, once ``prompts`` all decode: the mean wall time of
    ``steps`` steps (steps overlap the host, so the device's pace)."""
    for prompt in prompts:
        decoder.add(new_sequence(model, options, prompt, 10_000))
    while sum(1 for r in decoder.step() if r.tokens) < len(prompts):
        pass
    for _ in range(5):
        decoder.step()
    start = time.perf_counter()
    for _ in range(steps):
        decoder.step()
    return (time.perf_counter() - start) / steps


def first_token_seconds(decoder, model, options, prompt) -> float:
    """A prompt's time to its first token on ``decoder`` as it is (nothing else
    on it: the prompt's time alone); the sequence leaves it after."""
    return first_token(decoder, model, options, prompt)[0]


def first_token(decoder, model, options, prompt) -> tuple[float, int]:
    """``first_token_seconds``, and the KV bytes its sequence holds then (it
    asks a second token: a finished sequence leaves the batch decoder's batch)."""
    key = decoder.add(new_sequence(model, options, prompt, 2))
    start = time.perf_counter()
    while not any(r.key == key and r.tokens for r in decoder.step()):
        pass
    seconds = time.perf_counter() - start
    held = decoder.kv_nbytes()
    decoder.remove(key, keep_state=False)
    return seconds, held
