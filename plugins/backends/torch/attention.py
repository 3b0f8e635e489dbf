"""The torch backend's attention over the KV cache, one sequence's cells at a time.

Batch invariance: a row's attention reads only its own sequence's region of the cache (see
core/kvcache.py), through a call whose result cannot depend on what else is in the batch. With the
native kernel (CPU), every row of the batch, prompt or decode, is one call that computes each
(row, kv head) on its own in float32. Otherwise: one SDPA call per sequence, or one call for the
decode rows of sequences reading the same number of cells; which path and dtype a sequence takes
depends only on its own rows and cells.

A quantized cache (kv_cells.py) takes the SDPA path: each call dequantizes the cells it reads,
which are the same cells, giving the same bits, alone or batched.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from corral.plugins.backends.torch import native
from corral.plugins.backends.torch.kv_cells import QuantizedCells, read_cells, write_cells

# Query rows of one sequence from which its attention runs in float32 (see _compute_dtype).
FLOAT_ATTENTION_ROWS = 32


class AttentionMemo:
    """What the attention ops of one graph keep from call to call: whether the native kernel takes
    each shape (fixed for a model), and the last step's regions: every layer of a pool shares its
    groups and cells, so they are built once per step, not once per layer (the references kept
    make the identity test sound)."""

    __slots__ = ("takes", "groups", "cells", "regions")

    def __init__(self) -> None:
        self.takes: dict[tuple, bool] = {}
        self.groups = self.cells = self.regions = None

    def takes_row_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """native.takes_row_attention, once per shape."""
        key = (q.shape[1:], keys.shape, keys.dtype, keys.device.type, values.shape, values.dtype)
        takes = self.takes.get(key)
        if takes is None:
            takes = self.takes[key] = native.takes_row_attention(q, keys, values)
        return takes

    def row_regions(self, groups: list[Any], cells: Any, rows: int) -> tuple[Any, bool]:
        """The native kernel's regions of every row, and whether the rows are all decode rows in
        order (then each row's new key and value go to its cell inside the call)."""
        if self.groups is groups and self.cells is cells:
            return self.regions
        decode_only = all(_row_count(group.rows) == 1 for group in groups) and _in_row_order(groups, rows)
        dest = None
        if decode_only:
            dest = list(range(cells.start, cells.start + rows)) if isinstance(cells, slice) else cells.tolist()
        self.groups, self.cells = groups, cells
        self.regions = (native.attention_regions(groups, rows, dest), decode_only)
        return self.regions


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: Any,
    layer: int,
    scale: float,
    memo: AttentionMemo | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Store the batch's k/v [n, kv_heads, dim] in its cells of `layer`, then each row's attention
    over its sequence's cells: [n, heads * dim] in the cache's dtype. `memo`: the graph's (see
    AttentionMemo); `softcap` and `sinks` as ml.Context.attention says."""
    keys, values = cache.keys(layer), cache.values(layer)  # [kv_heads, cells, dim]
    cells = cache.layer_slots(layer)
    groups = cache.layer_groups(layer)
    if memo is None:
        memo = AttentionMemo()
    if softcap is not None or sinks is not None:
        write_cells(keys, cells, k)
        write_cells(values, cells, v)
        return _scored_attention(q, keys, values, groups, scale, softcap, sinks)
    quantized = isinstance(keys, QuantizedCells)
    if not quantized and memo.takes_row_attention(q, keys, values):
        regions, decode_only = memo.row_regions(groups, cells, q.shape[0])
        if decode_only:
            # Decode rows only: the kernel stores their keys and values itself (one call, not three).
            return native.row_attention(q, keys, values, regions, scale, (k, v)).reshape(q.shape[0], -1)
        write_cells(keys, cells, k)
        write_cells(values, cells, v)
        return native.row_attention(q, keys, values, regions, scale).reshape(q.shape[0], -1)
    write_cells(keys, cells, k)
    write_cells(values, cells, v)
    gqa = q.shape[1] != k.shape[1]
    # Decode rows of sequences in step share a call; every other sequence gets its own.
    if len(groups) == 1:  # one sequence (batch-1 decode, a lone prompt): no bookkeeping
        (group,) = groups
        queries = q.to(_compute_dtype(q.shape[0], keys.dtype)).transpose(0, 1).unsqueeze(0)
        return _sequence_attention(queries, keys, values, group, scale, gqa).reshape(q.shape[0], -1)
    attended: list[Any] = [None] * len(groups)
    for members in _decode_batches(groups):
        results = _decode_attention(q, keys, values, [groups[i] for i in members], scale, gqa)
        for i, result in zip(members, results):
            attended[i] = result
    alone = [i for i, result in enumerate(attended) if result is None]
    dtypes = {i: _compute_dtype(_row_count(groups[i].rows), keys.dtype) for i in alone}
    queries = {dtype: q.to(dtype).transpose(0, 1).unsqueeze(0) for dtype in set(dtypes.values())}  # [1, heads, n, dim]
    for i in alone:
        attended[i] = _sequence_attention(queries[dtypes[i]][:, :, groups[i].rows], keys, values, groups[i], scale, gqa)
    if _in_row_order(groups, q.shape[0]):
        out = attended[0] if len(attended) == 1 else torch.cat(attended)
    else:
        out = q.new_empty((q.shape[0], q.shape[1], values.shape[-1]), dtype=keys.dtype)
        for group, result in zip(groups, attended):
            out[group.rows] = result
    return out.reshape(q.shape[0], -1)


def bind_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: Any, layer: int, scale: float,
    memo: AttentionMemo | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> Any:
    """`attention` bound for a replayed plan (graph.Plan) where these arguments take the native
    kernel's decode path: its output and arguments made once. Each call checks what a step may
    change (the view's cache and cells) and takes `attention` itself where that path no longer
    applies; None where it does not apply now."""
    if softcap is not None or sinks is not None or memo is None or q.dtype is not torch.float32 or not q.is_contiguous():
        return None
    keys, values = cache.keys(layer), cache.values(layer)
    if isinstance(keys, QuantizedCells) or not memo.takes_row_attention(q, keys, values):
        return None
    rows = q.shape[0]
    if not memo.row_regions(cache.layer_groups(layer), cache.layer_slots(layer), rows)[1] or not (native.plain_heads(k) and native.plain_heads(v)):
        return None
    out, run = native.bind_row_attention(rows, q.shape[1], q.shape[2], values.shape[-1], scale, k.stride(0), v.stride(0))
    flat = out.view(rows, -1)

    def call(q, k, v, cache, layer, scale, memo, softcap, sinks):  # the node's own arguments
        keys, values = cache.keys(layer), cache.values(layer)
        if isinstance(keys, QuantizedCells) or not memo.takes_row_attention(q, keys, values):
            return attention(q, k, v, cache, layer, scale, memo, softcap, sinks)
        regions, decode_only = memo.row_regions(cache.layer_groups(layer), cache.layer_slots(layer), rows)
        if not decode_only:
            return attention(q, k, v, cache, layer, scale, memo, softcap, sinks)
        run(q, keys, values, regions, k, v)
        return flat

    return call


def _scored_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, groups: list[Any], scale: float, softcap: float | None, sinks: Any
) -> torch.Tensor:
    """Attention whose scores change before the softmax (soft-capped, or joined by sink logits),
    which SDPA cannot do: the scores written out, in float32, one sequence at a time (so a row's
    result depends on its own sequence alone)."""
    heads, kv_heads = q.shape[1], keys.shape[0]
    out = q.new_empty((q.shape[0], heads, values.shape[-1]), dtype=torch.float32)
    for group in groups:
        cells = slice(group.start, group.start + group.used)
        queries = q[group.rows].float().transpose(0, 1)  # [heads, rows, dim]
        k = read_cells(keys, lambda t: t[:, cells]).float().repeat_interleave(heads // kv_heads, dim=0)  # [heads, used, dim]
        v = read_cells(values, lambda t: t[:, cells]).float().repeat_interleave(heads // kv_heads, dim=0)
        scores = torch.matmul(queries, k.transpose(1, 2)) * scale  # [heads, rows, used]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if group.mask is not None:
            scores = scores.masked_fill(~group.mask, float("-inf"))
        if sinks is not None:
            # A sink is one more logit in each row's softmax, with no value to weigh.
            sink = sinks.float().reshape(heads, 1, 1).expand(heads, scores.shape[1], 1)
            weights = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        else:
            weights = torch.softmax(scores, dim=-1)
        out[group.rows] = torch.matmul(weights, v).transpose(0, 1)
    return out.to(keys.dtype).reshape(q.shape[0], -1)


def _compute_dtype(rows: int, cached: torch.dtype) -> torch.dtype:
    """float32 for a prompt run of FLOAT_ATTENTION_ROWS rows or more (the CPU kernel is faster there
    than in bf16; measured: BENCHMARKS.md, Measurements behind code decisions), else the cache's
    dtype: chosen by the sequence's own rows."""
    return torch.float32 if rows >= FLOAT_ATTENTION_ROWS else cached





def _sequence_attention(queries: torch.Tensor, keys: Any, values: Any, group: Any, scale: float, gqa: bool) -> torch.Tensor:
    """One sequence's attention [rows, heads, dim], in the cache's dtype, computed in the queries'
    dtype: queries [1, heads, rows, dim] over its cells of the keys and values buffers [kv_heads, cells, dim]."""
    cells = slice(group.start, group.start + group.used)
    cached = keys.dtype
    keys, values = (read_cells(buffer, lambda t: t[:, cells]).unsqueeze(0) for buffer in (keys, values))
    if queries.dtype != cached:
        keys, values = keys.to(queries.dtype), values.to(queries.dtype)
    out = _sdpa(queries, keys, values, group.mask, scale, gqa)[0]
    return out.transpose(0, 1) if out.dtype == cached else out.transpose(0, 1).to(cached)


def _sdpa(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: Any, scale: float, gqa: bool) -> torch.Tensor:
    """SDPA of queries [b, heads, rows, dim] over [b, kv_heads, cells, dim]. A single query row's
    heads that share a kv head are passed as rows of that head instead: the same products, but
    torch's grouped-query path in bf16 is much slower (it copies the keys per head;
    measured: BENCHMARKS.md, Measurements behind code decisions)."""
    batch, heads, rows, dim = queries.shape
    if not gqa or rows != 1:
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
    kv_heads = keys.shape[1]
    folded = queries.reshape(batch, kv_heads, heads // kv_heads, dim)
    if batch * kv_heads == 1:
        # One (sequence, kv head) pair is a single work item: SDPA then runs it outside a parallel
        # region, where MKL multithreads its products and sums in another order than the same item
        # gets in a call of two or more (a sequence's decode batched with another's). Seen as lone
        # decode rows of single-kv-head models (Gemma 3 270M) differing in the last bits from
        # batched ones. The pair is passed twice, as views: every call then has two or more items.
        out = F.scaled_dot_product_attention(folded.expand(2, -1, -1, -1), keys.expand(2, -1, -1, -1), values.expand(2, -1, -1, -1), attn_mask=mask, scale=scale)[:1]
        return out.reshape(batch, heads, 1, values.shape[-1])
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(batch, heads, 1, values.shape[-1])


def _decode_batches(groups: list[Any]) -> list[list[int]]:
    """Decode rows of sequences that read as many cells, all of them (no mask): one call for each
    such set of two or more. Sequences that advance in step (several samples of one prompt,
    prompts of one length) meet this every step; reading whole buckets of cells with a mask
    instead would batch any lengths, but is slower at batch 1
    (measured: BENCHMARKS.md, Measurements behind code decisions)."""
    batches: dict[int, list[int]] = {}
    for i, group in enumerate(groups):
        if group.mask is None and isinstance(group.rows, slice) and group.rows.stop - group.rows.start == 1:
            batches.setdefault(group.used, []).append(i)
    return [members for members in batches.values() if len(members) > 1]


def _decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, groups: list[Any], scale: float, gqa: bool
) -> list[torch.Tensor]:
    """The decode rows of several sequences in one call ([1, heads, dim] each). The kernel computes
    every (sequence, head) pair on its own over the same cells as a call for that sequence alone,
    so each result has the same bits either way."""
    rows = [group.rows.start for group in groups]
    consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
    queries = (q[rows[0] : rows[0] + len(rows)] if consecutive else q[rows]).to(keys.dtype).unsqueeze(2)  # [seqs, heads, 1, dim]
    starts, used = [group.start for group in groups], groups[0].used
    keys, values = (read_cells(buffer, lambda t: _regions(t, starts, used)) for buffer in (keys, values))
    out = _sdpa(queries, keys, values, None, scale, gqa)
    return list(out.transpose(1, 2).unbind(0))


def _regions(buffer: torch.Tensor, starts: list[int], used: int) -> torch.Tensor:
    """Cells [start, start + used) of buffer [kv_heads, cells, dim] for each start: [len(starts), kv_heads, used, dim].
    Evenly spaced ascending regions (sequences in slot order) are a view; others are gathered."""
    steps = {b - a for a, b in zip(starts, starts[1:])}
    if len(steps) <= 1 and min(steps, default=0) >= 0:
        step = steps.pop() if steps else 0
        heads_stride, cell_stride, dim_stride = buffer.stride()
        return buffer.as_strided(
            (len(starts), buffer.shape[0], used, buffer.shape[2]),
            (step * cell_stride, heads_stride, cell_stride, dim_stride),
            buffer.storage_offset() + starts[0] * cell_stride,
        )
    return torch.stack([buffer[:, start : start + used] for start in starts])


def _row_count(rows: Any) -> int:
    return rows.stop - rows.start if isinstance(rows, slice) else len(rows)


def _in_row_order(groups: list[Any], rows: int) -> bool:
    """Whether the groups' rows are consecutive slices covering all `rows` in order (their results then just concatenate)."""
    start = 0
    for group in groups:
        if not isinstance(group.rows, slice) or group.rows.start != start:
            return False
        start = group.rows.stop
    return start == rows
