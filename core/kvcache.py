"""The causal KV cache: preallocated cells, each tagged with a position and a sequence.

Several sequences share one cache. A batch's tokens are written into free cells, and attention
reads the used prefix of the cells through a mask built from the tags, so no sequence's keys are
ever copied or compacted.

Layers with global attention share one pool of cells; sliding-window layers (gemma3) share a
second, smaller pool that forgets a sequence's cells once they fall out of every future query's
window, so their memory is bounded by the window, not the context.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from corral.errors import CorralError
from corral.model import Batch, CacheLayer

EMPTY = -1


class CacheFullError(CorralError):
    """No free cells for the batch; the context is full."""


class CellPool:
    """Position and sequence tags of a set of cells shared by layers with the same window."""

    def __init__(self, num_cells: int, window: int | None):
        self.num_cells = num_cells
        self.window = window
        self.pos = np.full(num_cells, EMPTY, dtype=np.int64)
        self.seq = np.full(num_cells, EMPTY, dtype=np.int64)

    def allocate(self, batch: Batch) -> np.ndarray:
        """Claim a free cell for each batch row and tag it."""
        if self.window is not None:
            self._forget_outside_window(batch)
        free = np.flatnonzero(self.seq == EMPTY)
        if len(free) < len(batch):
            raise CacheFullError(
                f"the KV cache has {len(free)} free cells but the batch needs {len(batch)}; raise num_ctx"
            )
        slots = free[: len(batch)]
        self.pos[slots] = batch.positions
        self.seq[slots] = batch.sequences
        return slots

    def _forget_outside_window(self, batch: Batch) -> None:
        # A cell stays useful while some future query of its sequence can still see it; queries
        # only move forward, so the batch's earliest query per sequence bounds what is needed.
        for seq in np.unique(batch.sequences):
            first_query = batch.positions[batch.sequences == seq].min()
            self.remove(int(seq), 0, int(first_query) - self.window + 1)

    def used(self) -> int:
        """Attention reads cells [0, used)."""
        taken = np.flatnonzero(self.seq != EMPTY)
        return int(taken[-1]) + 1 if len(taken) else 0

    def mask(self, batch: Batch, used: int) -> np.ndarray:
        """[rows, used] True where the row's query may attend to the cell."""
        pos, seq = self.pos[None, :used], self.seq[None, :used]
        qpos = batch.positions[:, None]
        visible = (seq == batch.sequences[:, None]) & (pos <= qpos)
        if self.window is not None:
            visible &= qpos - pos < self.window
        return visible

    def cells(self, seq: int, start: int = 0, end: int | None = None) -> np.ndarray:
        """Indices of the cells of `seq` with positions in [start, end)."""
        hit = (self.seq == seq) & (self.pos >= start)
        if end is not None:
            hit &= self.pos < end
        return np.flatnonzero(hit)

    def remove(self, seq: int, start: int = 0, end: int | None = None) -> None:
        cells = self.cells(seq, start, end)
        self.seq[cells] = EMPTY
        self.pos[cells] = EMPTY

    def positions(self, seq: int) -> np.ndarray:
        """Sorted positions `seq` holds in this pool."""
        return np.sort(self.pos[self.seq == seq])


@attrs.frozen
class CacheView:
    """What the attention op needs for one batch, per layer: where to write, how far to read, what to see."""

    cache: CausalCache
    slots: dict[int, Any]  # pool index -> native int64 [rows] cell of each batch row
    used: dict[int, int]  # pool index -> attention reads cells [0, used)
    masks: dict[int, Any]  # pool index -> native bool [rows, used]

    def keys(self, layer: int) -> Any:
        return self.cache.keys[layer]

    def values(self, layer: int) -> Any:
        return self.cache.values[layer]

    def layer_slots(self, layer: int) -> Any:
        return self.slots[self.cache.layer_pool[layer]]

    def layer_used(self, layer: int) -> int:
        return self.used[self.cache.layer_pool[layer]]

    def mask(self, layer: int) -> Any:
        return self.masks[self.cache.layer_pool[layer]]


class CausalCache:
    """Per-layer key/value buffers [kv_heads, cells, dim] over one cell pool per attention window.

    `num_cells` sizes the global pool (num_ctx x parallel sequences); a sliding-window pool gets
    `window_cells` (default: enough for every sequence's window plus a batch).
    """

    def __init__(self, backend: Any, layers: list[CacheLayer], num_cells: int, window_cells: int | None = None):
        self.backend = backend
        self.layers = layers
        windows = sorted({layer.window for layer in layers}, key=lambda w: (w is not None, w or 0))
        self.pools = [CellPool(self._pool_size(w, num_cells, window_cells), w) for w in windows]
        self.layer_pool = [windows.index(layer.window) for layer in layers]
        self.keys, self.values = [], []
        for layer, pool in zip(layers, self.layer_pool):
            cells = self.pools[pool].num_cells
            self.keys.append(backend.kv_buffer((layer.kv_heads, cells, layer.key_dim)))
            self.values.append(backend.kv_buffer((layer.kv_heads, cells, layer.value_dim)))

    @staticmethod
    def _pool_size(window: int | None, num_cells: int, window_cells: int | None) -> int:
        if window is None:
            return num_cells
        return min(num_cells, window_cells or num_cells)

    def prepare(self, batch: Batch) -> CacheView:
        """Claim cells for the batch's tokens in every pool and build the attention masks."""
        slots, used, masks = {}, {}, {}
        for index, pool in enumerate(self.pools):
            cells = pool.allocate(batch)
            used[index] = pool.used()
            slots[index] = self.backend.from_numpy(cells)
            masks[index] = self.backend.from_numpy(pool.mask(batch, used[index]))
        return CacheView(self, slots, used, masks)

    def remove(self, seq: int, start: int = 0, end: int | None = None) -> None:
        """Free the cells of `seq` whose positions are in [start, end)."""
        for pool in self.pools:
            pool.remove(seq, start, end)

    def shift_positions(self, seq: int, start: int, delta: int) -> dict[int, np.ndarray]:
        """Move the positions of `seq`'s cells at >= start by `delta`; returns the moved cells per pool.

        The caller re-rotates those cells' keys (the model knows its RoPE), see `CacheShifter`.
        """
        moved = {}
        for index, pool in enumerate(self.pools):
            cells = pool.cells(seq, start)
            pool.pos[cells] += delta
            moved[index] = cells
        return moved

    def positions(self, seq: int) -> np.ndarray:
        """Positions `seq` holds in the global pool (every position a sequence has computed)."""
        return self.pools[0].positions(seq)

    def has_window_cells(self, seq: int, end: int) -> bool:
        """Whether every sliding-window pool still holds what a query at position `end` would see."""
        for pool in self.pools:
            if pool.window is None:
                continue
            needed = np.arange(max(0, end - pool.window + 1), end)
            if not np.isin(needed, pool.positions(seq)).all():
                return False
        return True

    def used_cells(self) -> int:
        """How many cells hold a token, over all pools."""
        return int(sum(np.count_nonzero(pool.seq != EMPTY) for pool in self.pools))

    def sequences(self) -> set[int]:
        """Sequences with at least one cell."""
        return {int(s) for pool in self.pools for s in np.unique(pool.seq) if s != EMPTY}


def shift_sequence(model: Any, cache: CausalCache, seq: int, start: int, delta: int) -> None:
    """Move `seq`'s tokens at positions >= start by `delta` and re-rotate their keys to match."""
    moved = cache.shift_positions(seq, start, delta)
    backend = cache.backend
    ctx = backend.new_context()
    outputs = []
    for layer, pool in enumerate(cache.layer_pool):
        cells = moved[pool]
        if not len(cells):
            continue
        cells_in = ctx.input(cells)
        keys = ctx.cached_keys(cache.keys[layer], cells_in)
        rotated = model.shift_keys(ctx, layer, keys, ctx.input(np.full(len(cells), delta, dtype=np.int64)))
        outputs.append(ctx.store_keys(cache.keys[layer], cells_in, rotated))
    if outputs:
        ctx.compute(*outputs)
