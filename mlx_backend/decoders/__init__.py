"""The generation paths, each a ``Decoder`` (``base.py``) the engine drives."""
