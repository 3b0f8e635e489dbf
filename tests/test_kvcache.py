"""The causal KV cache with no model: cells tagged by sequence and position, masks, sliding windows, shifts."""

from __future__ import annotations

import numpy as np
import pytest

from corral.kvcache import CacheFullError, CausalCache
from corral.model import Batch, CacheLayer


class ArrayBackend:
    """The two backend calls CausalCache makes, on numpy arrays."""

    def kv_buffer(self, shape, cache_type="f16"):
        return np.zeros(shape, dtype=np.float32)

    def from_numpy(self, array):
        return np.asarray(array)


GLOBAL = CacheLayer(kv_heads=1, key_dim=2, value_dim=2)


def windowed(window):
    return CacheLayer(kv_heads=1, key_dim=2, value_dim=2, window=window)


def rows(tokens_per_seq: list[tuple[int, int, int]]) -> Batch:
    """A batch from (seq, first position, count) groups."""
    positions, seqs = [], []
    for seq, start, count in tokens_per_seq:
        positions += range(start, start + count)
        seqs += [seq] * count
    n = len(positions)
    return Batch(np.zeros(n, np.int64), np.array(positions, np.int64), np.array(seqs, np.int64), np.array([n - 1]))


def visible_keys(cache: CausalCache, view, pool: int, batch: Batch) -> list[list[tuple[int, int]]]:
    """For each batch row, the (sequence, position) of every cell it attends to in one pool.

    The one place that knows how a CacheView lays out its masks (one over the used cells, or one
    per sequence over that sequence's region), so the tests below state only what a query sees.
    """
    tags = cache.pools[pool]
    cells: list[np.ndarray] = [np.array([], dtype=np.int64)] * len(batch)
    if hasattr(view, "groups"):
        for group in view.groups[pool]:
            masks = np.ones((len(np.arange(len(batch))[group.rows]), group.used), bool) if group.mask is None else group.mask
            for row, mask in zip(np.arange(len(batch))[group.rows], np.asarray(masks)):
                cells[row] = group.start + np.flatnonzero(mask)
    else:
        for row, mask in enumerate(np.asarray(view.masks[pool])):
            cells[row] = np.flatnonzero(mask)
    return [sorted((int(tags.seq[c]), int(tags.pos[c])) for c in row) for row in cells]


def test_cache_mask_keeps_two_sequences_apart_and_causal():
    cache = CausalCache(ArrayBackend(), [GLOBAL], 8)
    batch = rows([(0, 0, 3), (1, 0, 2)])
    assert visible_keys(cache, cache.prepare(batch), 0, batch) == [
        [(0, 0)],
        [(0, 0), (0, 1)],
        [(0, 0), (0, 1), (0, 2)],
        [(1, 0)],
        [(1, 0), (1, 1)],
    ]


def test_cache_mask_of_a_later_step_sees_earlier_cells_of_its_own_sequence_only():
    cache = CausalCache(ArrayBackend(), [GLOBAL], 8)
    cache.prepare(rows([(0, 0, 2), (1, 0, 2)]))
    batch = rows([(1, 2, 1), (0, 2, 1)])
    assert visible_keys(cache, cache.prepare(batch), 0, batch) == [
        [(1, 0), (1, 1), (1, 2)],
        [(0, 0), (0, 1), (0, 2)],
    ]


def test_cache_writes_each_row_into_a_cell_tagged_with_its_sequence_and_position():
    cache = CausalCache(ArrayBackend(), [GLOBAL], 8)
    cache.prepare(rows([(0, 0, 2)]))
    batch = rows([(1, 0, 2), (0, 2, 1)])
    cells = cache.prepare(batch).layer_slots(0)
    cells = np.arange(8)[cells] if isinstance(cells, slice) else np.asarray(cells)
    pool = cache.pools[0]
    assert list(zip(pool.seq[cells].tolist(), pool.pos[cells].tolist())) == [(1, 0), (1, 1), (0, 2)]
    assert len(set(cells.tolist())) == 3


def test_cache_cells_of_interleaved_sequences_are_an_index_not_a_range():
    # rows A B A B of a shared pool take cells 0 2 1 3: spanning 4 cells, yet not in order
    cache = CausalCache(ArrayBackend(), [GLOBAL], 8)
    batch = Batch(np.zeros(4, np.int64), np.array([0, 0, 1, 1]), np.array([0, 1, 0, 1]), np.array([3]))
    cells = cache.prepare(batch).layer_slots(0)
    assert not isinstance(cells, slice)
    assert np.asarray(cells).tolist() == [0, 2, 1, 3]
    single = cache.prepare(rows([(0, 2, 1)])).layer_slots(0)
    assert single == slice(4, 5)


def test_cache_removed_cells_are_free_for_another_sequence():
    cache = CausalCache(ArrayBackend(), [GLOBAL], 6)
    cache.prepare(rows([(0, 0, 3), (1, 0, 3)]))
    with pytest.raises(CacheFullError, match="num_ctx"):
        cache.prepare(rows([(2, 0, 1)]))
    cache.remove(0)
    assert cache.used_cells() == 3 and cache.sequences() == {1}
    batch = rows([(2, 0, 3)])
    assert visible_keys(cache, cache.prepare(batch), 0, batch)[-1] == [(2, 0), (2, 1), (2, 2)]
    assert cache.sequences() == {1, 2}


def test_cache_remove_frees_a_position_range_only():
    cache = CausalCache(ArrayBackend(), [GLOBAL], 16)
    cache.prepare(rows([(0, 0, 8), (1, 0, 8)]))
    cache.remove(0, 2, 5)
    assert cache.positions(0).tolist() == [0, 1, 5, 6, 7]
    cache.remove(0, 6)
    assert cache.positions(0).tolist() == [0, 1, 5]
    assert cache.positions(1).tolist() == list(range(8))
    assert cache.used_cells() == 11


def test_sliding_window_pool_forgets_cells_no_future_query_can_see():
    cache = CausalCache(ArrayBackend(), [GLOBAL, windowed(3)], 16)
    cache.prepare(rows([(0, 0, 5)]))
    batch = rows([(0, 5, 1)])
    view = cache.prepare(batch)
    global_pool, window_pool = cache.pools
    assert global_pool.positions(0).tolist() == [0, 1, 2, 3, 4, 5]
    assert window_pool.positions(0).tolist() == [3, 4, 5]  # a query at 5 sees 3, 4 and itself
    assert visible_keys(cache, view, 1, batch) == [[(0, 3), (0, 4), (0, 5)]]
    assert visible_keys(cache, view, 0, batch) == [[(0, p) for p in range(6)]]
    assert cache.used_cells() == 9


def test_sliding_window_mask_within_a_prompt_chunk():
    cache = CausalCache(ArrayBackend(), [windowed(2)], 8)
    batch = rows([(0, 0, 4)])
    assert visible_keys(cache, cache.prepare(batch), 0, batch) == [
        [(0, 0)],
        [(0, 0), (0, 1)],
        [(0, 1), (0, 2)],
        [(0, 2), (0, 3)],
    ]


def test_sliding_window_forgetting_is_per_sequence():
    cache = CausalCache(ArrayBackend(), [windowed(2)], 16)
    cache.prepare(rows([(0, 0, 4), (1, 0, 2)]))
    cache.prepare(rows([(0, 4, 1)]))
    pool = cache.pools[0]
    assert pool.positions(0).tolist() == [3, 4]
    assert pool.positions(1).tolist() == [0, 1]  # seq 1 was not in the batch: nothing of it forgotten


def test_layers_share_a_pool_per_window():
    cache = CausalCache(ArrayBackend(), [windowed(4), GLOBAL, windowed(4), GLOBAL], 32, window_cells=10)
    assert [pool.window for pool in cache.pools] == [None, 4]
    assert cache.layer_pool == [1, 0, 1, 0]
    assert [pool.num_cells for pool in cache.pools] == [32, 10]
    assert cache.keys[0].shape == (1, 10, 2) and cache.keys[1].shape == (1, 32, 2)


def test_shift_positions_closes_the_gap_and_reports_the_moved_cells():
    cache = CausalCache(ArrayBackend(), [GLOBAL, windowed(100)], 32)
    cache.prepare(rows([(0, 0, 10), (1, 0, 10)]))
    cache.remove(0, 4, 7)
    moved = cache.shift_positions(0, 7, -3)
    assert cache.positions(0).tolist() == list(range(7))
    assert cache.positions(1).tolist() == list(range(10))  # another sequence is untouched
    for index, pool in enumerate(cache.pools):
        assert sorted(pool.pos[moved[index]].tolist()) == [4, 5, 6]
        assert set(pool.seq[moved[index]].tolist()) == {0}


def test_shifted_sequence_masks_by_its_new_positions():
    cache = CausalCache(ArrayBackend(), [GLOBAL], 16)
    cache.prepare(rows([(0, 0, 6)]))
    cache.remove(0, 2, 4)
    cache.shift_positions(0, 4, -2)
    batch = rows([(0, 4, 1)])
    assert visible_keys(cache, cache.prepare(batch), 0, batch) == [[(0, p) for p in range(5)]]
    assert cache.positions(0).tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    ("end", "expected"),
    [
        pytest.param(10, True, id="query-at-the-end-sees-only-held-cells"),
        pytest.param(9, True, id="needs-6-to-8"),
        pytest.param(8, False, id="needs-forgotten-5"),
        pytest.param(5, False, id="long-forgotten"),
        pytest.param(0, True, id="needs-nothing"),
    ],
)
def test_has_window_cells(end, expected):
    cache = CausalCache(ArrayBackend(), [GLOBAL, windowed(4)], 32)
    cache.prepare(rows([(0, 0, 9)]))
    cache.prepare(rows([(0, 9, 1)]))
    assert cache.pools[1].positions(0).tolist() == [6, 7, 8, 9]
    assert cache.has_window_cells(0, end) is expected


def test_has_window_cells_without_window_layers_is_always_true():
    cache = CausalCache(ArrayBackend(), [GLOBAL], 8)
    assert cache.has_window_cells(0, 5)
