"""Sequence slots: at most `num_parallel` sequences at once, each slot remembering what its cache holds."""

from __future__ import annotations

from typing import Callable

import trio


class SlotPool:
    """Hands out slots in FIFO order of request, preferring the slot whose cache shares the longest prefix."""

    def __init__(self, count: int):
        self._free = list(range(count))
        self._tokens: dict[int, list[int]] = {slot: [] for slot in range(count)}
        self._available = trio.Semaphore(count)  # trio wakes waiters in FIFO order

    async def acquire(self, prompt: list[int], reusable: Callable[[int, list[int], list[int]], int]) -> tuple[int, int]:
        """Wait for a slot; return it and how many leading prompt tokens its cache already holds."""
        await self._available.acquire()
        # Longest reusable prefix first; among equals the slot released longest ago.
        scored = [(reusable(slot, self._tokens[slot], prompt), -order, slot) for order, slot in enumerate(self._free)]
        reused, _, slot = max(scored)
        self._free.remove(slot)
        return slot, reused

    def release(self, slot: int, cached_tokens: list[int]) -> None:
        """Return a slot; `cached_tokens` are what its cache cells still hold (empty if they were freed)."""
        self._tokens[slot] = list(cached_tokens)
        self._free.append(slot)
        self._available.release()

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot."""
        return self._available.statistics().tasks_waiting
