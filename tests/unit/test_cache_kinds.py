"""Cache kinds and what each path does with them: how the prompt cache reuses a
model's state (caches/kinds.py), where prefill keeps snapshots
(engine/scheduler.py), and how speculation holds and rolls back the layers that
can't be trimmed (decoders/speculative.py)."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from mlx_backend.caches.kinds import (
    NO_REUSE,
    REUSE_BY_SNAPSHOT,
    REUSE_BY_TRIM,
    cache_length,
    make_cache_kinds,
)
from mlx_backend.caches.quantized_kv import QuantizedKVCache
from mlx_backend.decoders.speculative import (
    best_draft_length,
    hold,
    replay_cost,
    roll_back,
)
from mlx_backend.engine.scheduler import snapshot_boundaries
from tests.tiny_models import FLAT


def fed(cache: list, n: int, start: int = 0) -> list:
    """``cache`` after ``n`` more positions: distinct keys and values in each
    attention layer, a new state in each recurrent one."""
    for layer in cache:
        if isinstance(layer, ArraysCache):
            layer[0] = mx.full((1, 4), float(start + n))
            continue
        x = mx.arange(start, start + n, dtype=mx.float32).reshape(1, 1, n, 1)
        layer.update_and_fetch(x, x + 0.5)
    return cache


def contents(cache: list) -> list:
    out = []
    for layer in cache:
        if isinstance(layer, ArraysCache):
            out.append(layer[0].tolist())
        else:
            keys, values = layer.state[:2]
            out.append((keys[..., : layer.size(), :].tolist(), layer.offset))
    return out


def test_growing_layers_are_reused_by_trimming():
    kinds = make_cache_kinds([KVCache(), QuantizedKVCache(), KVCache()])
    assert kinds.reuse == REUSE_BY_TRIM and not kinds.snapshots
    assert kinds.layers == (("KVCache", 2), ("QuantizedKVCache", 1))
    assert kinds.breakdown() == {
        "kv_cache_layers.KVCache": 2,
        "kv_cache_layers.QuantizedKVCache": 1,
        "prompt_reuse_by.trim": 1,
    }


@pytest.mark.parametrize(
    "layers",
    [
        [RotatingKVCache(max_size=8), KVCache()],
        [ArraysCache(2), KVCache()],
        [ArraysCache(2), ArraysCache(2)],
    ],
    ids=["window", "hybrid", "recurrent"],
)
def test_windows_and_recurrent_state_are_reused_from_snapshots(layers):
    kinds = make_cache_kinds(layers)
    assert kinds.reuse == REUSE_BY_SNAPSHOT and kinds.snapshots
    assert "snapshots at token boundaries" in kinds.describe()


def test_a_layer_of_another_kind_turns_reuse_off_and_says_why():
    class Custom:
        pass

    kinds = make_cache_kinds([KVCache(), Custom()])
    assert kinds.reuse == NO_REUSE
    assert "Custom" in kinds.why and "Custom" in kinds.describe()
    assert kinds.breakdown()["prompt_reuse_by.none"] == 1


def test_the_length_a_cache_holds():
    assert cache_length(fed([ArraysCache(1), KVCache()], 5)) == 5
    assert cache_length(fed([RotatingKVCache(max_size=4)], 9)) == 9
    # Recurrent state alone counts no positions.
    assert cache_length(fed([ArraysCache(1)], 5)) is None


@pytest.mark.parametrize(
    "reused, length, interval, expected",
    [
        (0, 100, 0, {99}),
        (0, 2500, 1024, {1024, 2048, 2499}),
        (1500, 2500, 1024, {2048, 2499}),
        (2048, 2049, 1024, set()),
        (0, 2048, 1024, {1024, 2047}),
    ],
)
def test_snapshot_boundaries(reused, length, interval, expected):
    assert snapshot_boundaries(reused, length, interval) == expected


def test_roll_back_restores_windows_and_state_and_trims_the_rest():
    cache = fed([RotatingKVCache(max_size=4), ArraysCache(1), KVCache()], 6)
    before = contents(cache)
    held = hold(cache)
    fed(cache, 3, start=6)
    assert contents(cache) != before
    roll_back(cache, held, 3)
    assert contents(cache) == before
    # The window goes on as if the rejected tokens had never run.
    fresh = fed([RotatingKVCache(max_size=4), ArraysCache(1), KVCache()], 6)
    fed(fresh, 1, start=6)
    fed(cache, 1, start=6)
    assert contents(cache) == contents(fresh)


def test_rollback_runs_the_kept_tokens_again_in_front_of_the_next_pass():
    costs = (1.0, 1.5, 2.0, 2.5)
    rate = 0.5
    # Accepting a of 2 proposals (a < 2) puts 1 + a tokens in front of the next
    # pass: one more token there costs 2.5 - 2.0; two don't fit the measured
    # passes and take a pass of their own.
    assert replay_cost(rate, 2, costs) == pytest.approx(0.5 * 0.5 + 0.25 * 1.5)
    # Where a longer pass costs no more, running the kept tokens again is free.
    assert replay_cost(rate, 2, FLAT) == 0
    # Each token in a pass costs a fifth of one: at 0.6 a rejected run costs
    # more than the kept tokens gain, at 0.9 it pays for fewer proposals.
    steep = tuple(1 + 0.2 * k for k in range(25))
    assert best_draft_length(0.6, steep, 8) > 0
    assert best_draft_length(0.6, steep, 8, rollback=True) == 0
    assert 0 < best_draft_length(0.9, steep, 8, rollback=True) < 7


def test_a_replay_leaves_room_for_fewer_proposals_and_weighs_what_they_add():
    steep = tuple(1 + 0.1 * k for k in range(25))
    assert best_draft_length(0.99, steep, 8, rollback=True, replay=20) == 4
    # What the replay costs is spent whatever is verified: a long one doesn't
    # make proposals dearer.
    alone = best_draft_length(0.9, steep, 8, rollback=True)
    assert best_draft_length(0.9, steep, 8, rollback=True, replay=10) == alone
