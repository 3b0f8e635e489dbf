"""The slot pool: fair waiting and the choice of the slot whose cached prefix is longest."""

from __future__ import annotations

import trio
import trio.testing

from corral.runner.slots import SlotPool


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
