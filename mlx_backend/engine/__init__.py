"""The engine thread: its loop, scheduler, prompt store, loader, stats and jobs,
behind the facade in ``engine.py``."""
