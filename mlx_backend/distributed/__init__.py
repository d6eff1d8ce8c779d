"""Serving over an MLX distributed group: rank 0 serves gRPC and leads, the other
ranks follow it step by step.

Rank 0's engine runs as it does alone, with three wrappers (``leader``): around
its decoder, as its prompt cache and around its Score and Embedding queue. They
record what the workers must replay (admissions, removals, prompt-cache inserts,
steps, jobs) as ops, and the ``lockstep`` broadcasts them with an MLX collective
just before each piece of work that runs collectives. A worker (``follower``)
replays the ops in order on its own shard of the model (``sharding``), decoder,
prompt store and job queue, so every rank runs the same forward passes in the
same order, and a prompt-cache hit on rank 0 is a hit on every rank. ``group``
gathers the ranks before MLX connects them.
"""
