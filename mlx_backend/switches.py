"""Boolean text in environment switches and options. Light on imports: backend.py
reads a switch before mlx-lm loads (its restart with a fast BLAS)."""

from mlx_backend.errors import FailedPrecondition

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


def host_setting(
    option: str, option_name: str, environ, env_name: str, modes
) -> tuple[str, str]:
    """A load option's mode and what set it: the option unless it is ``auto``,
    else the host's ``env_name`` (one of ``modes``), else ``auto``."""
    if option != "auto":
        return option, f"{option_name}:{option}"
    host = environ.get(env_name, "").strip().lower() or "auto"
    if host not in modes:
        raise FailedPrecondition(
            f"{env_name} must be one of {', '.join(modes)}, not {host!r}"
        )
    return host, "auto" if host == "auto" else f"{env_name}={host}"
