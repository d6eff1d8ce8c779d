"""The prompt cache: a thread-safe trie LRU of KV caches keyed by token ids.

Chat turns and agent loops resend the same long prefix, so the engine keeps the KV
caches of recent sequences and a new request only prefills what is new. The trie
search is mlx-lm's ``PromptTrie`` (``LinearPromptTrie``: its search for a longer
entry in linear time); this module adds reference counts, extraction,
LRU eviction by entry count and by bytes, and a lock.

Thread ownership: the MLX arrays inside entries are created, trimmed, copied and
evaluated only on the engine thread. Other threads may call ``clear``, ``len`` and
the size properties; the lock keeps the trie, the LRU order and the counters
consistent whichever threads call in.
"""

import copy
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import PromptTrie, PromptTrieResult

from mlx_backend.caches.kinds import cache_length

logger = logging.getLogger(__name__)


@dataclass
class _Entry:
    prompt_cache: list
    nbytes: int
    count: int = 1


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def cache_nbytes(prompt_cache: Sequence[Any]) -> int:
    """Bytes held by the KV arrays of a per-layer list of caches.

    Entries are opaque to the cache: a layer without ``nbytes`` counts 0 bytes.
    """
    return sum(getattr(layer, "nbytes", 0) for layer in prompt_cache)


class LinearPromptTrie(PromptTrie):
    """mlx-lm's prompt trie, whose search finds the shortest longer entry in
    linear time: mlx-lm 0.32 copies the path at every node below where the
    prompt parts from an entry, quadratic in the entry's remaining length (10 ms
    for one 3,800-token entry, at every admission and prefix lookup)."""

    def search(self, model: Hashable, tokens: list[int]) -> PromptTrieResult:
        current = self._trie.get(model)
        if current is None:
            return PromptTrieResult(model, None, None, None, 0)
        if not tokens and "__value__" in current:
            return PromptTrieResult(model, [], None, None, 0)
        last, index = -1, 0
        while index < len(tokens) and tokens[index] in current:
            current = current[tokens[index]]
            if "__value__" in current:
                last = index
            index += 1
        if last == len(tokens) - 1 >= 0:
            return PromptTrieResult(model, tokens, None, None, 0)
        shorter = tokens[: last + 1] if last > 0 else None
        longer = None
        if index > 0:
            longer = tokens[:index] + _shortest_completion(current)
        return PromptTrieResult(model, None, shorter, longer, index)


def _shortest_completion(node: dict) -> list:
    """The tokens from ``node`` to the nearest entry below it, breadth first."""
    level = [(node, None)]
    while level:
        below = []
        for current, path in level:
            if "__value__" in current:
                tokens = []
                while path is not None:
                    token, path = path
                    tokens.append(token)
                return tokens[::-1]
            below += [(child, (t, path)) for t, child in current.items()]
        level = below
    return []


class ThreadSafeLRUPromptCache:
    """KV caches keyed by ``(model_key, token ids)``, reused by prefix.

    Args:
        max_size: The most entries kept; the least recently used go first.
        can_trim_fn: ``can_trim_fn(prompt_cache) -> bool``; without it, longer
          entries are never trimmed to serve a shorter prompt.
        trim_fn: ``trim_fn(prompt_cache, n)`` drops the last ``n`` tokens.
        max_bytes: The most bytes of KV arrays kept; an entry larger than this
          is not kept at all.
        size_fn: ``size_fn(prompt_cache) -> int``, the bytes an entry counts
          (default ``cache_nbytes``).
        copy_prefix_fn: ``copy_prefix_fn(prompt_cache, n)``, a copy holding the
          first ``n`` tokens only, or None where it can't make one; a longer
          entry that serves a shorter prompt is otherwise copied whole and
          trimmed.
        floor_fn: ``floor_fn(prompt_cache) -> int``, the fewest tokens a trim
          may leave it (default 0: any); a trim deeper than that is not made.
    """

    def __init__(
        self,
        max_size: int = 10,
        can_trim_fn: Callable[[list], bool] | None = None,
        trim_fn: Callable[[list, int], Any] | None = None,
        max_bytes: int = 1 << 62,
        size_fn: Callable[[list], int] = cache_nbytes,
        copy_prefix_fn: Callable[[list, int], list | None] | None = None,
        floor_fn: Callable[[list], int] | None = None,
    ):
        self.max_size = max_size
        self.max_bytes = max_bytes
        self._size = size_fn
        self._can_trim = can_trim_fn
        self._trim = trim_fn
        self._copy_prefix = copy_prefix_fn
        self._floor = floor_fn
        self._trie = LinearPromptTrie()
        self._lru: OrderedDict[tuple[Hashable, tuple[int, ...]], _Entry] = OrderedDict()
        self._nbytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._lru)

    def len(self) -> int:
        return len(self)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._nbytes

    def fetch_nearest_cache(
        self, model_key: Hashable, tokens: Sequence[int]
    ) -> tuple[list | None, list[int]]:
        """The cache that covers the longest prefix of ``tokens``, and the rest.

        An exact or shorter entry is taken out of the cache (or deep-copied when it
        is shared or can't be trimmed); a longer entry is copied and trimmed back to
        the common prefix and stays in place.

        Returns:
            ``(prompt_cache, remaining_tokens)``, or ``(None, tokens)`` on a miss.
        """
        tokens = list(tokens)
        with self._lock:
            found = self._trie.search(model_key, tokens)
            if found.exact is not None:
                return self._take(model_key, found.exact), []
            # A match needs two tokens or more; the trie reports shorter ones so.
            shorter = len(found.shorter) if found.shorter is not None else 0
            if (
                found.longer is not None
                and found.common_prefix > max(shorter, 1)
                and self._can_trim is not None
            ):
                key = (model_key, tuple(found.longer))
                entry = self._lru[key]
                if self._trimmable(entry.prompt_cache, found.common_prefix):
                    self._lru.move_to_end(key)
                    cache = self._prefix_of(entry.prompt_cache, found.common_prefix)
                    if cache is None:
                        cache = copy.deepcopy(entry.prompt_cache)
                        self._trim(cache, len(found.longer) - found.common_prefix)
                    return cache, tokens[found.common_prefix :]
            if shorter:
                return self._take(model_key, found.shorter), tokens[shorter:]
            return None, tokens

    def insert_cache(
        self,
        model_key: Hashable,
        tokens: Sequence[int],
        prompt_cache: list,
        holders: int = 1,
    ) -> None:
        """Keep ``prompt_cache`` as the KV state of ``tokens``.

        Inserting tokens that are already cached counts more holders of that entry
        instead of storing a second copy. An entry with ``holders`` holders serves
        that many fetches of its exact tokens or of longer prompts before it leaves.
        """
        key = (model_key, tuple(tokens))
        nbytes = self._size(prompt_cache)
        with self._lock:
            entry = self._lru.get(key)
            if entry is not None:
                entry.count += holders
                self._lru.move_to_end(key)
                return
            if nbytes > self.max_bytes or self.max_size < 1:
                logger.debug("not caching %d tokens (%d bytes)", len(tokens), nbytes)
                return
            entry = _Entry(prompt_cache, nbytes, holders)
            self._trie.add(model_key, key[1], entry)
            self._lru[key] = entry
            self._nbytes += nbytes
            if self._trimmable(prompt_cache, 0):
                # A trimmable entry serves all its prefixes, so they only take space.
                for length, prefix in self._trie.pop_prefixes(model_key, key[1]):
                    self._forget((model_key, key[1][:length]), prefix)
            while len(self._lru) > self.max_size or self._nbytes > self.max_bytes:
                old_key, old = self._lru.popitem(last=False)
                self._trie.pop(*old_key)
                self._nbytes -= old.nbytes

    def fetch_for_prompt(
        self, model_key: Hashable, tokens: Sequence[int]
    ) -> tuple[list | None, list[int]]:
        """Like ``fetch_nearest_cache``, but at least one token is left to run:
        an exact hit is trimmed by one token, or when it can't be, the longest
        entry short of the last token serves, since generation needs the logits
        of the last prompt token."""
        tokens = list(tokens)
        with self._lock:
            exact = self._lru.get((model_key, tuple(tokens)))
            untrimmable = exact is not None and not self._trimmable(
                exact.prompt_cache, len(tokens) - 1
            )
        if untrimmable:
            prompt_cache, rest = self.fetch_nearest_cache(model_key, tokens[:-1])
            return prompt_cache, [*rest, tokens[-1]]
        prompt_cache, rest = self.fetch_nearest_cache(model_key, tokens)
        if prompt_cache is not None and not rest:
            if self._trimmable(prompt_cache, len(tokens) - 1):
                self._trim(prompt_cache, 1)
                return prompt_cache, tokens[-1:]
            return None, tokens
        return prompt_cache, rest

    def insert_state(
        self,
        model_key: Hashable,
        tokens: Sequence[int],
        prompt_cache: list,
        holders: int = 1,
        evaluate: bool = True,
    ) -> bool:
        """Keep a sequence's KV state: the tokens its layers hold (a cancelled
        prefill keeps whole chunks, so it can hold fewer than it was given; layers
        of recurrent state alone hold all of ``tokens``), evaluated now unless
        not ``evaluate`` (then the caller does soon), so that a lazy slice never
        pins a whole batch's buffers. Whether it was offered to the cache."""
        length = min(cache_length(prompt_cache) or len(tokens), len(tokens))
        if length <= 1:
            return False
        if evaluate:
            mx.eval([layer.state for layer in prompt_cache])
        self.insert_cache(model_key, list(tokens[:length]), prompt_cache, holders)
        return True

    def cached_length(self, model_key: Hashable, tokens: Sequence[int]) -> int:
        """How many leading tokens of ``tokens`` a fetch would serve; takes nothing."""
        tokens = list(tokens)
        with self._lock:
            found = self._trie.search(model_key, tokens)
            if found.exact is not None:
                return len(tokens)
            shorter = len(found.shorter) if found.shorter is not None else 0
            if found.longer is not None and found.common_prefix > max(shorter, 1):
                entry = self._lru[(model_key, tuple(found.longer))]
                if self._trimmable(entry.prompt_cache, found.common_prefix):
                    return found.common_prefix
            return shorter

    def entries(self, model_key: Hashable) -> list[tuple[tuple[int, ...], list]]:
        """The tokens and KV cache of each of ``model_key``'s entries, least
        recently used first; the caches are the entries' own, not copies."""
        with self._lock:
            return [
                (tokens, entry.prompt_cache)
                for (key, tokens), entry in self._lru.items()
                if key == model_key
            ]

    def drop(self, model_key: Hashable, unwanted: Callable[[list], bool]) -> int:
        """Drop ``model_key``'s entries whose KV cache is ``unwanted``; how many."""
        with self._lock:
            keys = [
                key
                for key, entry in self._lru.items()
                if key[0] == model_key and unwanted(entry.prompt_cache)
            ]
            for key in keys:
                self._trie.pop(*key)
                self._forget(key, self._lru[key])
        return len(keys)

    def evict_to(self, max_bytes: int) -> int:
        """Drop the least recently used entries until at most ``max_bytes`` are
        kept; the bytes dropped."""
        dropped = 0
        with self._lock:
            while self._lru and self._nbytes > max_bytes:
                key, entry = self._lru.popitem(last=False)
                self._trie.pop(*key)
                self._nbytes -= entry.nbytes
                dropped += entry.nbytes
        return dropped

    def clear(self) -> None:
        with self._lock:
            self._trie = LinearPromptTrie()
            self._lru.clear()
            self._nbytes = 0

    def _trimmable(self, prompt_cache: list, to: int) -> bool:
        """Whether ``prompt_cache`` may be trimmed to ``to`` tokens."""
        floor = self._floor(prompt_cache) if self._floor is not None else 0
        return (
            self._can_trim is not None and self._can_trim(prompt_cache) and floor <= to
        )

    def _prefix_of(self, prompt_cache: list, n: int) -> list | None:
        # A long entry's whole copy would cost a step's time to serve a short
        # shared prefix (a 4000-token entry of the embedded model: 184 MB).
        return self._copy_prefix(prompt_cache, n) if self._copy_prefix else None

    def _take(self, model_key: Hashable, tokens: Sequence[int]) -> list:
        key = (model_key, tuple(tokens))
        entry = self._lru[key]
        # An entry that can't be trimmed serves only its own tokens, which no
        # longer entry can give back: it stays (opaque entries, with no can_trim_fn,
        # are handed over).
        stays = self._can_trim is not None and not self._trimmable(
            entry.prompt_cache, len(tokens) - 1
        )
        if entry.count > 1 or stays:
            entry.count = max(entry.count - 1, 1)
            self._lru.move_to_end(key)
            return copy.deepcopy(entry.prompt_cache)
        self._trie.pop(model_key, key[1])
        self._forget(key, entry)
        return entry.prompt_cache

    def _forget(self, key, entry: _Entry) -> None:
        del self._lru[key]
        self._nbytes -= entry.nbytes
