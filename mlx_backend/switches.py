"""Boolean text in environment switches and options. Light on imports: backend.py
reads a switch before mlx-lm loads (its restart with a fast BLAS)."""

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def switched_off(environ, name: str) -> bool:
    """Whether environment switch ``name`` is set to false/0/no/off."""
    return environ.get(name, "").strip().lower() in _FALSE


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"expected a boolean, got {text!r}")
