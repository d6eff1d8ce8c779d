"""Refusals that describe a file and never quote it.

LocalAI shows load errors to API users, and a request can name any path the backend
can read, so an error about a file says what kind of file it is, how big, and what
was wrong in general terms: never any of its bytes. Library exceptions (json,
tokenizers, jinja, safetensors, mx.load) often quote their input, so their text
stays in the server log and the reply gets ``describe_error``'s summary.
"""

import json
import stat
from pathlib import Path

from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    HFValidationError,
    OfflineModeIsEnabled,
)

from mlx_backend.errors import BackendError

# How much of a file that reports no size (/proc's) is read to count its bytes.
COUNT_LIMIT = 1 << 20
# The Hub's errors whose text a reply may show (its dataclass validation errors,
# say, quote a local config and are not among them).
_HUB_ERRORS = (
    HfHubHTTPError,
    EntryNotFoundError,
    HFValidationError,
    OfflineModeIsEnabled,
)


class Described(Exception):
    """An error whose message the backend wrote from what it checked, never from a
    file's bytes: safe to show to a client as it is."""


def describe_path(path: Path) -> str:
    """What ``path`` is, for an error: its kind and size, never its content."""
    try:
        info = path.stat()
    except OSError as e:
        return _os_error(e)
    except ValueError:  # a NUL byte in the path
        return "not a valid path"
    mode = info.st_mode
    if stat.S_ISDIR(mode):
        return "a folder"
    if not stat.S_ISREG(mode):
        # Never opened: reading a FIFO or a device can block or never end.
        for test, kind in (
            (stat.S_ISCHR, "a character device"),
            (stat.S_ISBLK, "a block device"),
            (stat.S_ISFIFO, "a named pipe"),
            (stat.S_ISSOCK, "a socket"),
        ):
            if test(mode):
                return kind
        return "not a regular file"
    if info.st_size:
        return f"a file of {info.st_size} bytes"
    # /proc's files report 0 bytes: count what a read gives instead.
    try:
        with open(path, "rb") as file:
            count = len(file.read(COUNT_LIMIT + 1))
    except OSError as e:
        return f"a file that reports 0 bytes and can't be read ({_os_error(e)})"
    if count == 0:
        return "an empty file"
    if count > COUNT_LIMIT:
        return f"a file that reports 0 bytes but reads over {COUNT_LIMIT} bytes"
    return f"a file that reports 0 bytes but reads {count} bytes"


def _os_error(e: OSError) -> str:
    # strerror and the file name come from the OS and the request, not the file.
    if e.strerror:
        return f"{e.strerror.lower()}" + (f": {e.filename}" if e.filename else "")
    return type(e).__name__


def describe_error(e: BaseException) -> str:
    """A message for ``e`` that quotes no file: a ``Described`` error's own,
    otherwise what kind of failure it was (its text may quote what it read)."""
    if isinstance(e, (Described, BackendError)):
        return str(e)
    if isinstance(e, json.JSONDecodeError):
        return f"not valid JSON (at line {e.lineno}, column {e.colno})"
    if isinstance(e, UnicodeDecodeError):
        return f"not {e.encoding.upper()} text"
    if isinstance(e, OSError) and e.strerror:
        return _os_error(e)
    if isinstance(e, MemoryError):
        return "out of memory"
    if isinstance(e, _HUB_ERRORS):
        # About the network and the repo id the request named, not a local file.
        first = str(e).strip().splitlines()
        return f"{type(e).__name__}: {first[0]}" if first else type(e).__name__
    return f"{type(e).__name__}, details in the server log"


def is_described(e: BaseException) -> bool:
    """Whether ``describe_error`` shows ``e``'s own message."""
    return isinstance(e, (Described, BackendError))


def read_json(path: Path, limit: int | None = None) -> object:
    """``path``'s JSON; a ``Described`` error naming the file, not quoting it.

    Args:
        path: the file.
        limit: the most bytes to read; a longer file is refused unparsed.
    """
    if path.exists() and not path.is_file():
        # A FIFO or a device is never opened: the read could block.
        raise Described(f"{path.name} is {describe_path(path)}, not a file")
    try:
        with open(path, "rb") as file:
            data = file.read() if limit is None else file.read(limit + 1)
    except OSError as e:
        raise Described(f"{path.name} can't be read ({_os_error(e)})") from None
    if limit is not None and len(data) > limit:
        raise Described(f"{path.name} is over {limit} bytes") from None
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Described(f"{path.name} is {describe_error(e)}") from None
    except RecursionError:
        raise Described(f"{path.name} nests JSON too deeply") from None
