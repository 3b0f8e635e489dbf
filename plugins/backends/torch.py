"""The PyTorch backend: CPU and CUDA.

Weights (precision "auto", CPU; layouts in torch_weights.py): Q4_0/Q4_1/Q4_K linears stay 4-bit in
torch's packed int4 layout; other quantized linears become int8 per row; float files stay float32;
the logits come from a 4-bit copy with each row's best candidates recomputed exactly from the file;
embeddings are read from the file's memory map. On CUDA, non-int4 linears are bf16. Precision
"fp32" loads everything as float32: the reference mode. The residual stream, norms and rope run in
float32. Measurements: BENCHMARKS.md.

Batch invariance: a sequence's output must not depend on what it is batched with. The int kernels
compute every row alone, and attention runs one call per sequence over its own cache region; BLAS
does not (it picks its algorithm by the row count), so a float linear runs each sequence's prompt
chunk as its own call and single rows in chunks of 2..8, and long prompt runs of the int layouts
take their prompt paths (torch_weights.py) chosen by the run's own length.

Graphs are recorded as (function, arguments) nodes (torch_graph.py), rewritten once by the fusion
pass (torch_fusion.py), reused for later batches of the same shape and run eagerly by `compute()`.
"""

from __future__ import annotations

import operator
import warnings
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from corral.errors import UnsupportedTensorTypeError
from corral.gguf import GGUFFile, TensorInfo
from corral.model import Batch
from corral.hookspecs import hookimpl
from corral.plugins.backends import torch_quant
from corral.plugins.backends.torch_fusion import fuse_linears, stack_weights
from corral.plugins.backends.torch_graph import Graph, GraphCache, Node, Slot
from corral.plugins.backends.torch_weights import DenseWeight, Int4Weight, Int8Weight, MappedRows, RescoredLogits, requantized_int4

INT4_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K})
FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})
PRECISIONS = ("auto", "fp32")
# Query rows of one sequence from which its attention runs in float32 (see _sequence_attention).
FLOAT_ATTENTION_ROWS = 32


@hookimpl
def register_backends(register):
    register("torch", TorchBackend)


def _raw_tensor(gguf: GGUFFile, info: TensorInfo) -> torch.Tensor:
    with warnings.catch_warnings():
        # The mapping is read-only; conversions below always produce new tensors.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(gguf.raw(info.name))


class TorchBackend:
    """Loads GGUF tensors into torch layouts (torch_weights.py) and runs recorded graphs."""

    name = "torch"

    def __init__(self, device: str | None = None, precision: str = "auto"):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.precision = precision
        reference = precision == "fp32"
        self.dense_dtype = torch.bfloat16 if self.device.type == "cuda" and not reference else torch.float32
        self.kv_dtype = torch.float32 if reference else torch.bfloat16
        self._dense: dict[str, torch.Tensor] = {}
        self._graphs = GraphCache()
        self._stacked: dict[tuple[int, ...], tuple[Any, list[Any]]] = {}

    def load_tensor(self, gguf: GGUFFile, info: TensorInfo, role: str) -> Any:
        """Convert one GGUF tensor for `role` ("linear", "logits", "embedding" or "vector")."""
        if info.qtype not in torch_quant.DEQUANTIZERS:
            raise UnsupportedTensorTypeError(
                f"{gguf.path}: tensor '{info.name}' has type {getattr(info.qtype, 'name', info.qtype)}, which the "
                f"torch backend cannot load (it loads {', '.join(t.name for t in torch_quant.DEQUANTIZERS)})"
            )
        raw = _raw_tensor(gguf, info)
        cols = info.shape[-1]
        cpu = self.device.type == "cpu"
        if role == "vector":
            return torch_quant.dequantize(raw, info.qtype, cols).reshape(info.shape).to(self.device)
        if role == "embedding" and cpu:
            return MappedRows(raw, info.qtype, cols)
        if role == "linear" and self._keeps_int4(info):
            codes, scales, zeros = torch_quant.int4_codes(raw, info.qtype, cols)
            return self._pack_int4(codes, scales, zeros, MappedRows(raw, info.qtype, cols) if cpu else None)
        if self._keeps_int8(info) and cpu:
            if role == "logits":
                return RescoredLogits(self._approximate_logits(raw, info), MappedRows(raw, info.qtype, cols))
            return Int8Weight.from_gguf(raw, info.qtype, cols)
        dtype = torch.float32 if role in ("logits", "embedding") else self.dense_dtype
        dense = self._dequantized(info, raw, dtype)
        return dense if role == "embedding" else DenseWeight(dense)

    def _dequantized(self, info: TensorInfo, raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # A tied embedding is bound as "embedding" and as "logits": one dense copy serves both.
        key = f"{info.name}:{dtype}"
        if key not in self._dense:
            self._dense[key] = torch_quant.dequantize(raw, info.qtype, info.shape[-1], dtype=dtype).reshape(info.shape).to(self.device)
        return self._dense[key]

    def _keeps_int4(self, info: TensorInfo) -> bool:
        if self.precision != "auto" or info.qtype not in INT4_TYPES or len(info.shape) != 2:
            return False
        # The packed kernels tile output rows by 16 on CPU and 8 on CUDA; others are dequantized.
        rows_multiple = 8 if self.device.type == "cuda" else 16
        return info.shape[0] % rows_multiple == 0 and info.shape[1] % torch_quant.INT4_GROUP == 0

    def _approximate_logits(self, raw: torch.Tensor, info: TensorInfo) -> Int4Weight | Int8Weight:
        rows, cols = info.shape
        if rows % 16 == 0 and cols % torch_quant.INT4_GROUP == 0:  # the CPU int4 kernel's shapes
            return requantized_int4(raw, info.qtype, cols)
        return Int8Weight.from_gguf(raw, info.qtype, cols)

    def _keeps_int8(self, info: TensorInfo) -> bool:
        # Quantized files hold at most 8 bits a weight: int8 per row loses little of it. Float
        # files keep their precision.
        return self.precision == "auto" and info.qtype not in FLOAT_TYPES and len(info.shape) == 2

    def _pack_int4(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, source: MappedRows | None) -> Int4Weight:
        out_features, in_features = codes.shape
        if self.device.type == "cuda":
            packed, sz = torch_quant.pack_int4_for_cuda(codes.to(self.device), scales.to(self.device), zeros.to(self.device))
        else:
            packed, sz = torch_quant.pack_int4_for_cpu(codes, scales, zeros)
        return Int4Weight(packed, sz, out_features, in_features, source)

    def stacked_weight(self, weights: list[Any]) -> Any | None:
        """The weights stacked by rows into one (built once per group), or None when they do not stack."""
        key = tuple(id(w) for w in weights)
        if key not in self._stacked:
            self._stacked[key] = (stack_weights(weights), weights)  # the originals kept alive with their key
        return self._stacked[key][0]

    def set_threads(self, count: int) -> None:
        """Compute threads for CPU kernels (torch's setting is process-wide)."""
        torch.set_num_threads(count)

    def new_context(self, batch: Batch | None = None, view: Any = None) -> TorchContext:
        return TorchContext(self, batch, view)

    def run(self, model: Any, batch: Batch, view: Any) -> torch.Tensor:
        """The logits of `batch` through `model`; a graph recorded for a batch of this shape is reused."""
        return self._graphs.run(model, batch, view, self.new_context)

    def kv_buffer(self, shape: Sequence[int]) -> torch.Tensor:
        return torch.zeros(tuple(shape), dtype=self.kv_dtype, device=self.device)

    def from_numpy(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def to_numpy(self, value: torch.Tensor) -> np.ndarray:
        return value.detach().to(device="cpu", dtype=torch.float32).numpy()

    def weight_bytes(self, weight: Any) -> int:
        return weight.nbytes


class TorchContext(Graph):
    """Records the ops of ml.Context as graph nodes; `compute()` runs them."""

    def __init__(self, backend: TorchBackend, batch: Batch | None = None, view: Any = None):
        super().__init__(batch, view)
        self.backend = backend
        self._rope_tables: dict[tuple, Node] = {}

    def optimize(self, output: Node) -> Node:
        (output,) = fuse_linears(self, (output,), _linear, self.backend.stacked_weight)
        return output

    # --- ops -------------------------------------------------------------------------------
    def input(self, values: np.ndarray) -> Node:
        slot = self.batch_slot(values)
        return self.record(self._input, slot if slot is not None else values)

    def _input(self, values: np.ndarray) -> torch.Tensor:
        return self.backend.from_numpy(np.asarray(values, dtype=np.int64))

    def embedding(self, weight: Any, ids: Node) -> Node:
        if isinstance(weight, MappedRows):
            return self.record(MappedRows.rows, weight, ids)
        return self.record(lambda w, i: F.embedding(i, w).float(), weight, ids)

    def linear(self, x: Node, weight: Any, bias: Any = None) -> Node:
        return self.record(_linear, x, weight, bias, Slot("runs") if self.batch is not None else None)

    def rms_norm(self, x: Node, weight: torch.Tensor, eps: float) -> Node:
        return self.record(lambda t, w: F.rms_norm(t.float(), (t.shape[-1],), w, eps), x, weight)

    def layer_norm(self, x: Node, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> Node:
        return self.record(lambda t, w, b: F.layer_norm(t.float(), (t.shape[-1],), w, b, eps), x, weight, bias)

    def rope(self, x: Node, positions: Node, *, dims: int, base: float, scale: float = 1.0, neox: bool) -> Node:
        # Every layer rotates by the same positions: build each cos/sin table once per graph.
        key = (positions.index, dims, base, scale, neox)
        if key not in self._rope_tables:
            self._rope_tables[key] = self.record(_rope_table, positions, dims, base, scale, neox)
        return self.record(_rope, x, self._rope_tables[key], dims, neox)

    def attention(self, q: Node, k: Node, v: Node, cache: Any, layer: int, scale: float) -> Node:
        if cache is not self.view:
            self.replayable = False
        return self.record(_attention, q, k, v, Slot("view") if cache is self.view else cache, layer, scale)

    def cached_keys(self, keys: Any, cells: Node) -> Node:
        return self.record(_cached_keys, keys, cells)

    def store_keys(self, keys: Any, cells: Node, new: Node) -> Node:
        return self.record(_store_keys, keys, cells, new)

    def reshape(self, x: Node, shape: Sequence[int]) -> Node:
        return self.record(torch.reshape, x, tuple(shape))

    def rows(self, x: Node, indices: Node) -> Node:
        return self.record(torch.index_select, x, 0, indices)

    def split(self, x: Node, sizes: Sequence[int], dim: int = -1) -> tuple[Node, ...]:
        parts = self.record(torch.split, x, list(sizes), dim)
        return tuple(self.record(operator.getitem, parts, i) for i in range(len(sizes)))

    def scale(self, x: Node, factor: float) -> Node:
        return self.record(torch.mul, x, factor)

    def silu(self, x: Node) -> Node:
        return self.record(F.silu, x)

    def gelu(self, x: Node, approximate: str = "tanh") -> Node:
        return self.record(lambda t: F.gelu(t, approximate=approximate), x)


def _linear(x: torch.Tensor, weight: Any, bias: torch.Tensor | None, runs: list[tuple[int, int]] | None) -> torch.Tensor:
    y = weight.matmul(x, runs)
    return y if bias is None else y + bias


def _rope_table(positions: torch.Tensor, dims: int, base: float, scale: float, neox: bool) -> Any:
    """The rotation of each position, laid out like the features it turns: for adjacent pairs, the
    complex unit e^(i angle) [n, 1, dims/2]; for halves, cos and signed sin [n, 1, dims]."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dims, 2, device=positions.device, dtype=torch.float32) / dims))
    angles = (positions.float() * scale)[:, None] * inv_freq[None, :]  # [n, dims/2]
    if not neox:
        return torch.polar(torch.ones_like(angles), angles)[:, None, :]
    cos, sin = angles.cos(), angles.sin()
    return torch.cat((cos, cos), -1)[:, None, :], torch.cat((-sin, sin), -1)[:, None, :]


def _rope(x: torch.Tensor, table: Any, dims: int, neox: bool) -> torch.Tensor:
    # x: [n, heads, head_dim]; only the first `dims` features rotate. Adjacent pairs (a, b) are the
    # complex number a + ib, turned by one complex product; halves rotate as x * cos +
    # swapped(x) * signed sin, three kernels.
    partial = dims < x.shape[-1]
    rot = x[..., :dims] if partial else x
    if neox:
        cos, sin = table
        out = torch.addcmul(rot * cos, rot.roll(dims // 2, dims=-1), sin)
    else:
        pairs = rot.float().unflatten(-1, (dims // 2, 2))
        if pairs.storage_offset() % 2:  # a complex view needs pairs aligned to their size
            pairs = pairs.contiguous()
        out = torch.view_as_real(torch.view_as_complex(pairs) * table).flatten(-2)
    return torch.cat((out, x[..., dims:].float()), dim=-1) if partial else out


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: Any, layer: int, scale: float) -> torch.Tensor:
    keys, values = cache.keys(layer), cache.values(layer)  # [kv_heads, cells, dim]
    cells = cache.layer_slots(layer)
    _write_cells(keys, cells, k)
    _write_cells(values, cells, v)
    groups = cache.layer_groups(layer)
    # One call per sequence over its own cells only: its result never depends on the batch. A
    # prompt run of FLOAT_ATTENTION_ROWS rows or more computes in float32 (the CPU kernel is ~1.8x
    # faster there than in bf16), chosen by the run's own length.
    dtypes = [torch.float32 if _row_count(group.rows) >= FLOAT_ATTENTION_ROWS else keys.dtype for group in groups]
    queries = {dtype: q.to(dtype).transpose(0, 1).unsqueeze(0) for dtype in set(dtypes)}  # [1, heads, n, dim]
    gqa = q.shape[1] != k.shape[1]
    attended: list[Any] = [None] * len(groups)
    for members in _decode_batches(groups):
        results = _decode_attention(q, keys, values, [groups[i] for i in members], scale, gqa)
        for i, result in zip(members, results):
            attended[i] = result
    keys, values = keys.unsqueeze(0), values.unsqueeze(0)
    for i, (group, dtype) in enumerate(zip(groups, dtypes)):
        if attended[i] is None:
            attended[i] = _sequence_attention(queries[dtype][:, :, group.rows], keys, values, group, scale, gqa)
    if _in_row_order(groups, q.shape[0]):
        out = attended[0] if len(attended) == 1 else torch.cat(attended)
    else:
        out = keys.new_empty((q.shape[0], q.shape[1], values.shape[-1]))
        for group, result in zip(groups, attended):
            out[group.rows] = result
    return out.reshape(q.shape[0], -1)


def _write_cells(buffer: torch.Tensor, cells: Any, new: torch.Tensor) -> None:
    """Store rows [n, heads, dim] into cache cells (a slice or an index) of buffer [heads, cells, dim]."""
    if isinstance(cells, slice):
        buffer[:, cells].copy_(new.transpose(0, 1))  # one kernel, converting as it copies
    else:
        buffer.index_copy_(1, cells, new.transpose(0, 1).to(buffer.dtype))


def _sequence_attention(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, group: Any, scale: float, gqa: bool
) -> torch.Tensor:
    """One sequence's attention [rows, heads, dim], in the cache's dtype, computed in the queries'
    dtype: queries [1, heads, rows, dim] over its cells of keys and values [1, kv_heads, cells, dim]."""
    cells = slice(group.start, group.start + group.used)
    cached = keys.dtype
    keys, values = keys[:, :, cells], values[:, :, cells]
    if queries.dtype != cached:
        keys, values = keys.to(queries.dtype), values.to(queries.dtype)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.mask, scale=scale, enable_gqa=gqa)[0]
    return out.transpose(0, 1) if out.dtype == cached else out.transpose(0, 1).to(cached)


def _decode_batches(groups: list[Any]) -> list[list[int]]:
    """Decode rows of sequences that read as many cells, all of them (no mask): one call for each
    such set of two or more. Sequences that advance in step (several samples of one prompt,
    prompts of one length) meet this every step; reading whole buckets of cells with a mask
    instead would batch any lengths, but measured ~10% slower at batch 1."""
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
    out = F.scaled_dot_product_attention(
        queries, _regions(keys, starts, used), _regions(values, starts, used), scale=scale, enable_gqa=gqa
    )
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


def _cached_keys(keys: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
    return keys.index_select(1, cells).transpose(0, 1).float()


def _store_keys(keys: torch.Tensor, cells: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    keys.index_copy_(1, cells, new.transpose(0, 1).to(keys.dtype))
    return keys
