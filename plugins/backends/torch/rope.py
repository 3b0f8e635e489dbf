"""The native rope's rotation table: computed once for the positions a model has reached, then looked up.

`context._rope_table` builds each step's cos/sin rows through the batch-invariant elementwise path
(elementwise.py), which pads a decode step's few dozen angles into whole blocks: a dozen kernels a
table, a few hundred microseconds a step, the same for every step at the same position. An
element's value does not depend on the tensor around it there, so rows computed for many positions
at once have the same bits as the rows one step computes for its own: a step can read its rows from
a table of every position so far. The table grows by doubling, and stops growing at MAX_BYTES
(positions past it are computed at each step, as before).

Both rope kinds are kept as (cos, sin) pairs [positions, dims / 2, 2], magnitude applied; the native
kernel (native/common/rope.c) reads halves (NeoX) from the same pairs.
"""

from __future__ import annotations

from typing import Any

import torch

from corral.ml import Rope

MAX_BYTES = 8 << 20  # a table's largest size: 8192 positions of gemma3's 256 rotated features
FIRST_ROWS = 256


class RopeRows:
    """One rope's table of (cos, sin) pairs by position (one for each LongRoPE factor set);
    `rows(positions, view)` looks a batch's rows up."""

    def __init__(self, rope: Rope, compute: Any):
        self.rope, self._compute = rope, compute  # compute(positions, rope, view): context._rope_table
        self._pairs: dict[bool, torch.Tensor] = {}  # long factors or not -> [positions, dims / 2, 2]
        self.limit = max(FIRST_ROWS, MAX_BYTES // (4 * rope.dims))

    def rows(self, positions: torch.Tensor, view: Any = None) -> torch.Tensor:
        """The pairs of `positions` [n] as [n, 1, dims / 2, 2] float32."""
        low, top = (int(v) for v in torch.aminmax(positions)) if positions.numel() else (-1, 0)
        top += 1
        if low < 0 or top > self.limit:  # past the table, or no rows, or turning back (a context shift's keys)
            return pairs_of(self._compute(positions, self.rope, view), self.rope.neox)
        long = uses_long_factors(self.rope, view)
        pairs = self._pairs.get(long)
        have = 0 if pairs is None else pairs.shape[0]
        if top > have:
            size = min(self.limit, max(FIRST_ROWS, 2 * have, top))
            new = pairs_of(self._compute(torch.arange(have, size, device=positions.device), self.rope, view), self.rope.neox)[:, 0]
            pairs = self._pairs[long] = new if pairs is None else torch.cat((pairs, new))
        return pairs.index_select(0, positions).unsqueeze(1)


def pairs_of(table: Any, neox: bool) -> torch.Tensor:
    """A `context._rope_table` result [n, 1, ...] as (cos, sin) pairs [n, 1, dims / 2, 2]."""
    if not neox:
        return torch.view_as_real(table).contiguous()
    cos, signed_sin = table
    half = cos.shape[-1] // 2
    return torch.stack((cos[..., :half], signed_sin[..., half:]), dim=-1).contiguous()


def uses_long_factors(rope: Rope, view: Any) -> bool:
    """Whether LongRoPE's long factors rotate a graph over this cache view (as `_rope_table` decides)."""
    return rope.long_factors is not None and view is not None and view.context_length > rope.original_context
