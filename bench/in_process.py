"""What the in-process decoder benches share (``bench.kv_pages``,
``bench.step_anatomy``): the command line, an engine on the embedded model with
the fast BLAS preloaded as the server has it, and a decoder of either kind."""

import argparse

from mlx_backend.cpu.blas import maybe_reexec_with_fast_blas
from mlx_backend.decoders.base import Decoder
from mlx_backend.decoders.batch import BatchDecoder
from mlx_backend.decoders.paged import PagedDecoder, paged_layers
from tests.engine_helpers import load_engine, on_engine_thread


def run_rounds(doc: str, measure):
    """``measure(model, options, rounds)`` on the engine thread, ``--rounds``
    from the command line (``doc``'s first line describes it)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    maybe_reexec_with_fast_blas()
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
