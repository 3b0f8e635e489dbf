"""Mixture-of-experts weights: a GGUF [experts, out, in] tensor kept packed, one linear layout per
expert over its own rows of the file, and ggml's mul_mat_id over them.

Each expert is loaded exactly like a linear of its type (int4, int8, dense), so a quantized expert
stack stays as compact as its linears and takes the same kernels. A step multiplies each selected
expert once, by the rows that chose it, and never touches the others: decode reads only the
experts its tokens routed to.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from corral.plugins.backends.torch.graph import WholeSequence


@attrs.frozen
class ExpertWeights:
    """The experts of one projection, each a linear layout (layouts.py) [out, in]."""

    experts: tuple[Any, ...]

    @property
    def nbytes(self) -> int:
        return sum(expert.nbytes for expert in self.experts)

    @property
    def out_features(self) -> int:
        return self.experts[0].out_features

    def matmul_selected(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        bias: torch.Tensor | None,
        runs: Sequence[tuple[int, int]] | None,
    ) -> torch.Tensor:
        """[n, k, out]: row r's slot j through expert ids[r, j], from x [n, in] (every slot reads its
        row) or [n, k, in] (each slot its own input); `bias` [experts, out] added per expert."""
        rows, slots = ids.shape
        chosen = ids.cpu()
        if rows == 1:
            return self._one_row(x, chosen[0].tolist(), bias)
        out = torch.empty((rows, slots, self.out_features), dtype=torch.float32, device=x.device)
        sequence_of = _sequence_of_rows(runs, rows)
        for expert in torch.unique(chosen).tolist():
            at_rows, at_slots = (chosen == expert).nonzero(as_tuple=True)  # row-major: rows ascending
            inputs = x[at_rows] if x.dim() == 2 else x[at_rows, at_slots]
            y = self.experts[expert].matmul(inputs, _runs_of(sequence_of, at_rows.tolist()))
            if bias is not None:
                y = y + bias[expert]
            out[at_rows.to(x.device), at_slots.to(x.device)] = y.float()
        return out

    def _one_row(self, x: torch.Tensor, chosen: list[int], bias: torch.Tensor | None) -> torch.Tensor:
        """A batch of one row (a lone decode step): each slot's expert straight on it, the same
        products as the general path's, without grouping rows by expert (a third of such a step's time)."""
        outputs = []
        for slot, expert in enumerate(chosen):
            y = self.experts[expert].matmul(x[0:1] if x.dim() == 2 else x[0:1, slot], [(0, 1)])
            outputs.append((y if bias is None else y + bias[expert]).float())
        return torch.stack(outputs, dim=1)

    def matmul_each(self, x: torch.Tensor, runs: Sequence[tuple[int, int]] | None) -> torch.Tensor:
        """[n, k, out]: slot j of x [n, k, in] through expert j, every expert over all rows (per-head
        projections); each product takes the batch's runs, so it is batch-invariant as a linear is."""
        return torch.stack([expert.matmul(x[:, j].contiguous(), runs).float() for j, expert in enumerate(self.experts)], dim=1)


def _sequence_of_rows(runs: Sequence[tuple[int, int]] | None, rows: int) -> list[int]:
    """Which run (sequence) each batch row belongs to; every row its own when the runs are unknown."""
    if runs is None:
        return list(range(rows))
    if isinstance(runs, WholeSequence):
        return [0] * rows
    owner = [0] * rows
    for index, (start, stop) in enumerate(runs):
        owner[start:stop] = [index] * (stop - start)
    return owner


def _runs_of(sequence_of: list[int], rows: list[int]) -> list[tuple[int, int]]:
    """The gathered rows' own runs: the rows of one sequence that chose the expert form a run, so an
    expert's product for a sequence is the call it would get were the sequence alone (batch invariance)."""
    runs, start = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or sequence_of[rows[i]] != sequence_of[rows[i - 1]]:
            runs.append((start, i))
            start = i
    return runs
