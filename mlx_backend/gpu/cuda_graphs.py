"""The CUDA graph cache, sized for continuous batching and never fatal.

MLX's CUDA backend records each evaluation as CUDA graphs of at most ~100
operations, and keeps the executable graphs in an LRU cache keyed by topology
(``MLX_CUDA_GRAPH_CACHE_SIZE``, 400 by default). After twice the capacity in
lifetime misses it throws "Cache thrashing is happening" on every new graph, and
continuous batching makes new topologies all the time: each batch size, each
attention kernel the KV length picks, each prefill chunk's shape.
"""

import logging
from collections.abc import MutableMapping

import mlx.core as mx

logger = logging.getLogger(__name__)

CACHE_SIZE_ENV = "MLX_CUDA_GRAPH_CACHE_SIZE"
THRASHING_CHECK_ENV = "MLX_ENABLE_CACHE_THRASHING_CHECK"
# A decode step of a served model splits into a few graphs, and each batch size
# with each attention kernel gives them another topology.
GRAPHS_PER_BATCH_ROW = 32


def configure_graph_cache(
    environ: MutableMapping[str, str], max_batch_size: int
) -> dict[str, str]:
    """Size the graph cache for ``max_batch_size`` rows and turn MLX's thrashing
    error off (a miss then costs one graph instantiation), unless the user set
    either; before MLX's first evaluation on the GPU. Returns what it set."""
    if not mx.cuda.is_available():
        return {}
    chosen = {
        CACHE_SIZE_ENV: str(max(400, GRAPHS_PER_BATCH_ROW * max_batch_size)),
        THRASHING_CHECK_ENV: "0",
    }
    chosen = {name: value for name, value in chosen.items() if name not in environ}
    environ.update(chosen)
    logger.info(
        "CUDA graph cache: %s=%s, %s=%s%s",
        CACHE_SIZE_ENV,
        environ[CACHE_SIZE_ENV],
        THRASHING_CHECK_ENV,
        environ[THRASHING_CHECK_ENV],
        "" if len(chosen) == 2 else " (the user's where not chosen here)",
    )
    return chosen
