"""Quantized KV caches that batch.

mlx-lm's ``QuantizedKVCache`` serves one sequence: it lacks what ``BatchGenerator``
calls to merge sequences into a batch and take them out again. Here the single
cache gains ``merge``, and ``BatchQuantizedKVCache`` stores keys and values as
MLX's affine quantization triples (packed values, scales, biases) with
``BatchKVCache``'s left-padding bookkeeping, so its masks and trims are inherited.
mlx-lm's attention takes the quantized kernel for any cache with ``bits``.
"""

import mlx.core as mx
from mlx_lm.models import cache as lm_cache
from mlx_lm.models.cache import BatchKVCache, KVCache, dynamic_roll

_Triple = tuple[mx.array, mx.array, mx.array]


def _quantize(x: mx.array, group_size: int, bits: int) -> _Triple:
    return tuple(mx.quantize(x, group_size=group_size, bits=bits))


def _with_room(stored: _Triple | None, new: _Triple, prev: int, step: int) -> _Triple:
    """``stored``, or when ``new`` does not fit after ``prev`` positions, its first
    ``prev`` positions grown by whole steps, as the unquantized caches grow."""
    n = new[0].shape[2]
    if stored is not None and prev + n <= stored[0].shape[2]:
        return stored
    steps = (step + n - 1) // step * step
    zeros = [mx.zeros((*x.shape[:2], steps, x.shape[3]), x.dtype) for x in new]
    if stored is None:
        return tuple(zeros)
    return tuple(
        mx.concatenate([s[..., :prev, :], z], axis=2) for s, z in zip(stored, zeros)
    )


def _append(cache, keys: mx.array, values: mx.array, prev: int) -> int:
    """Quantize ``keys`` and ``values`` into ``cache``'s buffers after ``prev``
    positions; the position after them."""
    keys = _quantize(keys, cache.group_size, cache.bits)
    values = _quantize(values, cache.group_size, cache.bits)
    cache.keys = _with_room(cache.keys, keys, prev, cache.step)
    cache.values = _with_room(cache.values, values, prev, cache.step)
    end = prev + keys[0].shape[2]
    for stored, new in zip((*cache.keys, *cache.values), (*keys, *values)):
        stored[..., prev:end, :] = new
    return end


def _quantize_prefix(
    keys: mx.array | None, values: mx.array | None, n: int, group: int, bits: int
) -> tuple[_Triple | None, _Triple | None]:
    """The first ``n`` positions of unquantized buffers, quantized."""
    if keys is None:
        return None, None
    return (
        _quantize(keys[..., :n, :], group, bits),
        _quantize(values[..., :n, :], group, bits),
    )


class QuantizedKVCache(lm_cache.QuantizedKVCache):
    """mlx-lm's quantized KV cache for one sequence, which merges into a batch."""

    def update_and_fetch(self, keys, values):
        # mlx-lm sizes its buffers as dims // (32 // bits) words, too many when
        # bits does not divide 32 (5 or 6 bits at 128 dims); these take quantize's.
        self.offset = _append(self, keys, values, self.offset)
        return self.keys_and_values()

    def size(self) -> int:
        return self.offset

    @classmethod
    def merge(cls, caches: list) -> "BatchQuantizedKVCache":
        return BatchQuantizedKVCache.merge(caches)

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else super().nbytes


def _quantized_nbytes(*parts: _Triple | None) -> int:
    return sum(x.nbytes for part in parts if part is not None for x in part)


class BatchQuantizedKVCache(BatchKVCache):
    """Left-padded quantized keys and values of a batch of sequences."""

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8):
        super().__init__(left_padding)
        self.group_size = group_size
        self.bits = bits

    def update_and_fetch(self, keys, values):
        self.offset = self.offset + keys.shape[2]
        self._idx = _append(self, keys, values, self._idx)
        return self.keys_and_values()

    def keys_and_values(self):
        return tuple(
            tuple(x[..., : self._idx, :] for x in part)
            for part in (self.keys, self.values)
        )

    def finalize(self):
        if self._right_padding is None:
            return
        padding = self._right_padding
        self.keys, self.values = (
            tuple(dynamic_roll(x, padding[:, None], axis=2) for x in part)
            for part in (self.keys, self.values)
        )
        self.offset = self.offset - padding
        self.left_padding += padding
        self._right_padding = None

    def filter(self, batch_indices):
        if self.keys is not None:
            self.keys, self.values = (
                tuple(x[batch_indices] for x in part)
                for part in (self.keys, self.values)
            )
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        # Drop the padding every remaining row has.
        shift = min(self.left_padding.tolist())
        if shift > 0:
            if self.keys is not None:
                self.keys, self.values = (
                    tuple(x[..., shift:, :] for x in part)
                    for part in (self.keys, self.values)
                )
            self._idx -= shift
            self.left_padding -= shift

    def extend(self, other: "BatchQuantizedKVCache"):
        if isinstance(other, BatchStagedKVCache):
            other.quantize()
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        max_idx = max(self._idx, other._idx)
        filled = [c for c in (self, other) if c.keys is not None]
        max_size = max(c.keys[0].shape[2] for c in filled)
        template = filled[0]

        # Right-justify both at max_idx, with the same length.
        def pad(c: "BatchQuantizedKVCache"):
            rows = c.offset.shape[0]
            parts = []
            for name in ("keys", "values"):
                stored = getattr(c, name) or tuple(
                    mx.zeros((rows, x.shape[1], 0, x.shape[3]), x.dtype)
                    for x in getattr(template, name)
                )
                left = max_idx - c._idx
                right = max_size - stored[0].shape[2] - left
                if right < 0:
                    stored = tuple(x[..., :right, :] for x in stored)
                    right = 0
                if left or right:
                    widths = [(0, 0), (0, 0), (left, right), (0, 0)]
                    stored = tuple(mx.pad(x, widths) for x in stored)
                parts.append(stored)
            return parts, c.offset, c.left_padding + (max_idx - c._idx)

        (ours, offset, padding), (theirs, other_offset, other_padding) = map(
            pad, (self, other)
        )
        self.keys, self.values = (
            tuple(mx.concatenate([a, b]) for a, b in zip(mine, its))
            for mine, its in zip(ours, theirs)
        )
        self.offset = mx.concatenate([offset, other_offset])
        self.left_padding = mx.concatenate([padding, other_padding])
        self._idx = max_idx

    def extract(self, idx: int) -> QuantizedKVCache:
        cache = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        padding = self.left_padding.tolist()[idx]
        cache.keys, cache.values = (
            tuple(mx.contiguous(x[idx : idx + 1, :, padding : self._idx]) for x in part)
            for part in (self.keys, self.values)
        )
        cache.offset = self._idx - padding
        return cache

    @classmethod
    def merge(cls, caches: list) -> "BatchQuantizedKVCache":
        caches = [as_quantized(c) for c in caches]
        group_size, bits = caches[0].group_size, caches[0].bits
        lengths = [c.offset for c in caches]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        batch = cls(padding, group_size=group_size, bits=bits)
        if longest == 0:
            return batch
        template = next(c for c in caches if c.keys is not None)
        for name in ("keys", "values"):
            merged = tuple(
                mx.zeros((len(caches), x.shape[1], longest, x.shape[3]), x.dtype)
                for x in getattr(template, name)
            )
            for row, (p, c) in enumerate(zip(padding, caches)):
                if c.offset == 0:
                    continue
                for whole, x in zip(merged, getattr(c, name)):
                    whole[row : row + 1, :, p:] = x[..., : c.offset, :]
            setattr(batch, name, merged)
        batch.offset += longest
        batch._idx = longest
        return batch

    @property
    def nbytes(self) -> int:
        return _quantized_nbytes(self.keys, self.values)


def adopt(cache: list, template: list) -> list:
    """A KV cache read back as mlx-lm's classes (from a file) made the classes of
    ``template``, a new cache of the loaded model, so that it batches."""
    adopted = []
    for layer, kind in zip(cache, template):
        if type(layer) is lm_cache.QuantizedKVCache:
            layer = QuantizedKVCache.from_state(layer.state)
        elif type(layer) is KVCache and isinstance(kind, StagedKVCache):
            staged = StagedKVCache(kind.start, kind.group, kind.kv_bits)
            staged.state = layer.state
            layer = staged
        adopted.append(layer)
    return adopted


def _quantized_copy(cache: "StagedKVCache") -> QuantizedKVCache:
    quantized = QuantizedKVCache(group_size=cache.group, bits=cache.kv_bits)
    quantized.keys, quantized.values = _quantize_prefix(
        cache.keys, cache.values, cache.offset, cache.group, cache.kv_bits
    )
    quantized.offset = cache.offset
    return quantized


def as_quantized(cache) -> QuantizedKVCache:
    return _quantized_copy(cache) if isinstance(cache, StagedKVCache) else cache


class StagedKVCache(KVCache):
    """A KV cache kept at full precision until it holds ``start`` tokens, then
    quantized (mlx-lm's ``quantized_kv_start``).

    It becomes a ``QuantizedKVCache`` in place, since the model's layers hold it.
    Its settings are not named ``bits``: mlx-lm's attention would take that for a
    quantized cache.
    """

    def __init__(self, start: int = 0, group: int = 64, kv_bits: int = 8):
        super().__init__()
        self.start, self.group, self.kv_bits = start, group, kv_bits

    def update_and_fetch(self, keys, values):
        # As mlx-lm's generate_step: a step that reaches start still runs at full
        # precision; the cache is quantized before the next one.
        if self.offset < self.start:
            return super().update_and_fetch(keys, values)
        quantized = _quantized_copy(self)
        self.__class__ = QuantizedKVCache
        self.__dict__ = quantized.__dict__
        return self.update_and_fetch(keys, values)

    @classmethod
    def merge(cls, caches: list):
        if any(isinstance(c, QuantizedKVCache) for c in caches):
            return BatchQuantizedKVCache.merge(caches)
        first = caches[0]
        batch = BatchKVCache.merge(caches)
        staged = BatchStagedKVCache([], first.start, first.group, first.kv_bits)
        staged.__dict__.update(batch.__dict__)
        return staged


class BatchStagedKVCache(BatchKVCache):
    """A batch's ``StagedKVCache``: every row is quantized together, once the
    batch holds ``start`` positions."""

    def __init__(
        self, left_padding: list[int], start: int = 0, group: int = 64, kv_bits: int = 8
    ):
        super().__init__(left_padding)
        self.start, self.group, self.kv_bits = start, group, kv_bits

    def quantize(self) -> None:
        """Become a ``BatchQuantizedKVCache`` in place."""
        self.keys, self.values = _quantize_prefix(
            self.keys, self.values, self._idx, self.group, self.kv_bits
        )
        self.__class__ = BatchQuantizedKVCache
        self.group_size, self.bits = self.group, self.kv_bits

    def update_and_fetch(self, keys, values):
        if self._idx < self.start:
            return super().update_and_fetch(keys, values)
        self.quantize()
        return self.update_and_fetch(keys, values)

    def extend(self, other):
        if isinstance(other, BatchQuantizedKVCache):
            self.quantize()
            return self.extend(other)
        super().extend(other)

    def extract(self, idx: int) -> StagedKVCache:
        staged = StagedKVCache(self.start, self.group, self.kv_bits)
        staged.__dict__.update(super().extract(idx).__dict__)
        return staged
