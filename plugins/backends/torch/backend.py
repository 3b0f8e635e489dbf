"""The PyTorch backend: CPU and CUDA.

Weights (precision "auto", CPU; layouts in torch_weights.py): Q4_0/Q4_1/Q4_K linears stay 4-bit
(the native kernel's blocks, else torch's packed int4 layout); other quantized linears become int8
per row; float files stay float32; the logits come from a 4-bit copy with each row's best
candidates recomputed exactly from the file; embeddings are read from the file's memory map. On
CUDA, non-int4 linears are bf16. Precision "fp32" loads everything as float32: the reference mode.
The residual stream, norms and rope run in float32. Measurements: BENCHMARKS.md.

Kernels: torch's, plus native C kernels built for this CPU on first use (torch_native.py) where
torch has none that fits: the 4-bit and int8 matmuls with exact integer products, rms_norm, gated
activations, and attention of every row (prompt or decode) over its own cells. Without a C
compiler or AVX-512 the backend runs on torch's alone.

Batch invariance: a sequence's output must not depend on what it is batched with. The int and
native kernels compute every row alone, and attention reads each sequence's own cache region
(torch_attention.py); BLAS does not (it picks its algorithm by the row count), so a float linear
runs each sequence's prompt chunk as its own call and single rows in chunks of 2..8, and long
prompt runs of the int layouts take their prompt paths (torch_weights.py) chosen by the run's own
length.

Graphs are recorded as (function, arguments) nodes (torch_graph.py), rewritten once by the fusion
passes (torch_fusion.py), reused for later batches of the same shape and run eagerly by `compute()`
(as generated straight-line Python from a graph's second run).
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
from corral.plugins.backends.torch import dequantize as torch_quant
from corral.plugins.backends.torch import native as torch_native
from corral.plugins.backends.torch.attention import attention
from corral.plugins.backends.torch.fusion import fuse_gates, fuse_linears, fuse_ropes, stack_weights
from corral.plugins.backends.torch.graph import Graph, GraphCache, Node, Slot
from corral.plugins.backends.torch.layouts import DenseWeight, Int4Blocks, Int4Weight, Int8Weight, MappedRows, RescoredLogits, requantized_int4

INT4_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K})
FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})
PRECISIONS = ("auto", "fp32")


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
            codes, scales, mins = torch_quant.int4_blocks(raw, info.qtype, cols)
            return self._pack_int4(codes, scales, mins, MappedRows(raw, info.qtype, cols) if cpu else None)
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

    def _pack_int4(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, source: MappedRows | None) -> Int4Blocks | Int4Weight:
        out_features, in_features = codes.shape
        if self.device.type == "cpu" and Int4Blocks.takes(out_features, in_features):
            return Int4Blocks.from_codes(codes, scales, mins)
        zeros = mins + 8 * scales
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

    def native(self, name: str) -> bool:
        """Whether the native CPU kernel `name` (torch_native.py) serves this backend."""
        return self.device.type == "cpu" and torch_native.has(name)

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
        (output,) = fuse_ropes(self, (output,), _rope)
        if self.backend.native("gated"):
            (output,) = fuse_gates(self, (output,), {fn: name for name, fn in GATED.items()}, _gated)
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
        if self.backend.native("rms_norm") and weight.dtype == torch.float32 and weight.is_contiguous():
            return self.record(torch_native.rms_norm, x, weight, eps)
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
        return self.record(attention, q, k, v, Slot("view") if cache is self.view else cache, layer, scale)

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
        if approximate == "tanh":
            return self.record(_gelu_tanh, x)
        return self.record(lambda t: F.gelu(t, approximate=approximate), x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# The activations a fused gate computes (by torch_native.gated's names), as the graph records them.
GATED = {"silu": F.silu, "gelu_tanh": _gelu_tanh}


def _gated(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """activation(gate) * up: natively in one pass for float32 rows on the CPU, else torch's two kernels."""
    if gate.dtype == up.dtype == torch.float32 and gate.device.type == "cpu" and gate.dim() == 2 and gate.stride(1) == up.stride(1) == 1:
        return torch_native.gated(gate, up, activation)
    return GATED[activation](gate) * up


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


def _cached_keys(keys: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
    return keys.index_select(1, cells).transpose(0, 1).float()


def _store_keys(keys: torch.Tensor, cells: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    keys.index_copy_(1, cells, new.transpose(0, 1).to(keys.dtype))
    return keys
