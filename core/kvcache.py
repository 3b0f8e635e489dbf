"""The causal KV cache: preallocated cells, each tagged with a position and a sequence.

Several sequences share one cache. A batch's tokens are written into free cells, and attention
reads the used prefix of the cells through a mask built from the tags, so no sequence's keys are
ever copied or compacted.

Layers with global attention share one pool of cells; sliding-window layers (gemma3) share a
second, smaller pool that forgets a sequence's cells once they fall out of every future query's
window, so their memory is bounded by the window, not the context.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import numpy as np

from corral.errors import CacheFullError
from corral.model import Batch, CacheLayer
from corral.options import DEFAULT_KV_CACHE_TYPE, InvalidOptionError, checked_kv_cache_type

EMPTY = -1

log = logging.getLogger(__name__)


class UnsupportedKVCacheTypeError(InvalidOptionError):
    """The backend cannot hold this model's keys and values in the asked KV cache type (a 400: ask for f16)."""

    def __init__(self, cache_type: str, reason: str):
        super().__init__(f"kv_cache_type {cache_type}: {reason}; use f16")
        self.cache_type, self.reason = cache_type, reason


@attrs.frozen
class KVCacheFallback:
    """The server's KV cache type `asked`, replaced by f16 for a model that cannot take it, and why."""

    asked: str
    reason: str

    def warn(self, name: str = "") -> None:
        """Say so, naming the model `name`."""
        log.warning("%s: the KV cache type %s cannot hold this model's keys and values (%s); loading it with f16",
                    name or "the model", self.asked, self.reason)


def kv_cache_type_for(backend: Any, layers: list[CacheLayer], cache_type: str, *, fallback: bool = False) -> tuple[str, KVCacheFallback | None]:
    """`cache_type` if the backend can hold every layer's keys and values that way, and None.

    Otherwise, as Ollama treats OLLAMA_KV_CACHE_TYPE: with `fallback` (the type is a server-wide
    preference, not asked for this model) f16 and the KVCacheFallback saying why, for the caller to warn
    with once its load goes ahead; without it (a request or Modelfile asked for the type) UnsupportedKVCacheTypeError.
    """
    cache_type = checked_kv_cache_type(cache_type)
    try:
        for keys, values in CausalCache.buffer_shapes(layers, [1] * len(layers)):
            backend.kv_buffer_bytes(keys, cache_type)  # raises as kv_buffer would
            backend.kv_buffer_bytes(values, cache_type)
    except UnsupportedKVCacheTypeError as error:
        if not fallback:
            raise
        return DEFAULT_KV_CACHE_TYPE, KVCacheFallback(cache_type, error.reason)
    return cache_type, None


def usable_kv_cache_type(backend: Any, layers: list[CacheLayer], cache_type: str, *, fallback: bool = False, name: str = "") -> str:
    """`kv_cache_type_for`'s type, warning at once (naming the model `name`) when it fell back to f16."""
    used, replaced = kv_cache_type_for(backend, layers, cache_type, fallback=fallback)
    if replaced is not None:
        replaced.warn(name)
    return used


class CellPool:
    """Position and sequence tags of a set of cells shared by layers with the same window.

    With `region_size`, each sequence owns a contiguous region of that many cells, so its keys sit
    in the same cells, in the same order, whatever else is in the batch: attention then reads only
    its own region and gives bit-identical results alone or batched. Without it, all sequences
    share one region (fine for a single sequence).
    """

    def __init__(self, num_cells: int, window: int | None, region_size: int | None = None):
        self.window = window
        self.region_size = min(region_size or num_cells, num_cells)
        self.num_cells = self.usable_cells(num_cells, region_size)
        self.shared = region_size is None
        self.pos = np.full(self.num_cells, EMPTY, dtype=np.int64)
        self.seq = np.full(self.num_cells, EMPTY, dtype=np.int64)
        self.region_of: dict[int, int] = {}

    @staticmethod
    def usable_cells(num_cells: int, region_size: int | None) -> int:
        """Cells a pool of `num_cells` uses: whole regions only."""
        region_size = min(region_size or num_cells, num_cells)
        return num_cells - num_cells % region_size

    def allocate(self, batch: Batch) -> np.ndarray:
        """Claim a free cell in its sequence's region for each batch row and tag it."""
        if self.window is not None:
            self._forget_outside_window(batch)
        slots = np.empty(len(batch), dtype=np.int64)
        for seq in _in_order(batch.sequences):
            rows = np.flatnonzero(batch.sequences == seq)
            start = self.region(int(seq)) * self.region_size
            free = np.flatnonzero(self.seq[start : start + self.region_size] == EMPTY)
            if len(free) < len(rows):
                raise CacheFullError(
                    f"sequence {seq} has {len(free)} free KV cells but the batch needs {len(rows)}; raise num_ctx"
                )
            cells = free[: len(rows)] + start
            self.pos[cells] = batch.positions[rows]
            self.seq[cells] = seq
            slots[rows] = cells
        return slots

    def region(self, seq: int) -> int:
        """The region `seq` owns, assigned on first use."""
        if self.shared:
            return 0
        if seq not in self.region_of:
            taken = set(self.region_of.values())
            free = [r for r in range(self.num_cells // self.region_size) if r not in taken]
            if not free:
                raise CacheFullError("every KV cache region is in use; raise num_parallel")
            self.region_of[seq] = free[0]
        return self.region_of[seq]

    def _forget_outside_window(self, batch: Batch) -> None:
        # A cell stays useful while some future query of its sequence can still see it; queries
        # only move forward, so the batch's earliest query per sequence bounds what is needed.
        for seq in np.unique(batch.sequences):
            first_query = batch.positions[batch.sequences == seq].min()
            self.remove(int(seq), 0, int(first_query) - self.window + 1)

    def groups(self, batch: Batch, slots: np.ndarray | None = None) -> list[tuple[np.ndarray, int, int, np.ndarray]]:
        """Per sequence in the batch: its rows, its region's first cell, cells to read, and the mask.

        `slots`: the cells `allocate` gave the batch's rows; with `batch.blocks`, the rows of one
        block (an image) also see each other's cells, later ones included.
        """
        out = []
        for seq in _in_order(batch.sequences):
            rows = np.flatnonzero(batch.sequences == seq)
            start = self.region(int(seq)) * self.region_size
            region_seq = self.seq[start : start + self.region_size]
            used = int(np.flatnonzero(region_seq != EMPTY)[-1]) + 1
            pos, tags = self.pos[start : start + used], region_seq[:used]
            qpos = batch.positions[rows][:, None]
            visible = (tags[None, :] == seq) & (pos[None, :] <= qpos)
            if batch.blocks is not None and slots is not None:
                _see_own_block(visible, batch.blocks[rows], slots[rows] - start)
            if self.window is not None:
                visible &= qpos - pos[None, :] < self.window
            out.append((rows, start, used, visible))
        return out

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
        if seq in self.region_of and not (self.seq == seq).any():
            del self.region_of[seq]

    def positions(self, seq: int) -> np.ndarray:
        """Sorted positions `seq` holds in this pool."""
        return np.sort(self.pos[self.seq == seq])


def _see_own_block(visible: np.ndarray, blocks: np.ndarray, cells: np.ndarray) -> None:
    """Let each row of a block (id >= 0) see the cells of every row of its block in this batch."""
    same = (blocks[:, None] == blocks[None, :]) & (blocks[:, None] >= 0)
    rows, others = np.nonzero(same)
    visible[rows, cells[others]] = True


def _in_order(sequences: np.ndarray) -> list[int]:
    """Distinct sequence ids in order of first appearance."""
    _, first = np.unique(sequences, return_index=True)
    return [int(sequences[i]) for i in sorted(first)]


@attrs.frozen
class SeqGroup:
    """One sequence's share of a batch in one pool: its rows, and the region cells it attends to."""

    rows: Any  # slice or native int64 index of its batch rows
    start: int  # first cell of its region
    used: int  # attention reads cells [start, start + used)
    mask: Any  # native bool [len(rows), used], True where a key is visible; None when all are


@attrs.frozen
class CacheView:
    """What the attention op needs for one batch, per layer: where to write, and each sequence's keys."""

    cache: CausalCache
    slots: dict[int, Any]  # pool index -> cell of each batch row: a slice when consecutive, else native int64 [rows]
    groups: dict[int, list[SeqGroup]]  # pool index -> one group per sequence in the batch

    def keys(self, layer: int) -> Any:
        return self.cache.keys[layer]

    def values(self, layer: int) -> Any:
        return self.cache.values[layer]

    def layer_slots(self, layer: int) -> Any:
        return self.slots[self.cache.layer_pool[layer]]

    def layer_groups(self, layer: int) -> list[SeqGroup]:
        return self.groups[self.cache.layer_pool[layer]]

    @property
    def context_length(self) -> int:
        """The most positions one sequence can hold: num_ctx in a runtime's cache, the tokens of a one-off forward."""
        return max(pool.region_size for pool in self.cache.pools)


def runtime_cells(layers: list[CacheLayer], num_ctx: int, num_parallel: int, num_batch: int) -> tuple[int, int | None]:
    """A runtime's (global, sliding-window) pool sizes: num_ctx cells per sequence; a window and a batch."""
    windows = [layer.window for layer in layers if layer.window]
    window_cells = num_parallel * (max(windows) + num_batch) if windows else None
    return num_ctx * num_parallel, window_cells


class CausalCache:
    """Per-layer key/value buffers [kv_heads, cells, dim] over one cell pool per attention window.

    `num_cells` sizes the global pool (num_ctx x parallel sequences); a sliding-window pool gets
    `window_cells` (default: enough for every sequence's window plus a batch). With `num_seqs`,
    every pool is split into that many per-sequence regions (batch-invariant attention).
    `cache_type` (KV_CACHE_TYPES) says how the backend holds the buffers.
    """

    def __init__(
        self,
        backend: Any,
        layers: list[CacheLayer],
        num_cells: int,
        window_cells: int | None = None,
        num_seqs: int | None = None,
        cache_type: str = DEFAULT_KV_CACHE_TYPE,
    ):
        self.backend = backend
        self.layers = layers
        self.cache_type = checked_kv_cache_type(cache_type)
        windows = self._windows(layers)
        self.pools = []
        for window in windows:
            size = self._pool_size(window, num_cells, window_cells)
            self.pools.append(CellPool(size, window, size // num_seqs if num_seqs else None))
        self.layer_pool = [windows.index(layer.window) for layer in layers]
        self.keys, self.values = [], []
        for shapes in self.buffer_shapes(layers, [self.pools[pool].num_cells for pool in self.layer_pool]):
            self.keys.append(backend.kv_buffer(shapes[0], self.cache_type))
            self.values.append(backend.kv_buffer(shapes[1], self.cache_type))

    @classmethod
    def layer_cells(
        cls, layers: list[CacheLayer], num_cells: int, window_cells: int | None = None, num_seqs: int | None = None
    ) -> list[int]:
        """The cells each layer's buffers would hold in a cache of these sizes, without allocating it."""
        sizes = {}
        for window in cls._windows(layers):
            size = cls._pool_size(window, num_cells, window_cells)
            sizes[window] = CellPool.usable_cells(size, size // num_seqs if num_seqs else None)
        return [sizes[layer.window] for layer in layers]

    @staticmethod
    def buffer_shapes(layers: list[CacheLayer], cells: list[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """The (keys, values) buffer shapes of each layer holding `cells` of it."""
        return [
            ((layer.kv_heads, count, layer.key_dim), (layer.kv_heads, count, layer.value_dim))
            for layer, count in zip(layers, cells)
        ]

    @staticmethod
    def _windows(layers: list[CacheLayer]) -> list[int | None]:
        return sorted({layer.window for layer in layers}, key=lambda w: (w is not None, w or 0))

    @staticmethod
    def _pool_size(window: int | None, num_cells: int, window_cells: int | None) -> int:
        if window is None:
            return num_cells
        return min(num_cells, window_cells or num_cells)

    def prepare(self, batch: Batch) -> CacheView:
        """Claim cells for the batch's tokens in every pool and describe what each sequence attends to."""
        slots, groups = {}, {}
        for index, pool in enumerate(self.pools):
            cells = pool.allocate(batch)
            slots[index] = self._rows(cells)  # a decode row's cell is a slice: written in place
            groups[index] = [
                # Every used cell visible (a decode row without holes or window): no mask to apply.
                SeqGroup(self._rows(rows), start, used, None if mask.all() else self.backend.from_numpy(mask))
                for rows, start, used, mask in pool.groups(batch, cells)
            ]
        return CacheView(self, slots, groups)

    def _rows(self, rows: np.ndarray) -> Any:
        if len(rows) == 1 or (np.diff(rows) == 1).all():
            return slice(int(rows[0]), int(rows[-1]) + 1)  # consecutive: a view, no gather
        return self.backend.from_numpy(rows)

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
