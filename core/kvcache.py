"""The causal KV cache: preallocated cells per layer, each tagged with a position and a sequence.

Several sequences share one cache. A batch's tokens are written into free cells, and attention
reads the used prefix of the cells through a mask built from the tags, so no sequence's keys are
ever copied or compacted. Sliding-window layers use the same cells with a narrower mask.
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


@attrs.frozen
class CacheView:
    """What the attention op needs for one batch: where to write, how far to read, what to see."""

    cache: CausalCache
    slots: Any  # native int64 [n] cell index of each batch row
    used: int  # attention reads cells [0, used)
    masks: dict[int | None, Any]  # window -> native bool [n, used], True where a key is visible

    def keys(self, layer: int) -> Any:
        return self.cache.keys[layer]

    def values(self, layer: int) -> Any:
        return self.cache.values[layer]

    def mask(self, layer: int) -> Any:
        return self.masks[self.cache.layers[layer].window]


class CausalCache:
    """Per-layer key/value buffers [kv_heads, cells, dim] plus the cells' position and sequence tags."""

    def __init__(self, backend: Any, layers: list[CacheLayer], num_cells: int):
        self.backend = backend
        self.layers = layers
        self.num_cells = num_cells
        self.keys = [backend.kv_buffer((layer.kv_heads, num_cells, layer.key_dim)) for layer in layers]
        self.values = [backend.kv_buffer((layer.kv_heads, num_cells, layer.value_dim)) for layer in layers]
        self.cell_pos = np.full(num_cells, EMPTY, dtype=np.int64)
        self.cell_seq = np.full(num_cells, EMPTY, dtype=np.int64)

    def prepare(self, batch: Batch) -> CacheView:
        """Claim cells for the batch's tokens and build the attention masks."""
        free = np.flatnonzero(self.cell_seq == EMPTY)
        if len(free) < len(batch):
            raise CacheFullError(
                f"the KV cache has {len(free)} free cells but the batch needs {len(batch)}; raise num_ctx"
            )
        slots = free[: len(batch)]
        self.cell_pos[slots] = batch.positions
        self.cell_seq[slots] = batch.sequences
        used = int(np.flatnonzero(self.cell_seq != EMPTY)[-1]) + 1
        windows = {layer.window for layer in self.layers}
        masks = {window: self.backend.from_numpy(self._mask(batch, used, window)) for window in windows}
        return CacheView(self, self.backend.from_numpy(slots), used, masks)

    def _mask(self, batch: Batch, used: int, window: int | None) -> np.ndarray:
        pos, seq = self.cell_pos[None, :used], self.cell_seq[None, :used]
        qpos = batch.positions[:, None]
        visible = (seq == batch.sequences[:, None]) & (pos <= qpos)
        if window is not None:
            visible &= qpos - pos < window
        return visible

    def remove(self, seq: int, start: int = 0, end: int | None = None) -> None:
        """Free the cells of `seq` whose positions are in [start, end)."""
        hit = (self.cell_seq == seq) & (self.cell_pos >= start)
        if end is not None:
            hit &= self.cell_pos < end
        self.cell_seq[hit] = EMPTY
        self.cell_pos[hit] = EMPTY

    def used_cells(self) -> int:
        """How many cells hold a token."""
        return int(np.count_nonzero(self.cell_seq != EMPTY))
