"""Tokenizers kept across loads. Building one costs 0.3-0.5 s of CPU for a 49k
vocabulary (transformers' from_pretrained, mlx-lm's wrapper and its token map),
as much as the rest of a small model's load; LocalAI loads the same model again
with other options, and a tiny model's load is mostly its tokenizer.
A load takes a copy of the kept wrapper: its own end-of-sequence set, which a
chat format adds to, and the rest shared."""

import copy
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from mlx_lm.tokenizer_utils import TokenizerWrapper

# The tokenizers kept (~15 MB each for a 49k vocabulary): a model and its draft,
# and a little more for a reload.
KEPT_TOKENIZERS = 4
# The files mlx-lm fetches for a tokenizer (mlx_lm.utils.load_tokenizer), by suffix
# or name; config.json among them picks the tokenizer's defaults.
_TOKENIZER_SUFFIXES = (".json", ".py", ".tiktoken", ".txt", ".jsonl", ".jinja")
_TOKENIZER_NAMES = ("tokenizer.model", "tiktoken.model")

_kept: OrderedDict[tuple, TokenizerWrapper] = OrderedDict()
# Engines load on their own threads (tests run several in one process).
_lock = threading.Lock()


def folder_key(folder: Path, *extra) -> tuple:
    """What a folder's tokenizer is built from: the contents of its tokenizer and
    config files, and ``extra`` (the arguments it is built with)."""
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if path.is_file() and (
            path.suffix in _TOKENIZER_SUFFIXES or path.name in _TOKENIZER_NAMES
        ):
            digest.update(path.name.encode() + b"\0")
            digest.update(path.read_bytes())
            digest.update(b"\0")
    return ("folder", digest.hexdigest(), *extra)


def file_key(path: Path) -> tuple:
    """A file by its identity (a GGUF is too large to hash at each load): the
    same inode, size and modification time."""
    stat = path.stat()
    return ("file", str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)


def reuse_tokenizer(
    key: tuple, build: Callable[[], TokenizerWrapper]
) -> TokenizerWrapper:
    """A tokenizer for ``key``: a copy of the one kept for it, else ``build()``'s
    (kept, and a copy returned)."""
    with _lock:
        kept = _kept.get(key)
        if kept is None:
            kept = build()
            _kept[key] = kept
            while len(_kept) > KEPT_TOKENIZERS:
                _kept.popitem(last=False)
        _kept.move_to_end(key)
    fresh = copy.copy(kept)
    fresh.eos_token_ids = set(kept.eos_token_ids)
    return fresh


def forget_tokenizers() -> None:
    """Drop every kept tokenizer (Free releases everything)."""
    with _lock:
        _kept.clear()
