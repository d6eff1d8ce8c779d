"""Load-time measurements (CPU pacing, speculation's verify costs), taken once
per weights and settings and kept for a reload."""

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from mlx_backend.cpu.blas import blas_threads
from mlx_backend.decoders.base import thread_stream
from mlx_utils import model_signature

_measured: dict[tuple, object] = {}


def measured_once(model: nn.Module, key: tuple, measure: Callable[[], object]):
    """``measure()``, run on the engine thread's stream the first time ``model``'s
    weights load with this ``key`` and BLAS thread count, and kept for the next."""
    full = (model_signature(model, {}), blas_threads(), *key)
    if full not in _measured:
        with mx.stream(thread_stream()):
            _measured[full] = measure()
    return _measured[full]
