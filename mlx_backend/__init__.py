"""LocalAI's MLX backend, behind the gRPC layer in ``backend.py``.

- ``engine``: the thread that owns every MLX object (loop, scheduler, prompt
  store, loader, stats, Score and Embedding jobs).
- ``decoders``: the generation paths behind one contract (batched, single,
  speculative).
- ``models``: loading models the way LocalAI names them (GGUF, MLX folders,
  LoRA adapters).
- ``caches``: quantized KV caches that batch, and KV states on disk.
- ``cpu``: the fast Linux CPU path (BLAS, dequantized weights, step pacing).
- ``distributed``: serving one model over an MLX distributed group.
- ``output``: a reply's tokens turned into text, reasoning and tool calls.
- ``request_parsing``, ``sampling``, ``grammar``, ``errors``: requests parsed
  once, their samplers and grammars, and the errors they can end with.

The root modules ``mlx_cache``, ``mlx_utils`` and ``python_utils`` keep the names
LocalAI's tooling gives them.
"""
