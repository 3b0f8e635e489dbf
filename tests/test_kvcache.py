"""The runtime's pure parts, with no model: step planning, batch building, stop strings, slots, the KV cache."""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing

from corral.kvcache import CacheFullError, CausalCache
from corral.model import Batch, CacheLayer
from corral.runner.batching import EVENT_BUFFER, Sequence, build_batch, plan_step
from corral.runner.slots import SlotPool
from corral.runner.stop import StopMatcher

# -- plan_step and build_batch ---------------------------------------------------------------------


def make_seq(id, pending, position=0, generated=0, buffered=0, finished=False) -> Sequence:
    """A Sequence as the batching actor sees it; `buffered` events wait unread in its channel."""
    send, _ = trio.open_memory_channel(EVENT_BUFFER + 2)
    for _ in range(buffered):
        send.send_nowait(None)
    seq = Sequence(id=id, prompt=list(pending), pending=list(pending), position=position, sampler=None, events=send)
    seq.generated, seq.finished = generated, finished
    return seq


def prefill(id, n, position=0):
    return make_seq(id, list(range(100 + id * 10, 100 + id * 10 + n)), position)


def decode(id, position=20, **kw):
    return make_seq(id, [7 + id], position, generated=3, **kw)


@pytest.mark.parametrize(
    ("sequences", "budget", "expected"),
    [
        pytest.param([prefill(0, 10), decode(1), decode(2)], 512, [(1, 1), (2, 1), (0, 10)], id="decodes-before-prefill"),
        pytest.param([prefill(0, 10), prefill(1, 10)], 15, [(0, 10)], id="a-chunk-that-does-not-fit-waits"),
        pytest.param([prefill(0, 4), prefill(1, 3)], 16, [(0, 4), (1, 3)], id="small-prompts-share-a-step"),
        pytest.param([prefill(0, 40), prefill(1, 3)], 16, [(0, 16)], id="long-prompt-takes-the-budget-in-order"),
        pytest.param([decode(0), decode(1), decode(2), prefill(3, 4)], 2, [(0, 1), (1, 1), (2, 1), (3, 2)], id="every-decode-runs-beside-the-budget"),
        pytest.param([decode(0), decode(1), prefill(2, 4)], 3, [(0, 1), (1, 1), (2, 3)], id="prompt-chunks-are-budget-sized"),
        pytest.param([prefill(0, 2), prefill(1, 4)], 3, [(0, 2)], id="a-chunk-is-never-split-by-leftovers"),
        pytest.param([decode(0, buffered=EVENT_BUFFER), decode(1)], 8, [(1, 1)], id="paused-reader-skipped"),
        pytest.param([decode(0, buffered=EVENT_BUFFER - 1), decode(1)], 8, [(0, 1), (1, 1)], id="almost-paused-still-runs"),
        pytest.param([decode(0, finished=True), prefill(1, 2)], 8, [(1, 2)], id="finished-skipped"),
        pytest.param([make_seq(0, []), decode(1)], 8, [(1, 1)], id="nothing-pending-skipped"),
        pytest.param([prefill(0, 3), make_seq(1, [9], position=5)], 8, [(0, 3), (1, 1)], id="one-token-prompt-is-not-a-decode"),
        pytest.param([], 8, [], id="no-sequences"),
    ],
)
def test_plan_step(sequences, budget, expected):
    plan = plan_step(sequences, budget)
    assert [(seq.id, count) for seq, count in plan] == expected
    prompt_tokens = sum(count for seq, count in plan if not seq.decoding)
    assert prompt_tokens <= budget  # decode tokens ride on top of the budget


def test_plan_step_starts_a_long_prompt_while_another_sequence_decodes():
    waiting = prefill(1, 40)
    plan = plan_step([decode(0), waiting], 16)
    assert [(seq.id, count) for seq, count in plan] == [(0, 1), (1, 16)]


def test_build_batch_rows_positions_and_sequences_follow_the_plan():
    a, b = make_seq(0, [11, 12, 13, 14], position=2), decode(1, position=30)
    batch, _ = build_batch([(b, 1), (a, 3)])
    assert batch.inputs.tolist() == [8, 11, 12, 13]
    assert batch.positions.tolist() == [30, 2, 3, 4]
    assert batch.sequences.tolist() == [1, 0, 0, 0]
    assert all(array.dtype == np.int64 for array in (batch.inputs, batch.positions, batch.sequences, batch.outputs))


@pytest.mark.parametrize(
    ("counts", "pending", "outputs", "emitting"),
    [
        pytest.param([1, 4], [1, 4], [0, 4], [0, 1], id="all-consumed-every-sequence-emits"),
        pytest.param([1, 3], [1, 4], [0], [0], id="partial-prompt-chunk-no-output"),
        pytest.param([2, 1], [4, 1], [2], [1], id="only-the-completed-one"),
        pytest.param([3, 2], [5, 6], [], [], id="both-partial"),
    ],
)
def test_build_batch_outputs_only_where_pending_tokens_are_consumed(counts, pending, outputs, emitting):
    seqs = [make_seq(i, list(range(n)), generated=int(n == 1)) for i, n in enumerate(pending)]
    batch, emitters = build_batch(list(zip(seqs, counts)))
    assert batch.outputs.tolist() == outputs
    assert [seq.id for seq in emitters] == emitting


# -- StopMatcher -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stops", "pieces", "expected"),
    [
        pytest.param([], ["a", "b<"], [("a", False), ("b<", False)], id="no-stops-pass-through"),
        pytest.param(["</s>"], ["Hello <", "/", "x"], [("Hello ", False), ("", False), ("</x", False)], id="partial-held-then-released"),
        pytest.param(["</s>"], ["Hi <", "/s", "> bye"], [("Hi ", False), ("", False), ("", True)], id="spans-three-pieces"),
        pytest.param(["STOP"], ["STOP and more"], [("", True)], id="stop-at-the-very-start"),
        pytest.param(["END", "STOP"], ["one STOP two END"], [("one ", True)], id="earliest-of-several-stops"),
        pytest.param(["END", "STOP"], ["x ST", "O", "P"], [("x ", False), ("", False), ("", True)], id="second-stop-spans"),
        pytest.param(["ab", "bc"], ["xb", "c"], [("x", False), ("", True)], id="overlapping-stops"),
        pytest.param(["aab"], ["aaa", "b"], [("a", False), ("", True)], id="longest-partial-suffix-held"),
        pytest.param(["abc", "b"], ["ab"], [("a", True)], id="shorter-stop-inside-a-partial-longer-one"),
        pytest.param(["", "!"], ["hi", "!"], [("hi", False), ("", True)], id="empty-stop-ignored"),
    ],
)
def test_stop_matcher(stops, pieces, expected):
    matcher = StopMatcher(stops)
    assert [matcher.push(piece) for piece in pieces] == expected


def test_stop_matcher_flush_releases_held_text():
    matcher = StopMatcher(["world!"])
    assert matcher.push("hello wor") == ("hello ", False)
    assert matcher.flush() == "wor"
    assert matcher.flush() == ""


def test_stop_matcher_never_emits_part_of_the_stop_text():
    text, stop = "the cat sat on the mat", "on the"
    matcher = StopMatcher([stop])
    emitted, stopped = "", False
    for char in text:
        piece, stopped = matcher.push(char)
        emitted += piece
        if stopped:
            break
    assert stopped
    assert emitted == "the cat sat "


# -- SlotPool ----------------------------------------------------------------------------------------


def common_prefix(slot, tokens, prompt):
    n = 0
    for a, b in zip(tokens, prompt):
        if a != b:
            break
        n += 1
    return n


async def test_slot_pool_hands_out_every_slot_then_makes_requests_wait(autojump_clock):
    pool = SlotPool(2)
    first = await pool.acquire([1], common_prefix)
    second = await pool.acquire([1], common_prefix)
    assert {first[0], second[0]} == {0, 1} and pool.free == 0
    with trio.move_on_after(60) as scope:  # nothing else can release a slot
        await pool.acquire([1], common_prefix)
    assert scope.cancelled_caught


async def test_slot_pool_serves_waiters_in_request_order():
    pool = SlotPool(1)
    held, _ = await pool.acquire([], common_prefix)
    order = []

    async def wait(name):
        slot, _ = await pool.acquire([], common_prefix)
        order.append(name)
        pool.release(slot, [])

    async with trio.open_nursery() as nursery:
        for name in "abcd":
            nursery.start_soon(wait, name)
            await trio.testing.wait_all_tasks_blocked()  # each waiter queues before the next starts
        pool.release(held, [])
    assert order == list("abcd")


async def test_slot_pool_prefers_the_longest_reusable_prefix():
    pool = SlotPool(3)
    for _ in range(3):
        await pool.acquire([], common_prefix)
    pool.release(0, [1, 2])
    pool.release(1, [1, 2, 3, 4])
    pool.release(2, [9])
    assert await pool.acquire([1, 2, 3, 5], common_prefix) == (1, 3)
    assert await pool.acquire([1, 7], common_prefix) == (0, 1)
    assert pool.free == 1


async def test_slot_pool_among_equal_prefixes_takes_the_slot_released_longest_ago():
    pool = SlotPool(3)
    for _ in range(3):
        await pool.acquire([], common_prefix)
    for slot in (2, 0, 1):
        pool.release(slot, [5])
    assert (await pool.acquire([6], common_prefix))[0] == 2
    assert (await pool.acquire([6], common_prefix))[0] == 0


async def test_slot_pool_forgets_cached_tokens_released_as_empty():
    pool = SlotPool(1)
    slot, _ = await pool.acquire([1, 2, 3], common_prefix)
    pool.release(slot, [1, 2, 3])
    slot, _ = await pool.acquire([1, 2, 3], common_prefix)
    pool.release(slot, [])  # cancelled: its cells were freed
    assert await pool.acquire([1, 2, 3], common_prefix) == (0, 0)


# -- CausalCache ---------------------------------------------------------------------------------------


class ArrayBackend:
    """The two backend calls CausalCache makes, on numpy arrays."""

    def kv_buffer(self, shape):
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
