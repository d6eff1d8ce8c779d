"""KV states on disk: the request field PromptCachePath and the load option
prompt_cache_dir, written with mlx-lm's save_prompt_cache and checked on the way back.
"""

import copy
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import suppress
from functools import cached_property
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_unflatten
from mlx_lm.models import cache as lm_cache
from mlx_lm.models.cache import (
    CacheList,
    KVCache,
    QuantizedKVCache,
    _BaseCache,
    can_trim_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)

from mlx_backend.caches.kinds import cache_length
from mlx_backend.caches.paged import PagedPrefix, trim_floor
from mlx_backend.errors import InvalidArgument
from mlx_backend.refusals import describe_path
from mlx_cache import common_length

logger = logging.getLogger(__name__)

FORMAT = "1"
SUFFIX = ".safetensors"


class PromptFileError(Exception):
    """Why a prompt cache file can't be used; load_state logs it and returns None."""


def make_fingerprint(
    model_source: str, tokenizer_vocab: dict[str, int], kv_layout: str
) -> str:
    """The identity a KV state is only valid for.

    Args:
        model_source: the model's path or repository, and revision if known.
        tokenizer_vocab: the tokenizer's vocabulary, token to id.
        kv_layout: how the KV cache is laid out, e.g. ``"kv_bits=8,group=32"``.

    Returns:
        A sha256 hex digest.
    """
    digest = hashlib.sha256()
    for part in (model_source, sorted(tokenizer_vocab.items()), kv_layout):
        digest.update(json.dumps(part).encode())
        digest.update(b"\0")
    return digest.hexdigest()


def confine(path: str, roots: Sequence[Path], field: str = "PromptCachePath") -> Path:
    """The absolute path for ``path``, which must lie inside one of ``roots``.

    Args:
        path: the path as the request gave it; a relative one is taken under roots[0].
        roots: the folders files may be read from and written to.
        field: the request field or option that named ``path``, for the error.

    Returns:
        The path with symlinks and '..' resolved.

    Raises:
        InvalidArgument: ``roots`` is empty, or the path lies outside them.
    """
    if not roots:
        raise InvalidArgument(f"{field} needs ModelPath or the option prompt_cache_dir")
    if not path:
        raise InvalidArgument(f"{field} is empty")
    try:
        allowed = [Path(root).resolve() for root in roots]
        # An absolute path replaces allowed[0].
        resolved = (allowed[0] / path).resolve()
    except (OSError, RuntimeError, ValueError) as e:  # a NUL byte, a link loop
        raise InvalidArgument(f"{field}: {path!r} can't be resolved: {e}") from None
    # A root itself is a folder, not a file inside it.
    if not any(resolved != root and resolved.is_relative_to(root) for root in allowed):
        raise InvalidArgument(
            f"{field}: {path!r} is not inside the allowed folders "
            f"({', '.join(str(root) for root in allowed)})"
        )
    return resolved


def _header(path: Path) -> tuple[int, dict] | None:
    """A safetensors file's header length and JSON header, read without its
    arrays; None when it has none."""
    try:
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 0 < length <= 1 << 24:
                return None
            header = json.loads(f.read(length))
    except (OSError, ValueError, RecursionError):
        return None
    return (length, header) if isinstance(header, dict) else None


def is_prompt_file(path: Path) -> bool:
    """Whether ``path`` is a regular file that save_state wrote (for any model)."""
    found = path.is_file() and _header(path)
    metadata = found[1].get("__metadata__") if found else None
    return isinstance(metadata, dict) and metadata.get("0.format") == FORMAT


def _complete(path: Path) -> bool:
    """Whether a written safetensors file holds every byte its header promises:
    MLX reports no error when the disk fills."""
    found = _header(path)
    if found is None:
        return False
    length, header = found
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    return path.stat().st_size == 8 + length + max(ends, default=0)


def _as_mlx_lm(layer):
    """``layer`` as its nearest mlx-lm cache class: load_prompt_cache finds classes by
    name in mlx_lm.models.cache, so a subclass of ours would not load."""
    if isinstance(layer, PagedPrefix):
        return layer.to_kv_cache()
    base = next(
        (k for k in type(layer).__mro__ if k.__module__ == lm_cache.__name__), None
    )
    if base is None or not issubclass(base, _BaseCache):
        raise ValueError(f"{type(layer).__name__} is not an mlx-lm KV cache layer")
    if base is CacheList:
        return CacheList(*(_as_mlx_lm(c) for c in layer.caches))
    state = layer.state
    if base in (KVCache, QuantizedKVCache) and layer.keys is not None:
        # Their buffers grow 256 rows at a time; only the first `offset` hold tokens.
        state = (*base.keys_and_values(layer), *state[2:])
    return base.from_state(state)


def _offset_mismatch(cache: list, count: int) -> str | None:
    for i, layer in enumerate(cache):
        offset = getattr(layer, "offset", None)
        if isinstance(offset, int) and offset != count:
            return f"layer {i} holds {offset} tokens but {count} tokens are listed"
    return None


def save_state(
    path: Path, cache: list, tokens: Sequence[int], fingerprint: str
) -> None:
    """Write a KV state to ``path`` atomically: a reader sees the old file or the new.

    Args:
        path: the file to write, confined by the caller; its folder is created.
        cache: the per-layer KV cache objects (mlx-lm classes or subclasses of them).
        tokens: the tokens the cache holds.
        fingerprint: make_fingerprint's value for the model that made ``cache``.

    Raises:
        ValueError: a layer's offset disagrees with ``len(tokens)``, or a layer is
            not an mlx-lm cache.
        OSError: the file could not be written; the previous one is left as it was.
    """
    tokens = [int(t) for t in tokens]
    if why := _offset_mismatch(cache, len(tokens)):
        raise ValueError(f"Not saving {path}: {why}")
    # A request names the path: never replace a file that is not one of ours.
    if path.exists() and not is_prompt_file(path):
        raise ValueError(f"{path} exists and is not a prompt cache file")
    layers = [_as_mlx_lm(layer) for layer in cache]
    metadata = {
        "fingerprint": fingerprint,
        "tokens": json.dumps(tokens),
        "format": FORMAT,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    # The dot hides the temp from directory scans; the suffix stops
    # mx.save_safetensors from appending one, so it writes exactly `tmp`.
    fd, tmp = tempfile.mkstemp(prefix=".prompt-cache-", suffix=SUFFIX, dir=path.parent)
    try:
        os.close(fd)
        save_prompt_cache(tmp, layers, metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        if not _complete(Path(tmp)):
            raise OSError(f"writing {path} was cut short (is the disk full?)")
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise
    # So the rename itself survives a power loss.
    with suppress(OSError):
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _cache_class(name: str) -> type:
    cls = getattr(lm_cache, name, None)
    if not (isinstance(cls, type) and issubclass(cls, _BaseCache)):
        raise PromptFileError(f"unknown KV cache class {name!r}")
    return cls


def _read(path: Path, fingerprint: str, layers: int) -> tuple[list, list[int]]:
    # load_prompt_cache would infer the format from the suffix, which a
    # PromptCachePath need not have; this is its decoding with the format given.
    arrays, flat = mx.load(str(path), format="safetensors", return_metadata=True)
    metadata, classes, scalars = tree_unflatten(list(flat.items()))
    if metadata.get("format") != FORMAT:
        raise PromptFileError(f"not a prompt cache file of format {FORMAT}")
    if metadata.get("fingerprint") != fingerprint:
        raise PromptFileError("written for another model, tokenizer or KV cache layout")
    if len(classes) != layers:
        raise PromptFileError(f"{len(classes)} layers where the model has {layers}")
    tokens = json.loads(metadata["tokens"])
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise PromptFileError("its token list is malformed")
    # Read the data now, so a bad file fails here and not in the middle of a request.
    mx.eval(list(arrays.values()))
    for pos, kind in scalars[1:]:
        if kind == "scalar":
            arrays[pos] = arrays[pos].item()
        elif kind == "string":
            arrays[pos] = "".join(chr(i) for i in arrays[pos].tolist())
        elif kind == "none":
            arrays[pos] = None
        else:
            raise PromptFileError(f"unknown scalar type {kind!r}")
    states = tree_unflatten(list(arrays.items()))
    if len(states) != layers:
        raise PromptFileError(
            f"{len(states)} layer states where the model has {layers}"
        )
    cache = [_cache_class(c).from_state(s) for c, s in zip(classes, states)]
    if why := _offset_mismatch(cache, len(tokens)):
        raise PromptFileError(why)
    return cache, tokens


def load_state(
    path: Path, fingerprint: str, layers: int
) -> tuple[list, list[int]] | None:
    """The KV state saved in ``path``, or None if there is none fit to use.

    A missing file is None quietly; a truncated or corrupt one, one written for
    another fingerprint, or one whose layers or tokens don't fit is None with a
    warning naming the file and why.

    Args:
        path: the file save_state wrote.
        fingerprint: make_fingerprint's value for the model now loaded.
        layers: how many cache layers the model has.

    Returns:
        ``(cache, tokens)`` with mlx-lm cache classes, or None.
    """
    if not path.exists():
        return None
    if not path.is_file():
        logger.warning("Ignoring the prompt cache file %s: not a regular file", path)
        return None
    # A request may name any file under the allowed folders: only one whose header
    # says save_state wrote it is read past its first bytes.
    if not is_prompt_file(path):
        logger.warning(
            "Ignoring the prompt cache file %s: unreadable, not a prompt cache file "
            "(%s)",
            path,
            describe_path(path),
        )
        return None
    try:
        return _read(path, fingerprint, layers)
    except PromptFileError as e:
        why = str(e)
    except Exception as e:  # mx.load and from_state raise all kinds on a bad file
        why = f"unreadable ({type(e).__name__}: {e})"
    logger.warning("Ignoring the prompt cache file %s: %s", path, why)
    return None


class PromptCacheDir:
    """A folder holding prompt-cache entries, one file per entry, for the load option
    prompt_cache_dir."""

    def __init__(self, folder: Path, fingerprint: str, layers: int):
        """
        Args:
            folder: where the entries live; created on the first write.
            fingerprint: make_fingerprint's value for the model now loaded.
            layers: how many cache layers the model has.
        """
        self.folder = folder
        self.fingerprint = fingerprint
        self.layers = layers

    def _path(self, tokens: Sequence[int]) -> Path:
        key = json.dumps([self.fingerprint, [int(t) for t in tokens]]).encode()
        return self.folder / (hashlib.sha256(key).hexdigest()[:32] + SUFFIX)

    def entries(self, limit: int) -> Iterator[tuple[list, list[int]]]:
        """The valid entries among the newest ``limit`` files, as ``(cache, tokens)``,
        oldest first, read one at a time.

        Files that don't load are skipped with a warning and left in place.
        """
        stamped = []
        for path in self.folder.glob("*" + SUFFIX):  # none if there is no folder yet
            if not path.name.startswith("."):  # skip save_state's temp files
                with suppress(OSError):  # removed since the scan
                    stamped.append((path.stat().st_mtime_ns, path))
        stamped.sort()
        for _, path in stamped[max(0, len(stamped) - limit) :] if limit > 0 else []:
            entry = load_state(path, self.fingerprint, self.layers)
            if entry is None:
                continue
            if self._path(entry[1]) != path:
                # remove() could never find it; a renamed copy, most likely.
                logger.warning("Ignoring the prompt cache file %s: misnamed", path)
                continue
            yield entry

    def write(self, tokens: Sequence[int], cache: list) -> None:
        """Save one entry, replacing any earlier one for the same tokens.

        Args:
            tokens: the tokens ``cache`` holds.
            cache: the per-layer KV cache objects.
        """
        save_state(self._path(tokens), cache, tokens, self.fingerprint)

    def remove(self, tokens: Sequence[int]) -> None:
        """Delete the entry for ``tokens`` if there is one.

        Args:
            tokens: the tokens the entry was written with.
        """
        with suppress(FileNotFoundError):
            self._path(tokens).unlink()


def _fit(cache: list, tokens: Sequence[int]) -> tuple[list, list[int]] | None:
    """``cache`` cut to the tokens both it and ``tokens`` hold, without copying
    arrays (a trim only moves a shallow copy's offset); None when it can't be."""
    # Layers of recurrent state alone count no positions: they hold ``tokens``.
    offset = cache_length(cache)
    if offset is None:
        offset = len(tokens)
    n = min(offset, len(tokens))
    if n < 2:
        return None
    layers = [copy.copy(layer) for layer in cache]
    if offset > n:
        # A paged window's kept state trims no deeper than its floor.
        if not can_trim_prompt_cache(layers) or trim_floor(layers) > n:
            return None
        trim_prompt_cache(layers, offset - n)
    return layers, [int(t) for t in tokens[:n]]


class PromptFiles:
    """The engine's prompt cache files: ``PromptCachePath`` files, read when they
    would serve more of a prompt than memory does and written when their state
    changes, and the ``prompt_cache_dir`` entries. Engine thread only.

    Args:
        fingerprint: makes make_fingerprint's value for the model now loaded, when
          a file is first used (it hashes the vocabulary, ~0.1 s, and most loads
          use no file).
        layers: how many cache layers the model has.
        cache_dir: the option prompt_cache_dir, or None.
    """

    def __init__(
        self,
        fingerprint: Callable[[], str],
        layers: int,
        cache_dir: Path | None = None,
    ):
        self._make_fingerprint = fingerprint
        self.layers = layers
        self.folder = None
        if cache_dir is not None:
            # Each model's entries in a folder of their own.
            folder = cache_dir / self.fingerprint[:16]
            self.folder = PromptCacheDir(folder, self.fingerprint, layers)
        # What each file held when this process last read or wrote it.
        self._known: dict[Path, tuple[int, tuple[int, ...]]] = {}
        self._written: set[tuple[int, ...]] = set()
        self._unkept: dict[Path, int | None] = {}

    @cached_property
    def fingerprint(self) -> str:
        return self._make_fingerprint()

    def _stamp(self, path: Path) -> int | None:
        with suppress(OSError):
            return path.stat().st_mtime_ns
        return None

    def read(
        self, path: Path, prompt: Sequence[int], cached: int
    ) -> tuple[list, list[int]] | None:
        """The KV state in ``path`` when it serves more of ``prompt`` than the
        ``cached`` tokens memory serves; a bad file is None with a warning."""
        stamp = self._stamp(path)
        known = self._known.get(path)
        if stamp is None or self._unkept.get(path) == stamp:
            return None
        if known and known[0] == stamp and common_length(known[1], prompt) <= cached:
            return None
        state = load_state(path, self.fingerprint, self.layers)
        if state is None:
            self._known.pop(path, None)
            return None
        self._known[path] = (stamp, tuple(state[1]))
        if common_length(state[1], prompt) <= cached:
            return None
        return state

    def write(self, path: Path, cache: list, tokens: Sequence[int]) -> None:
        """Save the state of ``tokens`` to ``path`` unless it holds it already;
        a failure is logged, since the request it served has ended."""
        fitted = _fit(cache, tokens)
        if fitted is None:
            logger.info("not saving %s: the KV state can't be cut to its tokens", path)
            return
        layers, tokens = fitted
        known = self._known.get(path)
        if known and known[1] == tuple(tokens) and known[0] == self._stamp(path):
            return
        try:
            save_state(path, layers, tokens, self.fingerprint)
        except (OSError, ValueError) as e:
            logger.warning("could not save the prompt cache file %s: %s", path, e)
            return
        self._known[path] = (self._stamp(path), tuple(tokens))

    def load_folder(self, limit: int) -> Iterator[tuple[list, list[int]]]:
        """prompt_cache_dir's newest ``limit`` entries, oldest first."""
        if self.folder is None:
            return
        for cache, tokens in self.folder.entries(limit):
            self._written.add(tuple(tokens))
            yield cache, tokens

    def unkept(self, path: Path) -> None:
        """The prompt cache could not keep ``path``'s state: don't read it again
        until it changes."""
        self._unkept[path] = self._stamp(path)

    def sync_folder(self, entries: list[tuple[tuple[int, ...], list]]) -> None:
        """Make prompt_cache_dir hold the prompt cache's ``entries``."""
        if self.folder is None:
            return
        current = dict(entries)
        for tokens in self._written - current.keys():
            with suppress(OSError):
                self.folder.remove(tokens)
            self._written.discard(tokens)
        for tokens, cache in current.items():
            fitted = None if tokens in self._written else _fit(cache, tokens)
            if fitted is None:
                continue
            try:
                self.folder.write(fitted[1], fitted[0])
            except (OSError, ValueError) as e:
                logger.warning("could not save a prompt cache entry: %s", e)
                continue
            self._written.add(tuple(fitted[1]))
