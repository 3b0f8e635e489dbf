"""Top-k over a large vocabulary, in two stages.

The k blocks of BLOCK values with the largest maxima hold every value of a row's top k (a block
without one has a maximum below the k-th value), so one topk over the block maxima and one over
those blocks' values replace a topk over the whole row, much faster for a large vocabulary
(measured: BENCHMARKS.md, Measurements behind code decisions). Used for the logits' exact
candidates and by the sampler's top-k.
"""

from __future__ import annotations

import torch

# The fastest block for 49k and 262k vocabularies
# (measured: BENCHMARKS.md, Measurements behind code decisions).
BLOCK = 32


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row of x [rows, n] and their indices, largest first (as
    torch.topk; which of equal values at the k-th place are chosen may differ)."""
    rows, n = x.shape
    if n % BLOCK or n // BLOCK < 4 * k:
        return torch.topk(x, k, dim=-1)
    blocks = x.view(rows, n // BLOCK, BLOCK)
    chosen = blocks.amax(dim=-1).topk(k, dim=-1).indices  # [rows, k]
    values = blocks.gather(1, chosen[..., None].expand(-1, -1, BLOCK)).view(rows, -1)
    best, at = values.topk(k, dim=-1)  # positions among the chosen blocks' values
    return best, chosen.gather(1, at // BLOCK) * BLOCK + at % BLOCK
