"""Files that hold a marker, and the check that an error never quotes a file: the
marker, and any run of 8 bytes of the file, stay out of the message."""

import random
import string
from pathlib import Path

MARKER = "SECRET-MARKER-7f3a"
RUN = 8


def secret_text(seed: int = 0, lines: int = 40) -> str:
    """Lines of random words with the marker among them, as a secret file could be."""
    rng = random.Random(seed)
    words = ["".join(rng.choices(string.ascii_letters, k=9)) for _ in range(200)]
    rows = [" ".join(rng.choices(words, k=8)) for _ in range(lines)]
    rows.insert(lines // 2, f"token={MARKER}")
    return "\n".join([MARKER, *rows, MARKER]) + "\n"


def write_secret(path: Path, seed: int = 0) -> Path:
    path.write_text(secret_text(seed))
    return path


def quoted_runs(message: str, content: bytes, allowed: tuple[str, ...] = ()) -> set:
    """The runs of ``RUN`` bytes of ``content`` that ``message`` holds, less those
    that ``allowed`` (the paths the request named, say) accounts for."""
    said = message.encode()
    known = [a.encode() for a in allowed]
    runs = set()
    for i in range(len(said) - RUN + 1):
        run = said[i : i + RUN]
        if run in content and not any(run in k for k in known):
            runs.add(run)
    return runs


def assert_not_quoted(message: str, content: bytes, allowed: tuple[str, ...] = ()):
    assert MARKER not in message, message
    runs = quoted_runs(message, content, allowed)
    assert not runs, f"{message!r} quotes {sorted(runs)[:5]}"
