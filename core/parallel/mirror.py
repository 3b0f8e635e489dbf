"""Rank 0's KV cache of a split (tensor- or pipeline-parallel) model: a CausalCache whose every change the other ranks replay.

Cache tags (which cell holds which sequence's position) are plain numpy state changed by a few
deterministic calls, so the other ranks keep identical tags by making the same calls in the same
order on their own caches, which hold only their KV heads (tensor parallelism) or their blocks'
layers (pipeline parallelism). Removals and context shifts are queued
and sent with the next step (`RankGroup.step`), so every collective of the model runs on one
thread at a time, in one order on every rank.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from corral.kvcache import CacheView, CausalCache
from corral.model import Batch, CacheLayer


class MirroredCache(CausalCache):
    """A CausalCache on rank 0 whose layout and changes ranks 1..N-1 mirror."""

    def __init__(
        self,
        ranks: Any,
        backend: Any,
        layers: list[CacheLayer],
        num_cells: int,
        window_cells: int | None = None,
        num_seqs: int | None = None,
        cache_type: str = "f16",
    ):
        super().__init__(backend, layers, num_cells, window_cells, num_seqs, cache_type)
        self.ranks = ranks
        self.id = ranks.new_cache_id()
        ranks.queue("cache", self.id, num_cells, window_cells, num_seqs, cache_type)  # each rank lays out its own part of the layers
        weakref.finalize(self, ranks.queue, "drop", self.id)

    def prepare(self, batch: Batch) -> CacheView:
        # Sent before rank 0 allocates: a batch that does not fit fails the same way everywhere.
        self.ranks.step("step", self.id, batch)
        return super().prepare(batch)

    def remove(self, seq: int, start: int = 0, end: int | None = None) -> None:
        self.ranks.queue("remove", self.id, seq, start, end)
        super().remove(seq, start, end)

    def shift_positions(self, seq: int, start: int, delta: int) -> dict[int, np.ndarray]:
        # The other ranks run all of shift_sequence (tags and their own keys' rotation) in order.
        self.ranks.queue("shift", self.id, seq, start, delta)
        return super().shift_positions(seq, start, delta)
