"""The prompt store: one loaded model's prompt cache and its files.

A request's KV state starts from the longest prefix the prompt cache holds
(``fetch``), and a finished sequence's state goes back in (``keep``). On disk,
``PromptCachePath`` files are restored when they serve more of a prompt than
memory does, and ``prompt_cache_dir`` comes to hold the cache's entries while the
engine is idle. A distributed worker keeps the same store, without files, and
replays rank 0's inserts into it, so a hit on rank 0 is a hit on every rank.
"""

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_backend.caches.kinds import NO_REUSE, CacheKinds, copy_prefix
from mlx_backend.caches.paged import PagedPrefix, trim_floor
from mlx_backend.caches.prompt_files import PromptFiles, make_fingerprint
from mlx_backend.caches.quantized_kv import adopt
from mlx_backend.cpu.blas import physical_memory
from mlx_backend.distributed.leader import LeaderPromptCache
from mlx_backend.distributed.lockstep import Lockstep, pipeline_size_fn
from mlx_backend.errors import FailedPrecondition
from mlx_backend.models.lora import Adapter
from mlx_cache import ThreadSafeLRUPromptCache
from mlx_utils import make_kv_cache, model_signature
from python_utils import LoadOptions

logger = logging.getLogger(__name__)

# The share of physical memory the prompt cache may take by default.
PROMPT_CACHE_MEMORY_FRACTION = 0.1


@dataclass
class PromptCounts:
    """Prompt tokens served from the prompt cache, and those prefilled."""

    reused: int = 0
    prefilled: int = 0


class PromptStore:
    """One loaded model's prompt cache, its files, and what its fetches served.

    Args:
        cache: The prompt cache.
        load_id: The load whose KV states it holds (the cache's model key).
        make_cache: A fresh KV cache for the model, for a miss.
        counts: Where fetches count the tokens they served and left to prefill.
        files: Its files on disk; None over a distributed group, which uses none.
        kinds: The model's cache layers and how their state is reused.
    """

    def __init__(
        self,
        cache: ThreadSafeLRUPromptCache,
        load_id: int,
        make_cache: Callable[[], list],
        counts: PromptCounts,
        files: PromptFiles | None = None,
        kinds: CacheKinds = CacheKinds(),
    ):
        self.cache = cache
        self.kinds = kinds
        self._load_id = load_id
        self._make_cache = make_cache
        self._counts = counts
        self.files = files
        # Whether the cache changed since prompt_cache_dir was last written.
        self._changed = False
        # Arrays of kept states still to evaluate (``keep(later=True)``).
        self._unsettled: deque[mx.array] = deque()

    def fetch(
        self, prompt: tuple[int, ...], pages: bool = False
    ) -> tuple[list, tuple[int, ...]]:
        """The nearest KV cache for ``prompt`` and the prompt tokens it lacks.
        ``pages``: the caller takes a paged decoder's states as they are kept (its
        pages, ``PagedPrefix``); else they come as copies in mlx-lm's caches."""
        kv_cache, rest = self.cache.fetch_for_prompt(self._load_id, prompt)
        if kv_cache is not None and _in_closed_store(kv_cache):
            # Kept before the paged decoder was reset (a failed step): drop them all.
            dropped = self.cache.drop(self._load_id, _in_closed_store)
            logger.info("dropped %d prompt cache entries of a reset decoder", dropped)
            kv_cache, rest = None, prompt
        if kv_cache is None:
            kv_cache = self._make_cache()
        elif not pages and paged_layer(kv_cache) is not None:
            kv_cache = [
                layer.to_kv_cache() if isinstance(layer, PagedPrefix) else layer
                for layer in kv_cache
            ]
        self._counts.reused += len(prompt) - len(rest)
        self._counts.prefilled += len(rest)
        return kv_cache, tuple(rest)

    def fetch_shared(
        self, prefix: tuple[int, ...], rests: tuple[tuple[int, ...], ...]
    ) -> tuple[list, tuple[int, ...]]:
        """``fetch`` for a prefix that several prompts share, each going on with
        one of ``rests``: the counts take every prompt as served from the prefix."""
        kv_cache, missing = self.fetch(prefix)
        self._counts.reused += len(prefix) * (len(rests) - 1)
        self._counts.prefilled += sum(map(len, rests))
        return kv_cache, missing

    def keep(
        self, kv_cache: list, tokens, holders: int = 1, later: bool = False
    ) -> None:
        """Keep a KV cache for the next request (or ``holders`` requests) to
        reuse. ``later``: its copy out of a batch no sequence uses any more is
        made a few layers a step (``settle``), not all in this one."""
        if self.kinds.reuse == NO_REUSE:
            return
        if (
            self.cache.insert_state(
                self._load_id, tokens, kv_cache, holders, evaluate=not later
            )
            and later
        ):
            states = tree_flatten([layer.state for layer in kv_cache])
            self._unsettled.extend(a for _, a in states if isinstance(a, mx.array))
        self._changed = True

    def settle(self, max_bytes: int | None = None) -> None:
        """Evaluate kept states' arrays, about ``max_bytes`` of them (None: all)."""
        done = 0
        while self._unsettled and (max_bytes is None or done < max_bytes):
            array = self._unsettled.popleft()
            mx.eval(array)
            done += array.nbytes

    def shrink(self, max_bytes: int) -> None:
        """Evict the least recently used entries until at most ``max_bytes`` stay."""
        dropped = self.cache.evict_to(max(max_bytes, 0))
        if dropped:
            logger.info(
                "the prompt cache gave up %d bytes to the memory budget", dropped
            )
            self._changed = True

    def cached_length(self, prompt: tuple[int, ...]) -> int:
        return self.cache.cached_length(self._load_id, prompt)

    def restore(self, path: Path, prompt: tuple[int, ...]) -> None:
        """A PromptCachePath file's KV state joins the prompt cache when it serves
        more of ``prompt`` than the cache does."""
        if self.files is None:
            raise FailedPrecondition(
                "PromptCachePath: prompt cache files are not used over a "
                "distributed group"
            )
        cached = self.cached_length(prompt)
        state = self.files.read(path, prompt, cached)
        if state is None:
            return
        cache, tokens = state
        self.keep(adopt(cache, self._make_cache()), tokens)
        if self.cached_length(prompt) <= cached:
            logger.warning(
                "the prompt cache can't keep the %d-token KV state of %s "
                "(max_cache_entries, max_cache_bytes)",
                len(tokens),
                path,
            )
            self.files.unkept(path)
            return
        logger.info("restored %d tokens' KV state from %s", len(tokens), path)

    def write(self, path: Path, kv_cache: list, tokens) -> None:
        """Save a PromptCachePath file (a request's restore made sure of files)."""
        self.files.write(path, kv_cache, tokens)

    def load_folder(self, limit: int) -> None:
        """prompt_cache_dir's entries join the prompt cache."""
        if self.files is None:
            return
        for cache, tokens in self.files.load_folder(limit):
            self.keep(adopt(cache, self._make_cache()), tokens)
        self._changed = False

    def sync(self) -> None:
        """While idle, kept states settle and prompt_cache_dir comes to hold the
        prompt cache's entries."""
        self.settle()
        if self.files is None or not self._changed:
            return
        self._changed = False
        self.files.sync_folder(self.cache.entries(self._load_id))

    def close(self) -> None:
        """The model is unloaded: write what is due, then drop every entry."""
        self.sync()
        self.cache.clear()


def paged_layer(kv_cache: list) -> PagedPrefix | None:
    """A layer of a paged decoder's kept state (a hybrid's first may be
    recurrent); None: not one."""
    return next((x for x in kv_cache if isinstance(x, PagedPrefix)), None)


def _in_closed_store(kv_cache: list) -> bool:
    layer = paged_layer(kv_cache)
    return layer is not None and layer.lease.kv.closed


def make_prompt_cache(
    options: LoadOptions,
    max_bytes: int,
    lockstep: Lockstep | None = None,
    total_layers: int = 0,
    trimmable: bool = True,
) -> ThreadSafeLRUPromptCache:
    """The prompt cache of a process, or of a rank of a group: the same bounds and
    entry sizes on every rank, and rank 0's inserts recorded for the others.
    ``trimmable`` false (the whole model's state is not reused by trimming): a
    group's entries are never trimmed, though a pipeline rank's own layers might
    all trim, so that every rank serves and evicts the same entries."""
    kind = ThreadSafeLRUPromptCache
    kwargs = {"can_trim_fn": can_trim_prompt_cache}
    if lockstep is not None:
        kwargs["size_fn"] = lambda kv: pipeline_size_fn(kv, total_layers)
        if not trimmable:
            kwargs["can_trim_fn"] = lambda kv: False
        if lockstep.rank == 0:
            kind, kwargs["lockstep"] = LeaderPromptCache, lockstep
    return kind(
        max_size=options.max_cache_entries,
        trim_fn=trim_prompt_cache,
        copy_prefix_fn=copy_prefix,
        floor_fn=trim_floor,
        max_bytes=max_bytes,
        **kwargs,
    )


def prompt_cache_bytes(options: LoadOptions) -> int:
    if options.max_cache_bytes is not None:
        return options.max_cache_bytes
    return int(physical_memory() * PROMPT_CACHE_MEMORY_FRACTION)


def make_prompt_files(
    model: nn.Module,
    config: dict,
    source: str,
    tokenizer: TokenizerWrapper,
    options: LoadOptions,
    adapters: tuple[Adapter, ...],
) -> PromptFiles:
    """The loaded model's prompt cache files: a KV state on disk serves only the
    model, tokenizer, KV layout and adapters that made it."""
    layout = (
        f"kv_bits={options.kv_bits},kv_group_size={options.kv_group_size},"
        f"quantized_kv_start={options.quantized_kv_start},"
        f"max_kv_size={options.max_kv_size},fuse_lora={options.fuse_lora},"
        f"adapters={[(str(a.path), a.scale) for a in adapters]}"
    )
    if options.kv_dtype != "auto":
        # Pages of another type held the state; the files' layout says which.
        layout += f",kv_dtype={options.kv_dtype}"

    def fingerprint() -> str:
        identity = f"{source}; {model_signature(model, config)}"
        return make_fingerprint(identity, tokenizer.vocab, layout)

    cache_dir = options.prompt_cache_dir
    layers = len(make_kv_cache(model, options))
    return PromptFiles(fingerprint, layers, Path(cache_dir) if cache_dir else None)
